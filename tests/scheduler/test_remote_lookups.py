"""A remote tier (a real Redis) is asked off the event loop: while its answer is held, the
engine keeps serving, and the request that waits for it then loads its prefix."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from hybridkv.memory.offload import OffloadConfig, RedisTier
from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import Engine, EngineConfig, FakeExecutor, SamplingParams

BS = 4
PROMPT = list(range(3, 3 + 9 * BS))  # nine blocks


class HeldRedis(RedisTier):
    """Redis, whose ``contains`` waits for the test while ``hold`` is set, and notes the
    threads it was called on."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.hold = threading.Event()
        self.release = threading.Event()
        self.asked = threading.Event()
        self.threads: set[int] = set()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self.threads.add(threading.get_ident())
        if self.hold.is_set():
            self.asked.set()
            assert self.release.wait(timeout=60), "the test never released the lookup"
        return super().contains(keys)


def config() -> EngineConfig:
    return EngineConfig(
        policies=[FullAttention(), SlidingWindow(window=8)],
        num_blocks=64,
        block_size=BS,
        max_model_len=128,
        vocab_size=64,
    )


@pytest.mark.asyncio
async def test_a_held_redis_lookup_leaves_the_loop_serving(redis_server: Any) -> None:
    """One engine saves a prefix to Redis; a second engine's request for it waits while
    Redis's answer is held, a short request (no block to look up) runs to its end
    meanwhile, and once released the waiting request loads the prefix from Redis."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first_tier = HeldRedis(redis_server.url)
    first = OffloadConfig(tiers=[first_tier], save_interval=BS)
    cfg = config()
    saver, loader = FakeExecutor.for_config(cfg), FakeExecutor.for_config(cfg)
    with anyio.fail_after(60):
        async with Engine(cfg, saver, offload=first) as engine:
            [_ async for _ in engine.generate(PROMPT, params)]
    saver.close()  # its saves are written
    tier = HeldRedis(redis_server.url)
    offload = OffloadConfig(tiers=[tier], save_interval=BS)
    loop_thread = threading.get_ident()
    with anyio.fail_after(60):
        async with Engine(cfg, loader, offload=offload) as engine:
            tier.hold.set()
            waiting = engine.generate(PROMPT, params)
            await anyio.to_thread.run_sync(tier.asked.wait)
            short = [out async for out in engine.generate([5, 6, 7], params)]
            assert short[-1].finish_reason is not None  # served while Redis was held
            assert engine.stats().num_waiting == 1
            tier.release.set()
            outputs = [out async for out in waiting]
    assert outputs[-1].num_cached_tokens == 8 * BS  # the prefix came from Redis
    assert offload.stats.hit_tokens["redis"] == 8 * BS
    assert loop_thread not in tier.threads and loop_thread not in first_tier.threads
    loader.close()
    offload.close()
    first.close()
