"""The hybrid-aware router in Ray Serve: two replicas of a tiny model on a local Ray
cluster, requests sharing a prefix sent where its blocks are (skipped without Ray)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from hybridkv.executor.load_options import LoadOptions  # noqa: E402
from hybridkv.executor.model_executor import ModelExecutor  # noqa: E402
from hybridkv.parallel.kv_events_config import KVEventsConfig  # noqa: E402
from hybridkv.scheduler import Engine, EngineConfig, SamplingParams  # noqa: E402
from hybridkv.serving.router.ranking import RouterWeights  # noqa: E402
from hybridkv.serving.router.ray.engine import Completion, EngineReplica  # noqa: E402
from hybridkv.serving.router.ray.router import HybridKVRouter  # noqa: E402

pytestmark = pytest.mark.slow

BS = 16
PREFIX_LEN = 16 * BS
# Two prefixes of sixteen blocks; each is served first, then shared by a later prompt.
PREFIXES = [[(step * i) % 250 + 1 for i in range(PREFIX_LEN)] for step in (7, 11)]
FIRST = [[*prefix, 100, 101, 102, 103] for prefix in PREFIXES]
LATER = [[*prefix, 200, 201, 202, 203, 204] for prefix in PREFIXES]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
LOAD = LoadOptions(kv_cache_bytes=1 << 21, block_size=BS, num_threads=1)
MAX_MODEL_LEN = 512
# Loopback only: the test's events stay on this machine.
EVENTS = KVEventsConfig(
    enable_kv_cache_events=True,
    endpoint="tcp://127.0.0.1:*",
    replay_endpoint="tcp://127.0.0.1:*",
)
WAIT_S = 120.0  # bounds each wait on a busy machine; none is a delay

# Ray ships the deployment class to its replicas by value (this module is not importable
# there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class TinyReplica(EngineReplica):
    """The tiny Llama in an engine, as a Serve replica."""

    async def __init__(self, folder: str) -> None:
        executor = ModelExecutor.from_pretrained(folder, LOAD)
        config = EngineConfig.for_executor(executor, max_model_len=MAX_MODEL_LEN)
        await self.start(config, executor, EVENTS)


async def _greedy(folder: Path, prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Each prompt through one plain engine, one after another."""
    executor = ModelExecutor.from_pretrained(folder, LOAD)
    config = EngineConfig.for_executor(executor, max_model_len=MAX_MODEL_LEN)
    outputs = []
    with anyio.fail_after(WAIT_S):
        async with Engine(config, executor) as engine:
            for prompt in prompts:
                async with engine.generate(prompt, GREEDY) as stream:
                    tokens = [output.token_ids async for output in stream]
                outputs.append(tokens[-1])
    return outputs


def router_of(handle: Any) -> HybridKVRouter | None:
    """The handle's request router, once Serve has made it (Ray keeps it private: the
    handle's router wrapper runs an asyncio router, which holds the request router)."""
    router: HybridKVRouter | None = handle._router._asyncio_router._request_router
    return router


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Return once ``predicate()`` holds, asking every 20 ms: a router's feeds and Serve's
    long poll have no event a test could wait on. Fails after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A local Ray cluster on two CPUs with Serve, no HTTP proxy; shut down after."""
    # Ray before 2.51 warns (FutureWarning) that it will stop overriding the visible
    # devices of tasks without GPUs, unless told to stop now.
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        yield
        serve.shutdown()
    finally:
        ray.shutdown()


def test_a_shared_prefix_goes_to_the_replica_holding_it(
    hybridkv_tiny_model: Path, ray_cluster: None
) -> None:
    """Two prompts served at once land on the two replicas (each takes one request at a
    time); a router started afterwards learns from the replicas' events alone which holds
    which prefix, and sends each later prompt where its prefix is. Every output equals a
    plain engine's greedy output."""
    expected = anyio.run(_greedy, hybridkv_tiny_model, [*FIRST, *LATER])
    deployment = serve.deployment(
        TinyReplica,
        num_replicas=2,
        max_ongoing_requests=1,
        ray_actor_options={"num_cpus": 0},
        request_router_config=HybridKVRouter.config(
            weights=RouterWeights(tokens_per_request=32), stats_period_s=0.5
        ),
    )
    first = serve.run(deployment.bind(str(hybridkv_tiny_model)), name="tiny", route_prefix=None)
    routers: list[HybridKVRouter] = []
    try:
        calls = [first.generate.remote(prompt_token_ids=p, params=GREEDY) for p in FIRST]
        served: list[Completion] = [call.result(timeout_s=WAIT_S) for call in calls]
        holders = [done.replica_id for done in served]
        assert len(set(holders)) == 2, "one replica served both (the other was idle then)"
        routers.append(_made(first))
        # A second handle has a router of its own, which sent nothing yet: only the
        # events can tell it where each prefix is.
        second = serve.get_deployment_handle("TinyReplica", app_name="tiny").options()
        router = _made(second)
        routers.append(router)

        def learned() -> bool:
            return all(
                router.table.resumable(prompt).get(holder, 0) >= PREFIX_LEN
                for prompt, holder in zip(LATER, holders, strict=True)
            )

        wait_for(learned, "the second router's indexes show where each prefix is")
        later: list[Completion] = [
            second.generate.remote(prompt_token_ids=p, params=GREEDY).result(timeout_s=WAIT_S)
            for p in LATER
        ]
        wait_for(
            lambda: not any(load.num_running for load in router.table.loads().values()),
            "the router counts no request in flight once every result is done",
        )
    finally:
        for made in routers:
            made.close()
    assert [done.replica_id for done in later] == holders
    assert all(done.num_cached_tokens >= PREFIX_LEN for done in later)
    assert [done.token_ids for done in (*served, *later)] == expected


def _made(handle: Any) -> HybridKVRouter:
    """The handle's router, waited for (Serve makes it once the deployment's config
    reaches the handle)."""
    wait_for(lambda: router_of(handle) is not None, "the handle's router exists")
    router = router_of(handle)
    assert isinstance(router, HybridKVRouter)
    return router
