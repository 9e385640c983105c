"""Hypothesis state machines: the allocator's invariants hold after every operation.

Each machine drives one KV cache manager over a small pool with a mix of groups: admit
(with prefix hits and a first chunk), extend a prefill by a chunk, decode, preempt and
readmit, finish, start a finished request's next turn, and fail a step. The pool is small,
so allocations evict cached blocks all the time. The machine mirrors what every page
should hold, so a prefix hit that would serve the wrong tokens fails the test; it checks
that no allocation takes a page a running request holds, that a page a kept prefix needs
is evicted only once no page that none needs is left, and that a prefix a running request
resumed (pinned) gives up pages only once no other kept prefix holds a free page that
giving it up would free (a page a pinned prefix shares stays kept). The
manager's own check asserts each kept prefix's pins and eviction order entries.
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
    Span,
    cdiv,
)
from hybridkv.policies.base import positive

BS = 4
PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9, 9), (7,) * 13]


@attrs.frozen
class SinksAndWindow(MemoryPolicy):
    """A user's policy (not registered): the first ``sinks`` tokens and the last window."""

    sinks: int = attrs.field(validator=positive)
    window: int = attrs.field(validator=positive)

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        start = max(0, num_tokens - self.window + 1)
        if start <= self.sinks:
            return ((0, num_tokens),) if num_tokens else ()
        return ((0, self.sinks), (start, num_tokens))


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
    #: Page ids of a state page (two page sizes where above 1).
    STATE_SPAN: ClassVar[int] = 1

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(self.POLICIES, self.NUM_BLOCKS, BS, state_span=self.STATE_SPAN)
        self.widths = self.mgr.pool.widths
        self.running: dict[str, Req] = {}
        self.preempted: list[Req] = []
        self.finished: list[list[int]] = []  # token lists a next turn continues
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

    def ids(self, group: int, page: int) -> range:
        """The page ids ``page`` of ``group`` covers (a state page: its span)."""
        return range(page, page + self.widths[group]) if page else range(0)

    def cached_pages(self) -> set[tuple[int, int]]:
        pool = self.mgr.pool
        return {(g, p) for g in range(len(self.POLICIES)) for p in pool.cached_blocks(g).values()}

    def allocate(self, req: Req, num: int, admit: bool, spare: int = 0) -> bool:
        """Allocate ``num`` tokens (``spare``: first shortened by ``spare_chunk`` with
        ``at_least=spare``, as the planner does) and check what the pool gave."""
        before = self.snapshot()
        pool = self.mgr.pool
        held_by_others = {
            i
            for rid in self.running
            if rid != req.request_id
            for g, table in enumerate(self.mgr.block_tables(rid))
            for page in table
            for i in self.ids(g, page)
        }
        cached_before = self.cached_pages()
        spans = getattr(pool, "spans", None)  # a SpanPool's
        holes_in_use = set()  # holes of spans with a page in use: small pages go there first
        num_holes = 0
        if spans is not None:
            holes = set(spans.holes())
            num_holes = len(holes)
            holes_in_use = {p for p in holes if spans.used(p // spans.span)}
        free = [p for p in range(1, pool.num_blocks) if pool.is_free(p)]
        kept = {p for p in free if pool.is_kept(p)}
        cold = set(free) - kept
        held_idle = {p for k in pool.kept_prefixes() if not k.num_pins for p in k.held_pages}
        held_pinned = {p for k in pool.kept_prefixes() if k.num_pins for p in k.held_pages}
        pinned_only, idle_only = kept - held_idle, kept & held_idle - held_pinned
        hit_pages: set[int] = set()
        if admit:
            hit = self.mgr.lookup(req)
            num = min(num, len(req.all_token_ids) - hit.num_tokens)
            self.check_hit_content(req, hit.block_tables)
            hit_pages = {p for table in hit.block_tables for p in table}
            start = hit.num_tokens
            asked = num
            if spare:
                num = self.mgr.spare_chunk(req, num, hit, at_least=spare)
            new = self.mgr.allocate(req, num, hit)
        else:
            start = req.end
            asked = num
            if spare:
                num = self.mgr.spare_chunk(req, num, at_least=spare)
            new = self.mgr.allocate(req, num)
        if new is None:
            assert self.snapshot() == before, "a failed allocation changed state"
            return False
        taken = {page for pages in new for page in pages}
        taken_ids = {i for g, pages in enumerate(new) for p in pages for i in self.ids(g, p)}
        assert not taken_ids & held_by_others, "a page a running request holds was taken"
        if spans is None:
            if taken & kept:  # evicting a kept prefix's page: nothing else was left
                assert cold <= taken | hit_pages, "a kept page went before an unneeded one"
        else:
            self.check_span_order(new, cached_before, kept, cold, hit_pages | taken, num_holes)
            small = {p for g, pages in enumerate(new) if self.widths[g] == 1 for p in pages}
            k = spans.span
            from_empty = {p for p in small if all(
                i in holes for i in range(p - p % k, p - p % k + k))}  # fmt: skip
            if from_empty:  # a whole span broken: no hole of a span in use was left
                # (in use before and after, by other pages than this call took: a span
                # this call's releases emptied is as good as any empty one)
                taken_per_span = {}
                for i in taken_ids:
                    taken_per_span[i // k] = taken_per_span.get(i // k, 0) + 1
                left = set(spans.holes()) & holes_in_use
                kept_in_use = {
                    p for p in left if spans.used(p // k) - taken_per_span.get(p // k, 0) > 0
                }
                assert not kept_in_use, "a small page broke a span while holes were left"
        # Pages whose block is gone: taken, or (two page sizes) evicted to free a span.
        lost = taken | {p for _, p in cached_before - self.cached_pages()}
        if lost & pinned_only:  # a resumed prefix gave up pages: no other could free one
            assert idle_only <= lost | hit_pages, "a pinned prefix went first"
        if spare and spare < num < asked:  # shortened, above the floor: it had to fit
            assert not lost & kept, "a spared chunk took a kept prefix's page"
        for group, content in enumerate(self.content):  # what the taken ids held is gone
            width = self.widths[group]
            for i in taken_ids:
                content.pop(i - i % width, None)
        req.start, req.end = start, start + num
        self.record_content(req)
        self.running[req.request_id] = req
        return True

    def check_span_order(
        self,
        new: tuple[list[int], ...],
        cached_before: set[tuple[int, int]],
        kept: set[int],
        cold: set[int],
        hit_pages: set[int],
        num_holes: int,
    ) -> None:
        """Two page sizes: the pool evicts in eviction order, and only when it must
        (``hit_pages``: the hit's pages and the pages taken, which are not lost)."""
        evicted = {p for _, p in cached_before - self.cached_pages()}
        if evicted & kept:  # a kept prefix's page: every cached page nobody keeps went first
            cold_cached = {p for g, p in cached_before if p in cold}
            assert cold_cached <= evicted | hit_pages, "a kept page went before an unneeded one"
        num_small = sum(len(p) for g, p in enumerate(new) if self.widths[g] == 1)
        if evicted and num_small == sum(map(len, new)):  # small pages only: holes first
            assert num_holes < num_small, "a cached page evicted while holes were left"

    def check_hit_content(self, req: Req, pages: tuple[tuple[int, ...], ...]) -> None:
        for group, table in enumerate(pages):
            for i, page in enumerate(table):
                if page:
                    want = tuple(req.all_token_ids[: (i + 1) * BS])
                    assert self.content[group].get(page) == want, "hit serves wrong tokens"

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
        spare=st.sampled_from((0, 0, 1, 2, 5)),
    )
    def admit(self, prefix: tuple[int, ...], tail: list[int], chunk: int, spare: int) -> None:
        self.count += 1
        tokens = [*prefix, *tail]
        req = Req(f"r{self.count}", tokens, prompt_len=len(tokens))
        self.allocate(req, chunk, admit=True, spare=spare)

    @precondition(lambda self: any(r.end < r.prompt_len for r in self.running.values()))
    @rule(data=st.data(), chunk=st.integers(1, 16), spare=st.sampled_from((0, 0, 1, 2, 5)))
    def extend_prefill(self, data: st.DataObject, chunk: int, spare: int) -> None:
        todo = sorted(r for r, q in self.running.items() if q.end < q.prompt_len)
        req = self.running[data.draw(st.sampled_from(todo))]
        self.allocate(req, min(chunk, req.prompt_len - req.end), admit=False, spare=spare)

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
        self.finished.append(req.all_token_ids)

    @precondition(lambda self: self.finished)
    @rule(
        data=st.data(),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=8),
        chunk=st.integers(1, 32),
    )
    def next_turn(self, data: st.DataObject, tail: list[int], chunk: int) -> None:
        """A finished request's conversation goes on: it resumes from where that ended."""
        tokens = [*data.draw(st.sampled_from(self.finished)), *tail]
        self.count += 1
        self.allocate(Req(f"r{self.count}", tokens, prompt_len=len(tokens)), chunk, admit=True)

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
        held = sum(n * w for n, w in zip(usage.blocks_used_per_group, self.widths, strict=True))
        assert usage.num_free_blocks + held == self.NUM_BLOCKS - 1

    @invariant()
    def requests_hold_only_live_blocks(self) -> None:
        for req in self.running.values():
            tables = self.mgr.block_tables(req.request_id)
            for policy, table in zip(self.POLICIES, tables, strict=True):
                allowed = set(range(req.start // BS, cdiv(req.end, BS)))
                # Released at block starts: what the prefix of the filled blocks reads.
                for first, stop in policy.live_block_spans(req.start - req.start % BS, BS):
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


class FullAndUserPolicy(AllocatorMachine):
    """A user's policy, known to the allocator only through its live spans."""

    POLICIES = (FullAttention(), SinksAndWindow(sinks=3, window=6))


class ManySessionsTightPool(AllocatorMachine):
    """Conversations resumed again and again through a pool that holds few of them."""

    POLICIES = (FullAttention(), SlidingWindow(window=6), SlidingWindow(window=6))
    NUM_BLOCKS = 20


class FullAndMambaSpans(AllocatorMachine):
    """Two page sizes: a state page is a span of 4 page ids, carved from the K/V pages."""

    POLICIES = (FullAttention(), MambaLike(), SlidingWindow(window=6))
    NUM_BLOCKS = 40
    STATE_SPAN = 4


class MambaCheckpointsSpans(AllocatorMachine):
    """Two page sizes, states checkpointed every 2 blocks, in a pool that evicts a lot."""

    POLICIES = (MambaLike(checkpoint_every=2), FullAttention(), MambaLike(checkpoint_every=2))
    NUM_BLOCKS = 30
    STATE_SPAN = 3


class FullOnly(AllocatorMachine):
    """Nested prefixes alone: eviction shrinks them block by block."""

    POLICIES = (FullAttention(), FullAttention())
    NUM_BLOCKS = 16


TestFullAndWindow = FullAndWindow.TestCase
TestTwoWindowsAndFull = TwoWindowsAndFull.TestCase
TestFullAndMamba = FullAndMamba.TestCase
TestChunkedAndWindows = ChunkedAndWindows.TestCase
TestFullAndUserPolicy = FullAndUserPolicy.TestCase
TestFullOnly = FullOnly.TestCase
TestFullAndMambaSpans = FullAndMambaSpans.TestCase
TestMambaCheckpointsSpans = MambaCheckpointsSpans.TestCase
TestManySessionsTightPool = ManySessionsTightPool.TestCase
for _case in (
    TestFullAndWindow,
    TestTwoWindowsAndFull,
    TestFullAndMamba,
    TestChunkedAndWindows,
    TestFullAndUserPolicy,
    TestFullOnly,
    TestManySessionsTightPool,
    TestFullAndMambaSpans,
    TestMambaCheckpointsSpans,
):
    _case.settings = SETTINGS
