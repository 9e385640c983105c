"""The replicas behind a data-parallel front end: where each serves, whether it does,
what it holds, and the order to try them in for one request.

::

    Replica(url)  --GET /health------> healthy, or out of rotation with the reason
                  --GET /kv_events---> its ReplicaIndex, followed by a ReplicaFeed, and
                                       the tiers it shares (one Redis: one another's hits)
                  --GET /load--------> the prompt its free pages hold (polled)
    ReplicaSet.order(prompt ids)  ---> the healthy replicas, best first (the policy's)

A replica leaves the rotation when a connection to it is refused or times out, when it
answers 503 (its engine stopped), when its process exits (``serve
--data-parallel-size``) or when a health probe fails, and the forwards to it in progress
are cancelled then; it comes back when a probe answers 200, with a fresh index (a
restarted engine numbers its events from 0 again). The load the policies weigh is the
front end's own count of requests in flight per replica (exact for the one front end the
replicas serve) and, for the prefix policies, the longest prompt each replica's free
pages hold, polled from its ``/load`` every ``--load-interval`` (as vLLM's data-parallel
coordinator gathers its engines' stats every 100 ms); a replica's answers carry the same
figure (``x-hybridkv-free-tokens``), so only a replica that has answered nothing within
the interval is polled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine, Hashable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import anyio
import attrs
import httpx

from hybridkv.errors.events import get_logger
from hybridkv.serving.http.headers import FREE_TOKENS_HEADER
from hybridkv.serving.router.feed import ReplicaFeed
from hybridkv.serving.router.index import ReplicaIndex
from hybridkv.serving.router.ranking import (
    LeastLoaded,
    PrefixRouter,
    ReplicaLoad,
    RoundRobin,
    Router,
)
from hybridkv.serving.router.upstream import UpstreamError, UpstreamPool

log = get_logger(__name__)

#: ``--routing`` values: ours; a prefix router that credits the full-attention groups'
#: hits alone (as a router does that reads full-attention events only, SGLang's Mamba
#: radix cache emitting no others); two load-only baselines.
POLICIES = ("prefix", "prefix-full-attention", "least-loaded", "round-robin")


@attrs.define(eq=False)
class Replica:
    """One engine's server, as the front end sees it.

    Attributes:
        name: Its name in logs, metrics (``replica`` label) and ``/health``.
        url: Its base URL (``http://host:port``).
        pid: Its process, where the front end started it.
        healthy: In rotation.
        reason: Why it is out of rotation (None while in).
        in_flight: Requests forwarded and not finished.
        free_tokens: The longest prompt its free pages held when it last said (its
            ``/load``, or an answer's header; None: not yet, or it does not say).
        load_heard_at: When it last said (the event loop's clock).
        index: Its blocks, from its KV events (None: it publishes none, or not yet
            discovered).
    """

    name: str
    url: str
    pid: int | None = None
    healthy: bool = False
    reason: str | None = "not probed yet"
    in_flight: int = 0
    free_tokens: int | None = None
    load_heard_at: float = -math.inf
    index: ReplicaIndex | None = None
    feed: ReplicaFeed | None = None
    #: The forwards to it in progress, each cancelled when it leaves the rotation.
    forwards: set[anyio.CancelScope] = attrs.field(factory=set, repr=False)

    def describe(self) -> dict[str, Any]:
        """Its entry in the front end's ``/health``."""
        return {
            "url": self.url,
            "pid": self.pid,
            "healthy": self.healthy,
            "reason": self.reason,
            "in_flight": self.in_flight,
            "free_tokens": self.free_tokens,
            "kv_events": self.index is not None,
        }


class ReplicaSet:
    """The replicas and the routing policy over them.

    Args:
        replicas: Each replica (names unique).
        client: The HTTP client that probes and forwards.
        policy: One of :data:`POLICIES`. The prefix policies need replicas that publish
            KV events; until one does, they rank by load alone.
    """

    def __init__(
        self, replicas: Sequence[Replica], client: httpx.AsyncClient, policy: str = "prefix"
    ) -> None:
        if not replicas:
            raise ValueError("a front end needs at least one replica")
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}")
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names repeat: {names}")
        self.replicas = {r.name: r for r in replicas}
        self.client = client
        #: The kept-alive connections that forwards and load polls use (:meth:`aclose`).
        self.upstream = UpstreamPool()
        self.policy = policy
        self._load_only: Router = RoundRobin() if policy == "round-robin" else LeastLoaded()
        self._prefix: PrefixRouter | None = None

    @property
    def prefix_router(self) -> PrefixRouter | None:
        """The prefix policies' router, once a replica's events are followed (None
        before, and for the load-only policies)."""
        return self._prefix

    @property
    def healthy(self) -> list[Replica]:
        """The replicas in rotation."""
        return [r for r in self.replicas.values() if r.healthy]

    # -- choosing ---------------------------------------------------------------------

    def order(
        self, token_ids: Sequence[int] | None, extra_keys: tuple[Hashable, ...] = ()
    ) -> list[Replica]:
        """The healthy replicas, best first for a prompt of ``token_ids`` (None: a request
        the front end could not read, which goes by load)."""
        candidates = [r.name for r in self.healthy]
        loads = {
            r.name: ReplicaLoad(num_running=r.in_flight, free_tokens=r.free_tokens)
            for r in self.replicas.values()
        }
        router: Router = self._load_only
        if self._prefix is not None and token_ids is not None:
            router = self._prefix
            for replica in self.healthy:
                if replica.feed is not None:
                    replica.feed.apply_pending()
        ranked = router.rank(token_ids or (), loads, candidates, extra_keys)
        return [self.replicas[name] for name in ranked]

    def sent(
        self,
        replica: Replica,
        token_ids: Sequence[int] | None,
        extra_keys: tuple[Hashable, ...] = (),
    ) -> None:
        """A request of prompt ``token_ids`` (None: unread) went to ``replica``."""
        router = self._prefix or self._load_only
        router.sent(replica.name, token_ids or (), extra_keys)

    # -- rotation ---------------------------------------------------------------------

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take ``replica`` out of rotation (logged once per fall) and cancel every
        forward to it in progress: a hung replica holds no client."""
        if replica.healthy:
            log.warning("replica_down", replica=replica.name, url=replica.url, reason=reason)
        replica.healthy = False
        replica.reason = reason
        for scope in replica.forwards:
            scope.cancel()

    async def probe(self, replica: Replica) -> None:
        """Ask ``replica``'s ``/health``; on a way back into rotation, follow its events
        afresh."""
        try:
            answer = await self.client.get(f"{replica.url}/health", timeout=10.0)
            fine = answer.status_code == 200
            reason = f"/health answered {answer.status_code}"
        except httpx.HTTPError as exc:
            fine, reason = False, _transport_error(exc)
        if not fine:
            self.mark_down(replica, reason)
            return
        if replica.healthy:
            return
        try:
            await self._follow(replica)
        except (httpx.HTTPError, ValueError) as exc:
            self.mark_down(replica, f"its /kv_events could not be followed: {exc}")
            return
        replica.healthy, replica.reason = True, None
        log.info("replica_up", replica=replica.name, url=replica.url)

    async def watch(self, interval_s: float) -> None:
        """Probe every replica every ``interval_s`` seconds, forever."""
        await self._every(interval_s, self.probe, lambda: list(self.replicas.values()))

    def heard_load(self, replica: Replica, headers: Mapping[str, str]) -> None:
        """Take ``replica``'s free tokens from an answer's ``headers``, where it said."""
        value = headers.get(FREE_TOKENS_HEADER)
        if value is not None and value.isdigit():
            replica.free_tokens = int(value)
            replica.load_heard_at = anyio.current_time()

    async def poll_load(self, replica: Replica) -> None:
        """Read ``replica``'s ``/load`` (a failure forgets it: the health probe decides
        the rotation)."""
        try:
            with anyio.fail_after(10.0):
                answer = await self.upstream.send(f"{replica.url}/load", "GET", (), b"")
                try:
                    body = await answer.read()
                finally:
                    await answer.aclose()
            if answer.status_code != 200:
                raise ValueError(f"/load answered {answer.status_code}")
            replica.free_tokens = int(json.loads(body)["free_tokens"])
            replica.load_heard_at = anyio.current_time()
        except (UpstreamError, TimeoutError, ValueError, KeyError, TypeError):
            replica.free_tokens = None

    async def watch_load(self, interval_s: float) -> None:
        """Every ``interval_s`` seconds, forever, poll the ``/load`` of each healthy replica
        not heard from since the last time (the prefix policies' free pages; the others
        weigh requests alone)."""

        def unheard() -> list[Replica]:
            since = anyio.current_time() - interval_s
            return [r for r in self.healthy if r.load_heard_at < since]

        if self.policy.startswith("prefix"):
            await self._every(interval_s, self.poll_load, unheard)

    @staticmethod
    async def _every(
        interval_s: float,
        visit: Callable[[Replica], Coroutine[Any, Any, None]],
        replicas: Callable[[], list[Replica]],
    ) -> None:
        """``visit`` each of ``replicas()`` at once, then wait ``interval_s``; forever."""
        while True:
            async with anyio.create_task_group() as tg:
                for replica in replicas():
                    tg.start_soon(visit, replica)
            await anyio.sleep(interval_s)

    async def aclose(self) -> None:
        """Stop following every replica's events; close the idle connections."""
        for replica in self.replicas.values():
            if replica.feed is not None:
                replica.feed.close()
                replica.feed = None
        await self.upstream.aclose()

    async def _follow(self, replica: Replica) -> None:
        """Read where ``replica`` publishes its events and subscribe (a 404: it publishes
        none, and is routed by load)."""
        answer = await self.client.get(f"{replica.url}/kv_events", timeout=10.0)
        if replica.feed is not None:
            replica.feed.close()
            replica.feed, replica.index = None, None
        if answer.status_code == 404:
            log.warning("replica_without_kv_events", replica=replica.name, url=replica.url)
            return
        answer.raise_for_status()
        info = answer.json()
        index = ReplicaIndex(int(info["block_size"]), str(info["hash_algorithm"]))
        if self.policy.startswith("prefix"):
            if self._prefix is None:
                self._prefix = PrefixRouter(
                    {name: ReplicaIndex(index.hasher.block_size) for name in self.replicas},
                    full_attention_only=self.policy == "prefix-full-attention",
                )
            self._prefix.set_index(replica.name, index)  # a ValueError: another block size
            for medium, store in dict(info.get("shared_tiers") or {}).items():
                self._prefix.share(replica.name, str(medium), str(store))
        host = urlsplit(replica.url).hostname or "127.0.0.1"
        replay = info.get("replay_endpoint")
        replica.index = index
        replica.feed = ReplicaFeed(
            index,
            reachable(info["endpoint"], host),
            replay_endpoint=None if replay is None else reachable(replay, host),
            topic=str(info.get("topic", "")),
        )


def reachable(endpoint: str, host: str) -> str:
    """A bound ZMQ endpoint as a consumer connects to it: a wildcard address
    (``*``, ``0.0.0.0``, ``[::]``) becomes the replica's ``host``."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    address, _, port = rest.rpartition(":")
    if address in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        address = f"[{host}]" if ":" in host else host
    return f"tcp://{address}:{port}"


def _transport_error(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


__all__ = ["POLICIES", "Replica", "ReplicaSet", "reachable"]
