"""A fake executor that attends: each sampled token depends on every position it reads.

:class:`~hybridkv.scheduler.fake.FakeExecutor` chains a hash through the tokens, so the
last position alone decides the next token: a policy that forgets every earlier position
gives the same output as full attention. :class:`AttendingFakeExecutor` draws the next
token from the hashes of every position the layers *attend* (``attends``: per group, the
policy of what its layers read; the pool's own policies by default), each read back from
the page and slot the block tables give::

    sample after position p = mix over groups g, over q in attends[g].live_spans(p) + {p},
                              of the hash stored for q in g's pages

So a policy, or an override of one of its derived methods, that releases a page its
layers still read fails the step (:class:`FakeKVMismatchError`: the table holds the null
page there), and a page reused by another request changes the output;
:func:`attending_reference_tokens` gives the tokens without any cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.memory.layout import PoolSpec
from hybridkv.policies.base import MemoryPolicy
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.fake import _MASK, _PRIME, _SEED, FakeExecutor, FakeKVMismatchError

__all__ = ["AttendingFakeExecutor", "attending_reference_tokens"]


def _mix(h: int, value: int) -> int:
    return ((h ^ value) * _PRIME) & _MASK


def _read_positions(policy: MemoryPolicy, position: int) -> list[int]:
    """The positions a query at ``position`` reads: the live spans and itself."""
    out = [q for start, stop in policy.live_spans(position) for q in range(start, stop)]
    out.append(position)
    return out


def attending_reference_tokens(
    prompt: Sequence[int],
    num_tokens: int,
    vocab_size: int,
    attends: Sequence[MemoryPolicy],
) -> list[int]:
    """The tokens :class:`AttendingFakeExecutor` generates after ``prompt`` (its K/V
    groups reading ``attends``), computed without any cache."""
    hashes: list[int] = []
    h = _SEED
    for token in prompt:
        h = _mix(h, token)
        hashes.append(h)
    out: list[int] = []
    for _ in range(num_tokens):
        p = len(hashes) - 1
        acc = hashes[p]
        for policy in attends:
            for q in _read_positions(policy, p):
                acc = _mix(acc, hashes[q])
        token = (acc >> 17) % vocab_size
        out.append(token)
        h = _mix(h, token)
        hashes.append(h)
    return out


class AttendingFakeExecutor(FakeExecutor):
    """The fake, drawing each token from every position its K/V groups read.

    Args:
        pool: The pool it serves.
        attends: Per K/V group of the pool (state groups are skipped), the policy of the
            positions its layers read; None: each group's own policy (catches a policy
            whose derived methods release what its ``live_spans`` keeps).
        vocab_size: Tokens are drawn from ``[0, vocab_size)``.
    """

    def __init__(
        self,
        pool: PoolSpec,
        *,
        attends: Sequence[MemoryPolicy] | None = None,
        vocab_size: int = 32000,
        step_delay_s: float = 0.0,
    ) -> None:
        super().__init__(pool, vocab_size=vocab_size, step_delay_s=step_delay_s)
        kv = [g for g, p in enumerate(pool.policies) if not p.keeps_state]
        reads = list(attends) if attends is not None else [pool.policies[g] for g in kv]
        if len(reads) != len(kv):
            raise ValueError(
                f"attends names {len(reads)} policies, the pool has {len(kv)} K/V groups"
            )
        self.attends = tuple(zip(kv, reads, strict=True))

    def reference_tokens(self, prompt: Sequence[int], num_tokens: int) -> list[int]:
        """The tokens this fake generates after ``prompt``, without any cache."""
        policies = [policy for _, policy in self.attends]
        return attending_reference_tokens(prompt, num_tokens, self.vocab_size, policies)

    def _sampling_hash(self, request: StepRequest, h: int, position: int) -> int:
        bs, tables = self.block_size, request.block_tables
        p = position
        acc = h
        for group, policy in self.attends:
            table, store = tables[group], self._store[group]
            for q in _read_positions(policy, p):
                block = q // bs
                page = table[block] if block < len(table) else 0
                if not page:
                    raise FakeKVMismatchError(
                        f"group {group} reads position {q} at {p}, but its table holds no "
                        f"page for block {block}: a policy released what its layers read"
                    )
                acc = _mix(acc, store[page * bs + q % bs])
        return acc
