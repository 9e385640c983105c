"""The engine's configuration: pool shape, batch limits, queue bound, stopping tokens."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.memory.layout import PoolSpec
from hybridkv.policies.base import MemoryPolicy

if TYPE_CHECKING:
    from hybridkv.scheduler.batch import Executor


class ConfigError(HybridKVError, ValueError):
    """An engine configuration value is out of range."""


def _at_least(low: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{attribute.name} must be an integer >= {low}, got {value!r}")

    return check


def _optional_at_least_one(
    instance: object, attribute: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None:
        _at_least(1)(instance, attribute, value)


def _policies(value: Iterable[MemoryPolicy]) -> tuple[MemoryPolicy, ...]:
    policies = tuple(value)
    if not policies or not all(isinstance(p, MemoryPolicy) for p in policies):
        raise ConfigError(f"policies must be a non-empty sequence of MemoryPolicy, got {value!r}")
    return policies


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything the engine needs besides its executor.

    Attributes:
        policies: The memory policy of each KV group, in group order.
        num_blocks: Pages in the pool, the null page 0 included.
        block_size: Tokens per page.
        max_model_len: Most tokens of a sequence, prompt and output together.
        max_num_seqs: Most requests running (holding pages) at once.
        max_num_batched_tokens: Token budget of one step, over all its requests.
        max_prefill_chunk: Most prompt tokens one request runs in one step, so that several
            long prompts share a step and decodes are not starved; None: only the budget
            limits it. Prompts longer than what a step can take are always chunked.
        min_prefill_chunk: Fewest prompt tokens a prefill chunk is shortened to so that
            kept prefixes keep their pages, in a pool with sliding-window groups (see
            ``KVCacheManager.spare_chunk``); a shorter prompt's chunk is never cut.
        max_waiting: Most requests waiting for admission; beyond it ``generate`` refuses.
        enable_prefix_caching: Reuse the pages of cached prompt prefixes.
        eos_token_ids: Tokens that end a request unless its params say ``ignore_eos``.
        vocab_size: If set, prompts with token ids outside ``[0, vocab_size)`` are refused.
    """

    policies: tuple[MemoryPolicy, ...] = attrs.field(converter=_policies)
    num_blocks: int = attrs.field(validator=_at_least(2))
    block_size: int = attrs.field(validator=_at_least(1))
    max_model_len: int = attrs.field(validator=_at_least(2))
    max_num_seqs: int = attrs.field(default=256, validator=_at_least(1))
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_at_least(1))
    max_prefill_chunk: int | None = attrs.field(default=None, validator=_optional_at_least_one)
    min_prefill_chunk: int = attrs.field(default=256, validator=_at_least(1))
    max_waiting: int = attrs.field(default=4096, validator=_at_least(1))
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)
    vocab_size: int | None = attrs.field(default=None, validator=_optional_at_least_one)

    @classmethod
    def for_executor(cls, executor: Executor, **options: Any) -> EngineConfig:
        """Build a config for an executor: its pool, and its model limits as defaults.

        The pool (policies, blocks, block size) is the executor's; ``max_model_len``,
        ``eos_token_ids`` and ``vocab_size`` default to the executor's attributes of those
        names where it has them (``ModelExecutor`` does).

        Args:
            executor: The executor the engine will run.
            **options: Any other field of :class:`EngineConfig` (not the pool's).
        """
        pool = executor.pool
        fields = {
            name: getattr(executor, name)
            for name in ("max_model_len", "eos_token_ids", "vocab_size")
            if getattr(executor, name, None) is not None
        }
        fields.update(options)
        return cls(
            policies=pool.policies,
            num_blocks=pool.num_blocks,
            block_size=pool.block_size,
            **fields,
        )

    @property
    def pool(self) -> PoolSpec:
        """The block pool this config describes."""
        return PoolSpec(self.policies, self.num_blocks, self.block_size)

    @property
    def prefill_chunk(self) -> int:
        """Most tokens one request runs in one step."""
        return self.max_prefill_chunk or self.max_num_batched_tokens
