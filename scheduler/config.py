"""The engine's configuration: pool shape, batch limits, queue bound, stopping tokens,
and the scheduling rules (which requests go first, how many slots one request's copies
may hold)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.memory.layout import PoolSpec
from hybridkv.policies.base import MemoryPolicy
from hybridkv.scheduler.params import InvalidRequestError
from hybridkv.scheduler.speculation import SpeculativeConfig

if TYPE_CHECKING:
    from hybridkv.scheduler.batch import Executor


class ConfigError(HybridKVError, ValueError):
    """An engine configuration value is out of range."""


#: How waiting requests are ordered (vLLM's ``--scheduling-policy``): ``fcfs`` by arrival
#: alone, ``priority`` by each request's priority (lower first), then arrival.
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")
#: The priorities a request may have under ``priority`` scheduling: a signed 64-bit
#: integer (vLLM takes any int; a bound keeps every queue key a machine word).
PRIORITY_MIN = -(2**63)
PRIORITY_MAX = 2**63 - 1


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


def _scheduling_policy(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in SCHEDULING_POLICIES:
        raise ConfigError(f"{attribute.name} must be one of {SCHEDULING_POLICIES}, got {value!r}")


def _share(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ConfigError(f"{attribute.name} must be a number in (0, 1], got {value!r}")


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
        scheduling_policy: ``fcfs`` (the default, as vLLM's): requests are served in
            arrival order and a request priority other than 0 is refused; ``priority``:
            lower priorities first (any integer in ``[PRIORITY_MIN, PRIORITY_MAX]``),
            ties in arrival order. Priorities are the caller's to trust: enable them only
            where whoever sets them may jump the queue.
        max_running_share: The largest share of ``max_num_seqs`` the copies of one
            request (the ``n``/``best_of`` choices of an API request: the requests whose
            ``SamplingParams.parent_id`` is the same) may hold at once; the other copies
            wait, and requests behind them are admitted meanwhile. See
            :attr:`max_copies_running`.
        state_span: Page ids one page of a state group takes (the executor's pool says
            it: :meth:`for_executor`); 1: every page is one id.
        speculative_config: Speculative decoding (vLLM's ``--speculative-config``): decode
            steps verify proposed tokens (``scheduler/speculator.py``); None: off.
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
    scheduling_policy: SchedulingPolicy = attrs.field(default="fcfs", validator=_scheduling_policy)
    max_running_share: float = attrs.field(default=0.5, validator=_share)
    state_span: int = attrs.field(default=1, validator=_at_least(1))
    speculative_config: SpeculativeConfig | None = None

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
            state_span=pool.state_span,
            **fields,
        )

    @property
    def pool(self) -> PoolSpec:
        """The block pool this config describes."""
        return PoolSpec(self.policies, self.num_blocks, self.block_size, self.state_span)

    @property
    def prefill_chunk(self) -> int:
        """Most tokens one request runs in one step."""
        return self.max_prefill_chunk or self.max_num_batched_tokens

    @property
    def max_copies_running(self) -> int:
        """Most running requests of one parent: ``max_running_share`` of ``max_num_seqs``,
        rounded down, at least 1.

        A share rather than a count, so that it keeps its meaning when ``max_num_seqs``
        changes. At the default 0.5, one request with many choices (``n=128`` against 32
        slots) holds at most 16: a request arriving behind it is admitted at once instead
        of after its 128 copies, and its own copies run in turns as its first ones
        finish. The cost: alone on an idle engine, such a request uses only that share
        of the slots. Two such requests may still fill every slot between them; what the
        cap guarantees is that no single request does. 1.0 turns the cap off.
        """
        return max(1, math.floor(self.max_running_share * self.max_num_seqs))

    def check_executor(self, executor: Executor, proposer: object = None) -> None:
        """Refuse, at an engine's start, an executor this config cannot run on.

        Raises:
            ConfigError: the executor's pool is another (named with both values); or the
                config speculates and the executor does not verify proposed tokens, or
                it names a draft model and no ``proposer`` runs it.
        """
        pool = executor.pool
        for field in ("block_size", "num_blocks", "policies"):
            ours, theirs = getattr(self, field), getattr(pool, field)
            if ours != theirs:
                raise ConfigError(
                    f"EngineConfig.{field}={ours!r} but the executor's pool has "
                    f"{field}={theirs!r}; build the config with "
                    "EngineConfig.for_executor(executor)"
                )
        spec = self.speculative_config
        if spec is not None and not getattr(executor, "verifies_proposals", False):
            raise ConfigError(
                f"speculative_config: {type(executor).__name__} does not verify proposed "
                "tokens (it has no verifies_proposals = True); run without speculative decoding"
            )
        if spec is not None and spec.method == "mtp":
            proposes = getattr(executor, "mtp_proposals", 0)
            if proposes < spec.num_speculative_tokens:
                raise ConfigError(
                    f"speculative_config: method mtp proposes {spec.num_speculative_tokens} "
                    f"tokens, the executor's MTP layer {proposes}; load the model with "
                    f"LoadOptions(mtp_proposals={spec.num_speculative_tokens})"
                )
        if spec is not None and spec.method == "draft_model" and proposer is None:
            raise ConfigError(
                "speculative_config: method draft_model needs a proposer that runs the draft "
                f"model {spec.model!r}; none was given"
            )

    def check_priority(self, priority: int) -> None:
        """Refuse a request priority the scheduling policy does not take.

        Raises:
            InvalidRequestError: not an integer; not 0 under ``fcfs``; outside
                ``[PRIORITY_MIN, PRIORITY_MAX]`` under ``priority``.
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if self.scheduling_policy == "fcfs":
            if priority != 0:
                raise InvalidRequestError(
                    f"priority must be 0 under first-come-first-served scheduling "
                    f"(scheduling_policy='fcfs'), got {_shown(priority)}"
                )
        elif not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidRequestError(
                f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}] (a signed 64-bit "
                f"integer), got {_shown(priority)}"
            )


def _shown(value: int) -> str:
    # A client's integer may have 100 digits: keep messages short.
    text = str(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"
