"""The replicas a Ray Serve router follows: what each reports, its KV-event index, its load.

Each replica of an :class:`~hybridkv.serving.router.ray.engine.EngineReplica` deployment
reports a :class:`ReplicaReport` through Ray Serve's ``record_routing_stats``: where its
KV events go, how its blocks hash, and its queue. A router's :class:`ReplicaTable` keeps
an index per replica, fed by those events (``serving/router/feed.py``, ``index.py``),
and ranks replicas with a :class:`~hybridkv.serving.router.ranking.PrefixRouter` over them::

    report                      table                                 ranking
    endpoint, replay, topic --> ReplicaFeed --> ReplicaIndex ----+
    block size, hash        --> one layout for every index       +--> PrefixRouter.rank
    waiting, running,       --> ReplicaLoad (or this router's    |
    free tokens                 requests in flight, if more) ----+

A replica without a report yet, one that publishes no events, and one whose layout
differs from the others' get an empty index: they are ranked by load alone (and by the
prompts this router sent them), as every replica is until one describes its events. A
replica that leaves is forgotten and its feed handed back to be closed. Nothing here
imports Ray: the router (``router.py``) drives the table, and tests do too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from hybridkv.errors.events import get_logger
from hybridkv.serving.router.feed import ReplicaFeed
from hybridkv.serving.router.index import ReplicaIndex
from hybridkv.serving.router.ranking import LeastLoaded, PrefixRouter, ReplicaLoad, RouterWeights

log = get_logger(__name__)

#: The key of a replica's routing stats that holds its report.
STATS_KEY = "hybridkv"

#: A replica's block size and hash: every index one router compares must share them.
Layout = tuple[int, str]


@attrs.frozen(kw_only=True)
class ReplicaReport:
    """What a replica tells the router, each ``request_routing_stats_period_s``.

    Attributes:
        block_size: Its engine's tokens per block.
        hash_algorithm: Its prefix-cache hash (``memory/hashing.py``).
        endpoint: Its KV events' PUB socket as a router connects to it, or None when it
            publishes none.
        replay_endpoint: Its replay (ROUTER) socket, or None.
        topic: The topic it publishes under.
        num_waiting: Requests waiting in its engine.
        num_running: Requests running in its engine.
        free_tokens: The longest prompt its free pages hold (``memory/headroom.py``;
            None: not reported).
    """

    block_size: int = attrs.field(validator=attrs.validators.ge(1))
    hash_algorithm: str = "sha256"
    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    num_waiting: int = 0
    num_running: int = 0
    free_tokens: int | None = None

    @property
    def layout(self) -> Layout:
        """Its block size and hash."""
        return (self.block_size, self.hash_algorithm)

    @property
    def source(self) -> tuple[str | None, str | None, str, Layout]:
        """Where its events come from and how to read them (its load aside)."""
        return (self.endpoint, self.replay_endpoint, self.topic, self.layout)

    def to_stats(self) -> dict[str, Any]:
        """The routing stats that carry it (plain values, as Serve forwards them)."""
        return {STATS_KEY: attrs.asdict(self)}

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> ReplicaReport | None:
        """The report in a replica's routing stats; None when there is none (no stats
        yet, another deployment class) or it does not parse."""
        data = (stats or {}).get(STATS_KEY)
        if not isinstance(data, Mapping):
            return None
        try:
            return cls(**data)
        except (TypeError, ValueError):
            return None


class Feed(Protocol):
    """What the table asks of a replica's feed (:class:`ReplicaFeed`, or a test's)."""

    def apply_pending(self) -> int:
        """Apply the batches received to the index; how many."""
        ...

    def close(self) -> None:
        """Stop following (may wait for the feed's thread)."""
        ...


def zmq_feed(index: ReplicaIndex, report: ReplicaReport) -> Feed:
    """A :class:`ReplicaFeed` on the replica's sockets (the table's default)."""
    assert report.endpoint is not None
    return ReplicaFeed(
        index, report.endpoint, replay_endpoint=report.replay_endpoint, topic=report.topic
    )


@attrs.define
class _Followed:
    """A replica whose events the table follows."""

    report: ReplicaReport  # the one its feed was made from
    index: ReplicaIndex
    feed: Feed


class ReplicaTable:
    """The replicas one router ranks, and what it knows of each (see the module).

    Every method may be called from any thread (one lock): the router's event loop
    routes, a test or a metrics thread may ask :meth:`resumable`.

    Args:
        weights: The prefix router's trade-off of a hit against load.
        follow: Starts a feed of a replica's events into its index.
    """

    def __init__(
        self,
        weights: RouterWeights | None = None,
        follow: Callable[[ReplicaIndex, ReplicaReport], Feed] = zmq_feed,
    ) -> None:
        self.weights = weights or RouterWeights()
        self._follow_feed = follow
        self._lock = threading.Lock()
        self._reports: dict[str, ReplicaReport | None] = {}
        self._followed: dict[str, _Followed] = {}
        self._in_flight: dict[str, set[str]] = {}
        self._router: PrefixRouter | None = None
        self._shape: tuple[Layout, frozenset[str], frozenset[str]] | None = None
        self._mismatched: set[str] = set()

    @property
    def names(self) -> frozenset[str]:
        """The replicas known now."""
        with self._lock:
            return frozenset(self._reports)

    @property
    def followed(self) -> frozenset[str]:
        """The replicas whose events are followed."""
        with self._lock:
            return frozenset(self._followed)

    def update(self, reports: Mapping[str, ReplicaReport | None]) -> list[Feed]:
        """Take the replicas running now, each with its latest report (None before its
        first): follow those that newly describe their events, forget those gone.

        Returns:
            The feeds of replicas no longer followed. Close them off the event loop: a
            feed's ``close`` waits for its thread.
        """
        with self._lock:
            return self._update(reports)

    def forget(self, name: str) -> list[Feed]:
        """Drop replica ``name`` (its actor died); returns its feed to close, if any."""
        with self._lock:
            return self._update({n: r for n, r in self._reports.items() if n != name})

    def close(self) -> list[Feed]:
        """Forget every replica; returns every feed to close."""
        with self._lock:
            return self._update({})

    def rank(
        self,
        candidates: Collection[str],
        token_ids: Sequence[int] | None,
        extra_keys: tuple[Hashable, ...] = (),
    ) -> list[str]:
        """``candidates`` best first for a prompt of ``token_ids`` (None: by load
        alone); candidates the table does not know yet come last, by name."""
        with self._lock:
            for followed in self._followed.values():
                followed.feed.apply_pending()
            known = [name for name in candidates if name in self._reports]
            unknown = sorted(name for name in candidates if name not in self._reports)
            loads = self._loads()
            if not token_ids or self._router is None:
                return LeastLoaded().rank((), loads, known) + unknown
            return self._router.rank(token_ids, loads, known, extra_keys) + unknown

    def routed(
        self,
        name: str,
        request_id: str,
        token_ids: Sequence[int] | None,
        extra_keys: tuple[Hashable, ...] = (),
    ) -> None:
        """Request ``request_id`` went to ``name``: it counts there until
        :meth:`completed`, and its prompt's blocks are remembered there until that
        replica's events show them (the prefix router's provisional hits)."""
        with self._lock:
            if name not in self._reports:
                return
            self._in_flight[name].add(request_id)
            if token_ids and self._router is not None:
                self._router.sent(name, token_ids, extra_keys)

    def completed(self, name: str, request_id: str) -> None:
        """Request ``request_id`` at ``name`` ended (any way)."""
        with self._lock:
            self._in_flight.get(name, set()).discard(request_id)

    def loads(self) -> dict[str, ReplicaLoad]:
        """Each replica's load as the router ranks it: its last report, its running count
        raised to the requests this router has in flight there."""
        with self._lock:
            return self._loads()

    def resumable(
        self, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> dict[str, int]:
        """Per followed replica, the tokens of ``token_ids`` its events say it resumes
        (what its own prefix lookup would find; this router's provisional hits aside)."""
        with self._lock:
            out = {}
            for name, followed in self._followed.items():
                followed.feed.apply_pending()
                out[name] = followed.index.resumable(token_ids, extra_keys)
            return out

    # -- under the lock -------------------------------------------------------------

    def _update(self, reports: Mapping[str, ReplicaReport | None]) -> list[Feed]:
        gone = [
            name
            for name, followed in self._followed.items()
            if (report := reports.get(name)) is None or report.source != followed.report.source
        ]
        stale = [self._followed.pop(name).feed for name in gone]
        self._reports = dict(reports)
        self._in_flight = {name: self._in_flight.get(name, set()) for name in reports}
        self._mismatched &= reports.keys()
        layout = self._layout()
        for name, report in sorted(reports.items()):
            if name not in self._followed and report is not None and layout is not None:
                self._follow(name, report, layout)
        self._rebuild(layout)
        return stale

    def _layout(self) -> Layout | None:
        """The followed replicas' layout, else the first (by name) that can be followed."""
        for followed in self._followed.values():
            return followed.report.layout
        for _, report in sorted(self._reports.items()):
            if report is not None and report.endpoint is not None:
                return report.layout
        return None

    def _follow(self, name: str, report: ReplicaReport, layout: Layout) -> None:
        if report.endpoint is None:
            return
        if report.layout != layout:
            if name not in self._mismatched:
                self._mismatched.add(name)
                log.warning(
                    "ray_replica_layout_differs",
                    replica=name,
                    block_size=report.block_size,
                    hash_algorithm=report.hash_algorithm,
                    expected=layout,
                )
            return
        index = ReplicaIndex(report.block_size, report.hash_algorithm)
        self._followed[name] = _Followed(report, index, self._follow_feed(index, report))
        log.info("ray_replica_followed", replica=name, endpoint=report.endpoint)

    def _rebuild(self, layout: Layout | None) -> None:
        """A prefix router over the replicas known now, when they or the followed ones
        changed (its provisional hits start afresh; the indexes are kept)."""
        if layout is None:
            self._router, self._shape = None, None
            return
        shape = (layout, frozenset(self._reports), frozenset(self._followed))
        if shape == self._shape:
            return
        indexes = {
            name: self._followed[name].index
            if name in self._followed
            else ReplicaIndex(*layout)  # empty: ranked by load alone
            for name in self._reports
        }
        self._router = PrefixRouter(indexes, self.weights)
        self._shape = shape

    def _loads(self) -> dict[str, ReplicaLoad]:
        """Each replica's last report, its running count raised to the requests this
        router has in flight there (reports lag by up to a stats period)."""
        loads = {}
        for name, report in self._reports.items():
            waiting = report.num_waiting if report is not None else 0
            running = report.num_running if report is not None else 0
            in_flight = len(self._in_flight[name])
            loads[name] = ReplicaLoad(
                num_waiting=waiting,
                num_running=max(running, in_flight - waiting),
                free_tokens=report.free_tokens if report is not None else None,
            )
        return loads


__all__ = ["STATS_KEY", "Feed", "Layout", "ReplicaReport", "ReplicaTable", "zmq_feed"]
