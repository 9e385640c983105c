"""Soak: many streaming clients, some leaving at random, over a pool small enough to
preempt; afterwards no page is held, no request is stuck, and /health is 200."""

from __future__ import annotations

import random
from typing import Any

import anyio
import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "fake-model"
NUM_CLIENTS = 150


async def one_client(http: httpx.AsyncClient, seed: int, outcomes: dict[str, int]) -> None:
    """A client doing one of: read a stream to its end, leave a stream early, time out
    on a whole response, or ask for two choices."""
    rng = random.Random(seed)
    prompt = " ".join(f"w{rng.randrange(2, 64)}" for _ in range(rng.randrange(1, 60)))
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": rng.randrange(1, 120),
        "ignore_eos": rng.random() < 0.5,
    }
    kind = rng.choice(["full", "leave", "timeout", "choices"])
    try:
        if kind == "timeout":
            await http.post("/v1/completions", json=body, timeout=rng.uniform(0.01, 0.3))
        elif kind == "choices":
            await http.post("/v1/completions", json={**body, "n": 2}, timeout=60)
        else:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if kind == "leave" and lines >= rng.randrange(1, 10):
                        break
    except httpx.TimeoutException:
        pass
    outcomes[kind] = outcomes.get(kind, 0) + 1


def test_many_streaming_clients_with_random_disconnects(make_server: Any) -> None:
    """After 150 clients (a quarter leaving mid-stream, a quarter timing out), no page is
    held, nothing runs or waits, the pool is intact and /health is 200."""
    server = make_server(num_blocks=96, max_num_seqs=16, step_delay_s=0.002)
    outcomes: dict[str, int] = {}

    async def run() -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as http:
            with anyio.fail_after(300):
                async with anyio.create_task_group() as tg:
                    for seed in range(NUM_CLIENTS):
                        tg.start_soon(one_client, http, seed, outcomes)

    anyio.run(run)
    stats = server.wait_until_free(timeout=30)
    assert (stats.num_running, stats.num_waiting, sum(stats.blocks_used_per_group)) == (0, 0, 0)
    assert stats.num_preemptions > 0  # the pool was tight enough to preempt
    server.portal.call(server.engine.core.kv.check_integrity)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert sum(outcomes.values()) == NUM_CLIENTS
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'status="500"' not in metrics
