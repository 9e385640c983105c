"""Stand-ins for tests and the scheduling benchmark: a deterministic model, a list sink.

The next token is a pure function of the sequence so far, like a greedy model, and it is
computed the way a model would: through the paged KV cache. Each position's "K/V" is a
rolling hash of the tokens up to it, written into the page and slot the block tables
give; a step reads the hash of the position before its first token back from the pages::

    h(-1) = SEED      h(p) = mix(h(p-1), token[p])      next token = h(last) mod vocab

So a block table that points at a wrong, stale or reused page changes the output (or
raises :class:`FakeKVMismatchError`), which is what makes "same output with and without
preemption, chunking, prefix caching" a real test of the scheduler and the allocator.

Log-probabilities follow one made-up distribution (:func:`fake_logprobs`): after the hash
``h``, token ``a = (h >> 17) mod vocab`` is the most likely, and token ``t`` has
probability ``2 ** -(j + 1)`` with ``j = (t - a) mod vocab``, rank ``j + 1``.

:class:`~hybridkv.scheduler.fake_pipelined.PipelinedFakeExecutor` runs the fake behind a
chain of stage threads, so that the engine keeps several steps in flight as it would with
pipeline-parallel stages.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Sequence

from hybridkv.errors import HybridKVError
from hybridkv.memory.layout import PoolSpec
from hybridkv.memory.offload.blob import KVBlock
from hybridkv.memory.offload.config import OffloadConfig
from hybridkv.memory.offload.errors import CorruptBlockError
from hybridkv.memory.offload.keys import KeySpace
from hybridkv.memory.offload.transfers import LoadReport
from hybridkv.memory.offload.worker import TransferWorker
from hybridkv.scheduler.batch import StepBatch, StepRequest, StepResult
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.fake_state import FakeStatePages
from hybridkv.scheduler.outputs import RequestOutput, TokenLogprobs

_SEED = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3


class FakeKVMismatchError(HybridKVError):
    """The fake's pages disagree with each other: a block table was wrong."""


def reference_tokens(prompt: Sequence[int], num_tokens: int, vocab_size: int) -> list[int]:
    """The tokens the fake generates after ``prompt``, computed without any cache."""
    h = _SEED
    for token in prompt:
        h = ((h ^ token) * _PRIME) & _MASK
    out: list[int] = []
    for _ in range(num_tokens):
        token = (h >> 17) % vocab_size
        out.append(token)
        h = ((h ^ token) * _PRIME) & _MASK
    return out


def fake_logprobs(h: int, token_id: int, num_top: int, vocab_size: int) -> TokenLogprobs:
    """The fake's log-probabilities of ``token_id`` after hash ``h``, with ``num_top`` top."""
    top = (h >> 17) % vocab_size
    rank = (token_id - top) % vocab_size + 1
    return TokenLogprobs(
        token_id=token_id,
        logprob=-rank * math.log(2),
        rank=rank,
        top=tuple(((top + i) % vocab_size, -(i + 1) * math.log(2)) for i in range(num_top)),
    )


class FakeExecutor:
    """Runs steps on rolling hashes stored in pages: no model, exact cache semantics.

    Args:
        pool: The block pool (each KV group keeps its own blocks; all are written and
            checked).
        vocab_size: Tokens are drawn from ``[0, vocab_size)``.
        step_delay_s: Seconds each step sleeps, to stand for model time.
    """

    #: It verifies proposed tokens (speculative decoding), greedily.
    verifies_proposals = True

    def __init__(
        self, pool: PoolSpec, *, vocab_size: int = 32000, step_delay_s: float = 0.0
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_s
        # Flat per-group arrays (block * block_size + slot): compact, and unseen by the GC.
        size = 8 * pool.num_blocks * pool.block_size
        self._store = [array("Q", bytes(size)) for _ in pool.policies]
        # Groups whose pages hold a state per block follow the mamba contract, checked.
        self._kv_groups = [g for g, p in enumerate(pool.policies) if not p.keeps_state]
        # The group that wrote each page id last (-1: none yet): the groups share the ids
        # (a state page spans state_span of them), so a read of a page another group
        # overwrote fails.
        self._owner = array("q", [-1]) * pool.num_blocks
        self._states = FakeStatePages(
            [g for g, p in enumerate(pool.policies) if p.keeps_state],
            pool.num_blocks,
            pool.block_size,
            owner=self._owner,
            span=pool.state_span,
        )
        self.num_steps = 0
        self.transfers: TransferWorker | None = None

    @classmethod
    def for_config(
        cls, config: EngineConfig, *, vocab_size: int | None = None, step_delay_s: float = 0.0
    ) -> FakeExecutor:
        """A fake sized for an engine's pool (vocabulary: the config's, else 32000)."""
        return cls(
            config.pool,
            vocab_size=vocab_size or config.vocab_size or 32000,
            step_delay_s=step_delay_s,
        )

    def attach_offload(self, config: OffloadConfig) -> KeySpace:
        """Move pages to and from ``config``'s tiers (see ``scheduler/connector.py``)."""
        self.transfers = TransferWorker(self, config)
        kinds = [type(policy).__name__ for policy in self.pool.policies]
        name = f"fake{self.vocab_size}x{self.block_size}"
        return KeySpace(name, kinds, model=name)

    def close(self) -> None:
        """Stop the transfer worker, if any."""
        if self.transfers is not None:
            self.transfers.close()

    def read_pages(self, group: int, pages: Sequence[int]) -> list[KVBlock]:
        """The hashes of pages of ``group`` (a ``PageIO``); a state group's page: its
        state's hash and the tokens it covers."""
        if group in self._states.groups:
            return [KVBlock("uint64", (2,), self._states.record(group, p).tobytes()) for p in pages]
        bs, store = self.block_size, self._store[group]
        return [KVBlock("uint64", (bs,), store[p * bs : (p + 1) * bs].tobytes()) for p in pages]

    def write_pages(self, group: int, pages: Sequence[int], blocks: Sequence[KVBlock]) -> None:
        """Write hashes into pages of ``group`` (a ``PageIO``)."""
        if group in self._states.groups:
            for page, block in zip(pages, blocks, strict=True):
                if block.dtype != "uint64" or block.shape != (2,):
                    raise CorruptBlockError(f"a {block.dtype} {block.shape} block for a state")
                self._states.restore(group, page, array("Q", bytes(block.data)))
            return
        bs, store = self.block_size, self._store[group]
        for page, block in zip(pages, blocks, strict=True):
            if block.dtype != "uint64" or block.shape != (bs,):
                raise CorruptBlockError(f"a {block.dtype} {block.shape} block for a fake page")
            store[page * bs : (page + 1) * bs] = array("Q", bytes(block.data))
            self._owner[page] = group

    def execute(self, batch: StepBatch) -> StepResult:
        """Write each token's hash into its block, then sample from the last hash."""
        loads: tuple[LoadReport, ...] = ()
        if self.transfers is not None:
            loads = self.transfers.run(batch.transfers, is_idle=not batch.requests)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_steps += 1
        vocab = self.vocab_size
        tokens: list[int | None] = []
        logprobs: list[TokenLogprobs | None] = []
        prompt_logprobs: list[tuple[TokenLogprobs, ...]] = []
        accepted: list[int] = []
        accepted_logprobs: list[tuple[TokenLogprobs, ...]] = []
        for request in batch.requests:
            hashes, prompt = self._run(request)
            num_top = request.params.logprobs
            found: tuple[TokenLogprobs, ...] = ()
            if request.num_draft_tokens:
                h, num_accepted, found = self._verify(request, hashes)
                accepted.append(num_accepted)
            else:
                h = hashes[-1]
                accepted.append(0)
                if request.sample:
                    h = self._sampling_hash(request, h, request.start_position + len(hashes) - 1)
            accepted_logprobs.append(found)
            token = (h >> 17) % vocab if request.sample else None
            tokens.append(token)
            if token is None or num_top is None:
                logprobs.append(None)
            else:
                logprobs.append(fake_logprobs(h, token, num_top, vocab))
            prompt_logprobs.append(prompt)
        return StepResult(
            token_ids=tuple(tokens),
            logprobs=tuple(logprobs) if any(logprobs) else None,
            prompt_logprobs=tuple(prompt_logprobs) if any(prompt_logprobs) else None,
            kv_loads=loads,
            num_accepted=tuple(accepted) if any(accepted) else None,
            accepted_logprobs=tuple(accepted_logprobs) if any(accepted_logprobs) else None,
        )

    def _sampling_hash(self, request: StepRequest, h: int, position: int) -> int:
        """The hash the token after ``position`` is drawn from: that position's (``h``);
        a fake that attends folds in every position its groups read
        (``fake_attending.py``)."""
        return h

    def _verify(
        self, request: StepRequest, hashes: list[int]
    ) -> tuple[int, int, tuple[TokenLogprobs, ...]]:
        """Greedy verification of the request's proposals: the hash its own token is
        drawn from, the proposals accepted, and their logprobs if asked. Writes the states
        of the positions kept, and only those."""
        draft, vocab = request.draft_token_ids, self.vocab_size
        first = len(hashes) - len(draft) - 1  # the last real token's index
        position = request.start_position + first
        num_top = request.params.logprobs
        found: list[TokenLogprobs] = []
        num_accepted = 0
        while True:
            h = self._sampling_hash(request, hashes[first + num_accepted], position + num_accepted)
            if num_accepted == len(draft) or (h >> 17) % vocab != draft[num_accepted]:
                break
            if num_top is not None:
                found.append(fake_logprobs(h, draft[num_accepted], num_top, vocab))
            num_accepted += 1
        if self._states.groups:
            kept = hashes[: first + 1 + num_accepted]
            self._states.write(request.block_tables, request.start_position, kept)
        return h, num_accepted, tuple(found)

    def sample(self, batch: StepBatch) -> list[int | None]:
        """The tokens :meth:`execute` samples, as a list (None where none is due)."""
        return list(self.execute(batch).token_ids)

    def _run(self, request: StepRequest) -> tuple[list[int], tuple[TokenLogprobs, ...]]:
        """Write the request's hashes (a state only up to its last real token where it
        verifies proposals: see ``_verify``); its hashes, and its prompt logprobs if
        asked."""
        bs, vocab, store = self.block_size, self.vocab_size, self._store
        tables = request.block_tables
        position = request.start_position
        h = _SEED if position == 0 else self._read(tables, position - 1)
        targets = request.prompt_logprob_token_ids
        num_top = request.params.prompt_logprobs or 0
        prompt_logprobs = []
        hashes = []
        for i, token in enumerate(request.token_ids):
            h = ((h ^ token) * _PRIME) & _MASK
            block, slot = divmod(position, bs)
            for group in self._kv_groups:
                store[group][tables[group][block] * bs + slot] = h
            hashes.append(h)
            position += 1
            if i < len(targets):
                prompt_logprobs.append(fake_logprobs(h, targets[i], num_top, vocab))
        owner = self._owner
        for block in range(request.start_position // bs, (position - 1) // bs + 1):
            for group in self._kv_groups:
                owner[tables[group][block]] = group
        if self._states.groups and not request.num_draft_tokens:
            self._states.write(tables, request.start_position, hashes)
        return hashes, tuple(prompt_logprobs)

    def _read(self, tables: Sequence[Sequence[int]], position: int) -> int:
        """The hash at ``position``, from every group that still holds its page (a state
        group holds the state after it, checked to be exactly that one)."""
        block, slot = divmod(position, self.block_size)
        for group in self._kv_groups:
            page = tables[group][block]
            if page and self._owner[page] not in (group, -1):
                raise FakeKVMismatchError(
                    f"group {group} reads page {page}, which group {self._owner[page]} wrote since"
                )
        values = {
            self._store[group][tables[group][block] * self.block_size + slot]
            for group in self._kv_groups
            if tables[group][block]
        }
        if self._states.groups:
            state = self._states.read(tables, position + 1)
            if state is not None:
                values.add(state)
        if len(values) != 1:
            raise FakeKVMismatchError(
                f"position {position}: groups hold {len(values)} different values "
                f"(tables {[list(t[block : block + 1]) for t in tables]})"
            )
        return values.pop()


class CollectingSink:
    """An output sink that keeps every item, for driving the engine core without a loop."""

    def __init__(self) -> None:
        self.items: list[RequestOutput | HybridKVError] = []
        self.is_closed = False

    def send_nowait(self, item: RequestOutput | HybridKVError) -> None:
        """Keep the item; nothing may follow the last one."""
        assert not self.is_closed, "an item after the sink was closed"
        self.items.append(item)

    def close(self) -> None:
        """Mark the end of the request's outputs."""
        self.is_closed = True
