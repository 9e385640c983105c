"""Hypothesis state machines: the allocator's invariants hold after every operation.

Each machine drives one KV cache manager over a small pool with a mix of groups: admit
(with prefix hits and a first chunk), extend a prefill by a chunk, decode, preempt and
readmit, finish, and fail a step. It mirrors what every page should hold, so a prefix hit
that would serve the wrong tokens fails the test.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.memory import KVCacheManager
from hybridkv.policies import (
    ChunkedLocal,
    FullAttention,
    MambaLike,
    MemoryPolicy,
    SlidingWindow,
    cdiv,
)

BS = 4
PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9, 9), (7,) * 13]


@attrs.define
class Req:
    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple[object, ...] = ()
    prompt_len: int = 0
    start: int = 0  # computed tokens before the latest allocation
    end: int = 0  # tokens with slots


class AllocatorMachine(RuleBasedStateMachine):
    POLICIES: ClassVar[tuple[MemoryPolicy, ...]] = (FullAttention(), SlidingWindow(window=6))
    NUM_BLOCKS: ClassVar[int] = 24

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(self.POLICIES, self.NUM_BLOCKS, BS)
        self.running: dict[str, Req] = {}
        self.preempted: list[Req] = []
        self.content: list[dict[int, tuple[int, ...]]] = [{} for _ in self.POLICIES]
        self.count = 0

    # -- helpers -----------------------------------------------------------------------

    def snapshot(self) -> object:
        pool = self.mgr.pool
        pages = range(pool.num_blocks)
        return (
            {rid: [t[:] for t in self.mgr.block_tables(rid)] for rid in self.running},
            [pool.ref_count(p) for p in pages],
            [p for p in pages if pool.is_free(p)],
            [dict(pool.cached_blocks(g)) for g in range(len(self.POLICIES))],
        )

    def allocate(self, req: Req, num: int, admit: bool) -> bool:
        before = self.snapshot()
        if admit:
            hit = self.mgr.lookup(req)
            num = min(num, len(req.all_token_ids) - hit.num_tokens)
            self.check_hit_content(req, hit.block_tables)
            start = hit.num_tokens
            new = self.mgr.allocate(req, num, hit)
        else:
            start = req.end
            new = self.mgr.allocate(req, num)
        if new is None:
            assert self.snapshot() == before, "a failed allocation changed state"
            return False
        for group, pages in enumerate(new):
            for page in pages:
                self.content[group].pop(page, None)
        req.start, req.end = start, start + num
        self.record_content(req)
        self.running[req.request_id] = req
        return True

    def check_hit_content(self, req: Req, pages: tuple[tuple[int, ...], ...]) -> None:
        for group, table in enumerate(pages):
            for i, page in enumerate(table):
                if page:
                    want = tuple(req.all_token_ids[: (i + 1) * BS])
                    assert self.content[group][page] == want, "hit serves wrong tokens"

    def record_content(self, req: Req) -> None:
        for group, table in enumerate(self.mgr.block_tables(req.request_id)):
            for i in range(req.start // BS, req.end // BS):
                if table[i]:
                    self.content[group][table[i]] = tuple(req.all_token_ids[: (i + 1) * BS])

    def forget_last_step(self, req: Req) -> None:
        for group, table in enumerate(self.mgr.block_tables(req.request_id)):
            for i in range(req.start // BS, cdiv(req.end, BS)):
                self.content[group].pop(table[i], None)

    # -- rules -------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=12),
        chunk=st.integers(1, 16),
    )
    def admit(self, prefix: tuple[int, ...], tail: list[int], chunk: int) -> None:
        self.count += 1
        tokens = [*prefix, *tail]
        self.allocate(Req(f"r{self.count}", tokens, prompt_len=len(tokens)), chunk, admit=True)

    @precondition(lambda self: any(r.end < r.prompt_len for r in self.running.values()))
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def extend_prefill(self, data: st.DataObject, chunk: int) -> None:
        todo = sorted(r for r, q in self.running.items() if q.end < q.prompt_len)
        req = self.running[data.draw(st.sampled_from(todo))]
        self.allocate(req, min(chunk, req.prompt_len - req.end), admit=False)

    @precondition(lambda self: any(r.end >= r.prompt_len for r in self.running.values()))
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        ready = sorted(r for r, q in self.running.items() if q.end >= q.prompt_len)
        req = self.running[data.draw(st.sampled_from(ready))]
        req.all_token_ids.append(token)
        if not self.allocate(req, 1, admit=False):
            req.all_token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.mgr.free(req.request_id)
        req.prompt_len = len(req.all_token_ids)  # recomputed from all its tokens
        self.preempted.append(req)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), chunk=st.integers(1, 32))
    def readmit(self, data: st.DataObject, chunk: int) -> None:
        req = self.preempted.pop(data.draw(st.integers(0, len(self.preempted) - 1)))
        if not self.allocate(req, chunk, admit=True):
            self.preempted.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.mgr.free(req.request_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fail_step(self, data: st.DataObject) -> None:
        """The executor failed: the step's blocks were never written."""
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.forget_last_step(req)
        self.mgr.free(req.request_id, computed=False)

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def pool_is_exact(self) -> None:
        self.mgr.check_integrity()
        usage = self.mgr.usage()
        assert usage.num_free_blocks + sum(usage.blocks_used_per_group) == self.NUM_BLOCKS - 1

    @invariant()
    def requests_hold_only_live_blocks(self) -> None:
        for req in self.running.values():
            tables = self.mgr.block_tables(req.request_id)
            for policy, table in zip(self.POLICIES, tables, strict=True):
                allowed = set(range(req.start // BS, cdiv(req.end, BS)))
                for first, stop in policy.live_block_spans(req.start, BS):
                    allowed.update(range(first, stop))
                held = {i for i, page in enumerate(table) if page}
                assert held <= allowed, (policy, req.start, req.end, table)
                assert len(table) == cdiv(req.end, BS)


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class FullAndWindow(AllocatorMachine):
    POLICIES = (FullAttention(), SlidingWindow(window=6))


class TwoWindowsAndFull(AllocatorMachine):
    POLICIES = (SlidingWindow(window=3), SlidingWindow(window=9), FullAttention())


class FullAndMamba(AllocatorMachine):
    POLICIES = (FullAttention(), MambaLike())


class ChunkedAndWindows(AllocatorMachine):
    POLICIES = (ChunkedLocal(chunk=6), SlidingWindow(window=1), SlidingWindow(window=6))
    NUM_BLOCKS = 16


TestFullAndWindow = FullAndWindow.TestCase
TestTwoWindowsAndFull = TwoWindowsAndFull.TestCase
TestFullAndMamba = FullAndMamba.TestCase
TestChunkedAndWindows = ChunkedAndWindows.TestCase
for case in (TestFullAndWindow, TestTwoWindowsAndFull, TestFullAndMamba, TestChunkedAndWindows):
    case.settings = SETTINGS
