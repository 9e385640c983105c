"""Stand-ins for tests and the scheduling benchmark: a deterministic model, a list sink.

The next token is a pure function of the sequence so far, like a greedy model, and it is
computed the way a model would: through the paged KV cache. Each position's "K/V" is a
rolling hash of the tokens up to it, written into the page and slot the block tables
give; a step reads the hash of the position before its first token back from the pages::

    h(-1) = SEED      h(p) = mix(h(p-1), token[p])      next token = h(last) mod vocab

So a block table that points at a wrong, stale or reused page changes the output (or
raises :class:`FakeKVMismatchError`), which is what makes "same output with and without
preemption, chunking, prefix caching" a real test of the scheduler and the allocator.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

from hybridkv.errors import HybridKVError
from hybridkv.memory.layout import PoolSpec
from hybridkv.scheduler.batch import StepBatch, StepResult
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.outputs import RequestOutput

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


class FakeExecutor:
    """Runs steps on rolling hashes stored in pages: no model, exact cache semantics.

    Args:
        pool: The block pool (each KV group keeps its own blocks; all are written and
            checked).
        vocab_size: Tokens are drawn from ``[0, vocab_size)``.
        step_delay_s: Seconds each step sleeps, to stand for model time.
    """

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
        self.num_steps = 0

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

    def execute(self, batch: StepBatch) -> StepResult:
        """Write each token's hash into its block, then sample from the last hash."""
        return StepResult.from_token_ids(self.sample(batch))

    def sample(self, batch: StepBatch) -> list[int | None]:
        """The tokens :meth:`execute` samples, as a list (None where none is due)."""
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_steps += 1
        bs, vocab, store = self.block_size, self.vocab_size, self._store
        out: list[int | None] = []
        for request in batch.requests:
            tables = request.block_tables
            position = request.start_position
            h = _SEED if position == 0 else self._read(tables, position - 1)
            for token in request.token_ids:
                h = ((h ^ token) * _PRIME) & _MASK
                block, slot = divmod(position, bs)
                for group, table in enumerate(tables):
                    store[group][table[block] * bs + slot] = h
                position += 1
            out.append((h >> 17) % vocab if request.sample else None)
        return out

    def _read(self, tables: Sequence[Sequence[int]], position: int) -> int:
        """The hash at ``position``, from every group that still holds its page."""
        block, slot = divmod(position, self.block_size)
        values = {
            self._store[group][table[block] * self.block_size + slot]
            for group, table in enumerate(tables)
            if table[block]
        }
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
