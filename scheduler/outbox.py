"""What a flush delivers: the requests' outputs gathered during steps, in order, and the
prefix-cache events the steps caused (``hybridkv.memory.cache_events``).

The engine core gathers both while it plans and applies steps, and the engine flushes
them once the next step is on its way, so consumers run while the executor does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio

from hybridkv.errors import HybridKVError
from hybridkv.memory.cache_events import CacheEventLog, CacheEventSink, GroupInfo
from hybridkv.memory.manager import KVCacheManager
from hybridkv.memory.offload.tier import Tier
from hybridkv.memory.offload.tier_events import TierEvents
from hybridkv.scheduler.outputs import RequestOutput
from hybridkv.scheduler.request import Request


class Outbox:
    """Outputs to deliver, and the KV events to publish where a sink takes them.

    Args:
        kv: The engine's KV cache manager; with ``kv_events``, its pool (and ``tiers``)
            report every block that becomes findable or stops being so.
        kv_events: Takes each flush's events (a publisher, ``hybridkv.parallel``).
        tiers: The offload tiers whose stores and drops are reported too.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        kv_events: CacheEventSink | None = None,
        tiers: Sequence[Tier] = (),
    ) -> None:
        self._items: list[tuple[Request, RequestOutput | HybridKVError, bool]] = []
        self._sink = kv_events
        self.log: CacheEventLog | None = None
        if kv_events is not None:
            bs = kv.block_size
            self.log = CacheEventLog([GroupInfo.of(g, p, bs) for g, p in enumerate(kv.policies)])
            self.log.cleared()  # a fresh pool: consumers forget what an earlier run held
            kv.pool.events = self.log
            TierEvents(self.log).observe(tiers)

    def append(self, item: tuple[Request, RequestOutput | HybridKVError, bool]) -> None:
        """Queue (request, output or error, whether it is the request's last)."""
        self._items.append(item)

    def flush(self, abort: Callable[[Request], None]) -> None:
        """Deliver the outputs in order (a sink's last item closes it; ``abort`` ends a
        request whose consumer left), then publish the KV events gathered since."""
        items, self._items = self._items, []
        for request, item, is_last in items:
            sink = request.sink
            try:
                sink.send_nowait(item)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # The consumer left without closing its iterator on this thread: abort.
                abort(request)
            if is_last:
                sink.close()
        if self.log is not None and self._sink is not None:
            events = self.log.take()
            if events:
                self._sink.publish(events)
