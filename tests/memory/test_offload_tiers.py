"""Offload tiers, stored blocks and ``--kv-offload`` values."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from hybridkv.memory.offload import (
    CorruptBlockError,
    HostTier,
    KVBlock,
    OffloadConfigError,
    RedisTier,
    TierUnavailableError,
    decode,
    encode,
    parse_tier,
)


def block(fill: int = 7) -> KVBlock:
    return KVBlock("float32", (2, 3), bytes([fill]) * 24)


def test_a_stored_block_round_trips_with_its_shape_and_dtype() -> None:
    """Encoding keeps dtype, shape and bytes; decoding checks them."""
    out = decode(encode(block()))
    assert (out.dtype, out.shape, bytes(out.data)) == ("float32", (2, 3), bytes([7]) * 24)


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[:-1],  # truncated
        lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),  # one bit flipped
        lambda raw: b"XXXX" + raw[4:],  # not a block
        lambda raw: raw[:6],  # header cut
    ],
)
def test_a_damaged_block_is_refused(damage: Any) -> None:
    """Truncation, a flipped bit, or a foreign value raise CorruptBlockError."""
    with pytest.raises(CorruptBlockError):
        decode(damage(encode(block())))


def test_host_tier_drops_the_least_recently_used_beyond_its_budget() -> None:
    """Over budget, the value read longest ago goes first."""
    tier = HostTier(100)
    tier.put([(b"a", b"x" * 40), (b"b", b"y" * 40)])
    tier.get([b"a"])  # a is now the most recently used
    tier.put([(b"c", b"z" * 40)])
    assert tier.contains([b"a", b"b", b"c"]) == [True, False, True]
    assert tier.num_bytes == 80 and tier.num_evicted == 1
    tier.put([(b"big", b"q" * 101)])  # larger than the whole budget: not kept
    assert tier.contains([b"big"]) == [False]


def test_sizes_and_tier_values_parse() -> None:
    """``host:4GiB`` and ``redis://`` URLs are read; anything else is refused by name."""
    assert parse_tier("host:1e9").capacity_bytes == 10**9  # the grammar of --kv-memory
    assert parse_tier("host:512MiB").capacity_bytes == 512 << 20
    assert parse_tier("redis://localhost:6379").url == "redis://localhost:6379"
    with pytest.raises(OffloadConfigError, match="expected host:SIZE"):
        parse_tier("disk:/tmp")
    with pytest.raises(OffloadConfigError, match="size 'lots' is not a non-negative number"):
        parse_tier("host:lots")


def test_redis_tier_stores_and_reads_blocks(redis_server: Any) -> None:
    """A real redis-server holds the values; missing keys read as None."""
    tier = RedisTier(redis_server.url)
    tier.put([(b"k1", encode(block(1))), (b"k2", encode(block(2)))])
    assert tier.contains([b"k1", b"k2", b"k3"]) == [True, True, False]
    values = tier.get([b"k2", b"k3"])
    assert values[1] is None and values[0] is not None
    assert bytes(decode(values[0]).data) == bytes([2]) * 24
    tier.delete([b"k1"])
    assert tier.contains([b"k1"]) == [False]
    tier.close()


class _Unreachable:
    """A Redis client stand-in that fails the test if any call reaches it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the tier called the dead server ({name}) inside retry_after_s")


def test_a_stopped_redis_fails_fast_with_one_warning(redis_server: Any) -> None:
    """Once the server is gone, calls raise TierUnavailableError at once, warned once."""
    tier = RedisTier(redis_server.url, timeout_s=0.5, retry_after_s=60)
    tier.put([(b"k", encode(block()))])
    redis_server.stop()
    with capture_logs() as logs:
        with pytest.raises(TierUnavailableError):
            tier.get([b"k"])
        # No call reaches the dead server again within retry_after_s.
        client, tier._client = tier._client, _Unreachable()
        for _ in range(5):
            with pytest.raises(TierUnavailableError):
                tier.contains([b"k"])
        tier._client = client
    assert [e["event"] for e in logs] == ["kv_tier_unavailable"]
    tier.close()
