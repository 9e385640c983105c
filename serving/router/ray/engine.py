"""A hybridkv engine as a Ray Serve replica that the hybrid-aware router follows.

Subclass :class:`EngineReplica` in a deployment: build the executor and engine config in
an ``async __init__`` and hand them to :meth:`EngineReplica.start`::

    @serve.deployment(num_replicas=2, request_router_config=HybridKVRouter.config())
    class Model(EngineReplica):
        async def __init__(self, folder: str) -> None:
            executor = ModelExecutor.from_pretrained(folder, LoadOptions(block_size=16))
            await self.start(EngineConfig.for_executor(executor), executor)

The replica publishes its KV events (``parallel/kv_events.py``) and reports through Ray
Serve's ``record_routing_stats`` where they go, how its blocks hash and its queue (a
:class:`~hybridkv.serving.router.ray.replicas.ReplicaReport`). A caller passes the prompt as
the keyword ``prompt_token_ids``, the argument the router reads::

    done = await handle.generate.remote(prompt_token_ids=ids, params=params)

Every method runs on the replica's event loop (Serve runs ``async`` methods there), the
thread the engine must be called from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import attrs

from hybridkv.errors import HybridKVError
from hybridkv.errors.events import get_logger
from hybridkv.memory.headroom import token_headroom
from hybridkv.parallel.kv_events import KVEventPublisher
from hybridkv.parallel.kv_events_config import KVEventsConfig
from hybridkv.scheduler import Engine, EngineConfig, Executor, SamplingParams
from hybridkv.scheduler.errors import EngineStoppedError
from hybridkv.serving.router.ray.replicas import ReplicaReport
from hybridkv.serving.router.replicas import reachable

log = get_logger(__name__)

#: Events on free ports of every interface, with replay: what a replica publishes unless
#: told otherwise (its report names the ports, at the node's address).
DEFAULT_KV_EVENTS = KVEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:*", replay_endpoint="tcp://*:*"
)


class ReplicaStartError(HybridKVError):
    """A replica's engine was started twice."""


@attrs.frozen(kw_only=True)
class Completion:
    """A request served to its end by one replica.

    Attributes:
        replica_id: The replica that served it (Serve's ``replica_id.unique_id``).
        token_ids: The tokens generated.
        finish_reason: Why it ended (``stop``, ``length``, ...).
        num_cached_tokens: Prompt tokens its engine found in the prefix cache.
    """

    replica_id: str
    token_ids: tuple[int, ...]
    finish_reason: str
    num_cached_tokens: int


class EngineReplica:
    """One engine per Ray Serve replica, its KV events published and reported.

    Call :meth:`start` from the subclass's ``async __init__``. Serve calls
    :meth:`record_routing_stats`, :meth:`check_health` and ``__del__`` itself.
    """

    _engine: Engine | None = None
    _publisher: KVEventPublisher | None = None
    _replica_id = ""
    _endpoint: str | None = None
    _replay_endpoint: str | None = None

    async def start(
        self,
        config: EngineConfig,
        executor: Executor,
        kv_events: KVEventsConfig | None = DEFAULT_KV_EVENTS,
    ) -> None:
        """Start the engine on this replica's event loop, publishing its KV events
        (None: none; the router then ranks this replica by its load alone)."""
        from ray import serve, util

        if self._engine is not None:
            raise ReplicaStartError(f"replica {self._replica_id} started its engine already")
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        publisher = None
        if kv_events is not None:
            publisher = KVEventPublisher(kv_events)
            host = util.get_node_ip_address()
            self._endpoint = reachable(publisher.endpoint, host)
            if publisher.replay_endpoint is not None:
                self._replay_endpoint = reachable(publisher.replay_endpoint, host)
        engine = Engine(config, executor, kv_events=publisher)
        try:
            await engine.__aenter__()
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
        self._engine, self._publisher = engine, publisher
        log.info("ray_replica_started", replica=self._replica_id, endpoint=self._endpoint)

    @property
    def engine(self) -> Engine:
        """The running engine."""
        if self._engine is None:
            raise EngineStoppedError("this replica's engine is not started (call start())")
        return self._engine

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> Completion:
        """Serve one prompt to its end (pass ``prompt_token_ids`` by keyword: the
        router reads it, and ``cache_salt``, from the call's keywords)."""
        last = None
        async with self.engine.generate(prompt_token_ids, params, cache_salt=cache_salt) as stream:
            async for output in stream:
                last = output
        assert last is not None and last.finish_reason is not None
        return Completion(
            replica_id=self._replica_id,
            token_ids=last.token_ids,
            finish_reason=str(last.finish_reason),
            num_cached_tokens=last.num_cached_tokens,
        )

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads of this replica (Serve calls it every
        ``request_routing_stats_period_s``)."""
        engine = self.engine
        stats = engine.stats()
        publisher = self._publisher
        return ReplicaReport(
            block_size=engine.config.block_size,
            hash_algorithm=engine.core.kv.hash_name,
            endpoint=self._endpoint,
            replay_endpoint=self._replay_endpoint,
            topic=publisher.config.topic if publisher is not None else "",
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            free_tokens=token_headroom(
                engine.core.kv, stats.num_free_blocks, engine.config.max_model_len
            ),
        ).to_stats()

    async def check_health(self) -> None:
        """Raise once the engine stopped (Serve then replaces the replica)."""
        if not self.engine.is_running:
            raise EngineStoppedError("the engine stopped") from self.engine.error

    async def __del__(self) -> None:
        """Stop the engine, then the publisher (after its last batches went out)."""
        engine, self._engine = self._engine, None
        publisher, self._publisher = self._publisher, None
        if engine is not None:
            await engine.__aexit__(None, None, None)
        if publisher is not None:
            await anyio.to_thread.run_sync(publisher.close)


__all__ = ["DEFAULT_KV_EVENTS", "Completion", "EngineReplica", "ReplicaStartError"]
