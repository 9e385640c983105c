"""What ``--kv-offload`` says, the offload settings, and the counters both sides keep.

::

    --kv-offload host:4GiB                  host memory, 4 GiB, LRU
    --kv-offload redis://HOST:PORT          a Redis server (several engines may share it)
    --kv-offload host:2GiB --kv-offload redis://HOST:PORT
                                            both: loads read the host first, saves go to both
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from hybridkv.memory.offload.errors import OffloadConfigError
from hybridkv.memory.offload.host import HostTier
from hybridkv.memory.offload.redis_tier import RedisTier
from hybridkv.memory.offload.tier import BufferFactory, Tier
from hybridkv.memory.sizes import SizeError, parse_size


@attrs.frozen
class TierSpec:
    """One ``--kv-offload`` value: ``kind`` is ``host`` (``capacity_bytes``) or ``redis``
    (``url``)."""

    kind: str
    capacity_bytes: int = 0
    url: str = ""

    def __str__(self) -> str:
        return f"host:{self.capacity_bytes}B" if self.kind == "host" else self.url


def parse_tier(text: str) -> TierSpec:
    """Read one ``--kv-offload`` value.

    Raises:
        OffloadConfigError: neither ``host:SIZE`` nor a ``redis://`` URL.
    """
    if text.startswith(("redis://", "rediss://", "unix://")):
        return TierSpec("redis", url=text)
    kind, _, size = text.partition(":")
    if kind == "host" and size:
        try:
            return TierSpec("host", capacity_bytes=parse_size(size))
        except SizeError as exc:
            raise OffloadConfigError(f"--kv-offload {text!r}: {exc}") from None
    raise OffloadConfigError(
        f"--kv-offload {text!r}: expected host:SIZE (host:4GiB) or redis://HOST:PORT"
    )


def build_tier(spec: TierSpec, *, allocate: BufferFactory | None = None) -> Tier:
    """The tier a spec names (``allocate``: the host tier's buffers)."""
    if spec.kind == "host":
        return HostTier(spec.capacity_bytes, allocate=allocate)
    return RedisTier(spec.url)


@attrs.define
class OffloadStats:
    """Counters of the connector (loop thread) and its transfers (executor threads).

    Attributes:
        hit_tokens: Per tier name, prompt tokens loaded from it instead of computed.
        num_loaded_blocks / num_loaded_bytes: (group, block) pages filled from a tier.
        num_failed_blocks: Loads that failed (missing, corrupt, tier unavailable).
        num_saved_blocks / num_saved_bytes: Pages stored in a tier.
        num_dropped_saves: Saves dropped because the queue was full or a tier failed.
    """

    hit_tokens: dict[str, int] = attrs.field(factory=dict)
    num_loaded_blocks: int = 0
    num_loaded_bytes: int = 0
    num_failed_blocks: int = 0
    num_saved_blocks: int = 0
    num_saved_bytes: int = 0
    num_dropped_saves: int = 0


def _tier_tuple(tiers: Iterable[Tier]) -> tuple[Tier, ...]:
    return tuple(tiers)


def _spec_tuple(specs: Iterable[TierSpec]) -> tuple[TierSpec, ...]:
    return tuple(specs)


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise OffloadConfigError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen(kw_only=True, eq=False)
class OffloadConfig:
    """The tiers and how blocks move to them.

    Attributes:
        tiers: Looked up in order (a load reads each block from the first that has it);
            every save goes to all of them.
        save_interval: Tokens between the boundaries a window group is saved for (a
            multiple of the block size; see ``connector.py``).
        max_pending_saves: Blocks waiting to be written; beyond it saves are dropped.
        stats: The counters (metrics read them).
        specs: What the tiers were built from (``from_specs``), so that the other ranks
            of a parallel engine can build their own; empty for tiers built by hand.
    """

    tiers: tuple[Tier, ...] = attrs.field(converter=_tier_tuple)
    save_interval: int = attrs.field(default=1024, validator=_positive)
    max_pending_saves: int = attrs.field(default=4096, validator=_positive)
    stats: OffloadStats = attrs.field(factory=OffloadStats)
    specs: tuple[TierSpec, ...] = attrs.field(default=(), converter=_spec_tuple)

    @classmethod
    def from_specs(
        cls,
        specs: Sequence[TierSpec],
        *,
        allocate: BufferFactory | None = None,
        save_interval: int = 1024,
    ) -> OffloadConfig:
        """Build the tiers of the ``--kv-offload`` values."""
        if not specs:
            raise OffloadConfigError("an offload config needs at least one tier")
        tiers = [build_tier(spec, allocate=allocate) for spec in specs]
        return cls(tiers=tiers, save_interval=save_interval, specs=tuple(specs))

    def close(self) -> None:
        """Close every tier."""
        for tier in self.tiers:
            tier.close()
