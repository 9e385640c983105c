"""hybridkv's prefix router as a Ray Serve request router, for replicas across machines.

Give a deployment of :class:`~hybridkv.serving.router.ray.engine.EngineReplica` replicas this
router (Ray Serve's custom ``RequestRouter`` API)::

    @serve.deployment(num_replicas=4, request_router_config=HybridKVRouter.config())
    class Model(EngineReplica): ...

Every handle (and proxy) of the deployment then routes with its own
:class:`~hybridkv.serving.router.ray.replicas.ReplicaTable`: it follows the KV events of each
replica that reported where they go, and ranks the replicas for each request with the
prefix router, by what the prompt would not recompute there against the queue there.

A request carries its prompt as the keyword argument ``prompt_token_ids`` of the handle
call (and its cache salt as ``cache_salt``), as :meth:`EngineReplica.generate` takes
them; a request without them (an HTTP request through the proxy, a positional prompt) is
ranked by load alone and not remembered. Serve tries the replicas in the order given,
one at a time, skipping those at ``max_ongoing_requests``.

Ray is an optional extra (``pip install 'hybridkv[ray]'``): only this module imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

import attrs
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from hybridkv.errors.events import get_logger
from hybridkv.serving.router.ranking import RouterWeights
from hybridkv.serving.router.ray.replicas import Feed, ReplicaReport, ReplicaTable

log = get_logger(__name__)

#: The handle call's keyword argument that carries the prompt's token ids.
PROMPT_KWARG = "prompt_token_ids"
#: The keyword argument that carries the cache salt (the hashes' extra key).
SALT_KWARG = "cache_salt"


def prompt_of(
    request: PendingRequest | None,
) -> tuple[Sequence[int] | None, tuple[Hashable, ...]]:
    """A request's prompt token ids (None when it carries none) and extra keys."""
    if request is None:
        return None, ()
    token_ids = request.kwargs.get(PROMPT_KWARG)
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, str | bytes):
        token_ids = None
    salt = request.kwargs.get(SALT_KWARG)
    return token_ids, (salt,) if isinstance(salt, str) else ()


class HybridKVRouter(RequestRouter):  # type: ignore[misc]
    """Ranks a deployment's replicas by prefix hits their KV events show, against load.

    ``request_router_kwargs`` are :class:`~hybridkv.serving.router.ranking.RouterWeights`'
    fields. :attr:`table` holds what the router knows of each replica.
    """

    table: ReplicaTable

    @classmethod
    def config(
        cls, *, weights: RouterWeights | None = None, stats_period_s: float = 1.0
    ) -> RequestRouterConfig:
        """A deployment's ``request_router_config`` for this router.

        Args:
            weights: The trade-off of a hit against load.
            stats_period_s: How often Serve asks each replica for its report (its load
                and where its events go); Serve's default, 10 s, lets loads go stale.
        """
        return RequestRouterConfig(
            request_router_class=cls,
            request_router_kwargs=attrs.asdict(weights or RouterWeights()),
            request_routing_stats_period_s=stats_period_s,
        )

    def initialize_state(self, **weights: Any) -> None:
        """Serve's hook, with the config's ``request_router_kwargs``."""
        self.table = ReplicaTable(RouterWeights(**weights))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's hook, on every change of the replicas or their routing stats."""
        super().update_replicas(replicas)
        reports = {
            r.replica_id.unique_id: ReplicaReport.from_stats(r.routing_stats) for r in replicas
        }
        _close_later(self.table.update(reports))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Serve's hook: a replica's actor died before the controller said it left."""
        super().on_replica_actor_died(replica_id)
        _close_later(self.table.forget(replica_id.unique_id))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The candidates, best first, each its own rank: Serve tries them in order."""
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        token_ids, extra_keys = prompt_of(pending_request)
        try:
            order = self.table.rank(by_name, token_ids, extra_keys)
        except (TypeError, ValueError, OverflowError) as exc:  # not token ids after all
            log.warning("ray_route_unhashable_prompt", error=str(exc))
            order = self.table.rank(by_name, None)
        return [[by_name[name]] for name in order]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Serve's hook: the replica accepted the request. It counts there until its
        result is done (a callback on the result, which Ray calls from a thread of its
        own: the table is locked)."""
        name = replica_id.unique_id
        request_id = pending_request.metadata.internal_request_id
        token_ids, extra_keys = prompt_of(pending_request)
        try:
            self.table.routed(name, request_id, token_ids, extra_keys)
        except (TypeError, ValueError, OverflowError):
            self.table.routed(name, request_id, None)
        result.add_done_callback(lambda _: self.table.completed(name, request_id))

    def close(self) -> None:
        """Stop following every replica; blocks until the feeds stopped (call it off the
        event loop: a handle's router runs on Serve's own loop thread)."""
        for feed in self.table.close():
            feed.close()


def _close_later(feeds: list[Feed]) -> None:
    """Close feeds in a thread of their own: a close waits for the feed's thread, which
    may be waiting on a replica that is gone."""
    for feed in feeds:
        threading.Thread(target=feed.close, name="kv-feed-close", daemon=True).start()


__all__ = ["PROMPT_KWARG", "SALT_KWARG", "HybridKVRouter", "prompt_of"]
