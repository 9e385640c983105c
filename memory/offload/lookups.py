"""Remote tiers asked off the event loop: which keys they hold, answered in a worker thread.

Planning runs on the engine's event loop, and a Redis ``EXISTS`` round trip there would
freeze every HTTP connection for as long as the server takes to answer (up to its socket
timeout when it stalls). So the connector asks a remote tier (``Tier.is_remote``) here::

    plan_load(r)   answers for r's keys?   no  -> start a lookup, r waits this step
                                           yes -> plan the load with them, forget them
    worker thread  tier.contains(keys)  -> answers kept for r (a failing tier: none held)

Answers are kept per request and used once, by its next admission, so a block saved or
evicted since is seen by the request after. A local tier (host memory) is asked in place.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from hybridkv.memory.offload.errors import TierUnavailableError
from hybridkv.memory.offload.tier import Tier


class TierLookups:
    """The answers of remote tiers, looked up in one worker thread (thread-safe).

    Args:
        tiers: The connector's tiers, in order (only the remote ones are asked here).
    """

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tuple(tiers)
        self._lock = threading.Lock()
        self._answers: dict[str, dict[int, dict[bytes, bool]]] = {}
        self._pending: set[str] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-tier-lookup")

    def answer(self, request_id: str, tier: int, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key, whether tier ``tier`` holds it, if a lookup of these keys finished;
        else None, and a lookup is started (one per request at a time)."""
        with self._lock:
            known = self._answers.get(request_id, {}).get(tier)
            if known is not None and all(key in known for key in keys):
                return [known[key] for key in keys]
            if request_id not in self._pending:
                self._pending.add(request_id)
                self._pool.submit(self._look, request_id, tier, list(keys))
            return None

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s answers (it was admitted, or it ended)."""
        with self._lock:
            self._answers.pop(request_id, None)

    def close(self) -> None:
        """Stop the worker (lookups not started are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _look(self, request_id: str, tier: int, keys: list[bytes]) -> None:
        try:
            found = self._tiers[tier].contains(keys)
        except TierUnavailableError:
            found = [False] * len(keys)  # a tier that fails holds nothing
        with self._lock:
            self._pending.discard(request_id)
            self._answers.setdefault(request_id, {})[tier] = dict(zip(keys, found, strict=True))
