"""The KV connector on a real (tiny Gemma 3) model: a flushed prefix loads from a tier,
greedy outputs equal a run without the connector, a stopped Redis degrades to recompute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from cut_proxy import CUTS, CutProxy
from structlog.testing import capture_logs

from hybridkv.memory.offload import HostTier, OffloadConfig, RedisTier
from hybridkv.serving.metrics.prometheus import OffloadCollector


def _prompts(prompt_of: Callable[[int, int], list[int]]) -> list[list[int]]:
    """Seed 002's steps: a long prompt, other prompts that flush it from the pool, the
    long prompt again with another question."""
    document = prompt_of(72, 5)
    return [[*document, 7, 8], *(prompt_of(60, 100 + k) for k in range(3)), [*document, 9, 10, 11]]


@pytest.mark.asyncio
async def test_a_flushed_prefix_loads_from_host_memory_with_the_same_tokens(
    tiny_models: Any, prompt_of: Any, serve_in_turn: Any
) -> None:
    """The repeat loads its prefix from the host tier; every output equals the run
    without a connector."""
    model = tiny_models["gemma3"]
    baseline, _ = await serve_in_turn(model.path, _prompts(prompt_of), None)
    offload = OffloadConfig(tiers=[HostTier(64 << 20)], save_interval=16)
    with capture_logs() as logs:
        outputs, _ = await serve_in_turn(model.path, _prompts(prompt_of), offload)
    assert outputs == baseline
    assert offload.stats.hit_tokens["host"] >= 64
    finished = [e for e in logs if e["event"] == "kv_load_finished"]
    assert finished and finished[0]["num_tokens"] >= 64


@pytest.mark.asyncio
async def test_redis_holds_the_prefix_and_its_loss_degrades_to_recompute(
    tiny_models: Any, prompt_of: Any, redis_server: Any, serve_in_turn: Any
) -> None:
    """From Redis the repeat loads its prefix; with Redis stopped mid-run the engine
    warns, recomputes, and still returns the same tokens."""
    model = tiny_models["gemma3"]
    baseline, _ = await serve_in_turn(model.path, _prompts(prompt_of), None)
    offload = OffloadConfig(tiers=[RedisTier(redis_server.url)], save_interval=16)
    outputs, _ = await serve_in_turn(model.path, _prompts(prompt_of), offload)
    assert outputs == baseline
    assert offload.stats.hit_tokens["redis"] >= 64

    tier = RedisTier(redis_server.url, timeout_s=0.5)
    gone = OffloadConfig(tiers=[tier], save_interval=16)
    real_put = tier.put

    def put_then_stop(items: Any) -> None:
        real_put(items)
        redis_server.stop()  # the server goes away after the first save

    tier.put = put_then_stop  # type: ignore[method-assign]
    with capture_logs() as logs:
        outputs, _ = await serve_in_turn(model.path, _prompts(prompt_of), gone)
    assert outputs == baseline
    assert "kv_tier_unavailable" in [e["event"] for e in logs]


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["bamba", "granite_moe", "deepseek_v4"])
@pytest.mark.parametrize("tier", ["host", "redis"])
async def test_a_hybrids_state_loads_from_a_tier_with_the_same_tokens(
    tiny_models: Any, prompt_of: Any, redis_server: Any, name: str, tier: str, serve_in_turn: Any
) -> None:
    """A Mamba2 hybrid (a state page spanning several K/V pages at 4-token blocks), and
    DeepSeek V4 (its windows, its compressed entries, an HCA entry's in one block of
    eight, and their compressor's states): the repeat loads its attention blocks and its
    states' checkpoint from host memory or Redis, and every output equals the run without
    a connector."""
    model = tiny_models[name]
    baseline, _ = await serve_in_turn(model.path, _prompts(prompt_of), None)
    store = HostTier(64 << 20) if tier == "host" else RedisTier(redis_server.url)
    offload = OffloadConfig(tiers=[store], save_interval=16)
    outputs, _ = await serve_in_turn(model.path, _prompts(prompt_of), offload)
    assert outputs == baseline
    assert offload.stats.hit_tokens[tier] >= 64


@pytest.mark.asyncio
@pytest.mark.parametrize("cut", CUTS)
async def test_a_load_cut_mid_reply_reports_every_block_it_did_not_deliver(
    tiny_models: Any, prompt_of: Any, redis_server: Any, cut: str, serve_in_turn: Any
) -> None:
    """Redis's connection cut inside the reply of a load (before it, inside a block,
    between blocks): every block of that load is reported failed, to the scheduler (a
    ``kv_load_failed`` event), the counters and the metric; the tokens are recomputed
    and equal a run without offload."""
    model = tiny_models["gemma3"]
    baseline, _ = await serve_in_turn(model.path, _prompts(prompt_of), None)
    # The first run fills Redis; the second reads it through a proxy that cuts once.
    await serve_in_turn(
        model.path, _prompts(prompt_of), OffloadConfig(tiers=[RedisTier(redis_server.url)])
    )
    proxy = CutProxy(redis_server.port, cut)
    try:
        offload = OffloadConfig(tiers=[RedisTier(proxy.url, timeout_s=5.0)], save_interval=16)
        with capture_logs() as logs:
            outputs, _ = await serve_in_turn(model.path, _prompts(prompt_of), offload)
    finally:
        proxy.close()
    assert outputs == baseline
    assert proxy.num_keys is not None, "no load was read through the proxy"
    failed = [e for e in logs if e["event"] == "kv_load_failed"]
    assert failed[0]["num_failed_blocks"] == proxy.num_keys
    assert failed[0]["num_loaded_blocks"] == 0
    assert offload.stats.num_failed_blocks >= proxy.num_keys
    assert offload.stats.num_loaded_blocks == 0
    metric = {m.name: m for m in OffloadCollector(offload.stats).collect()}
    assert metric["hybridkv_kv_offload_failed_loads"].samples[0].value >= proxy.num_keys
    assert "kv_tier_unavailable" in [e["event"] for e in logs]
