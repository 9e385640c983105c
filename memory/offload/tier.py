"""The tier protocol: a key-value store of encoded blocks that the connector reads and
writes in batches.

Every method may be called from any thread. A tier that cannot answer (a server gone
away) raises :class:`~hybridkv.memory.offload.errors.TierUnavailableError` quickly,
never blocks for long: the connector then treats its blocks as missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

#: Makes a writable buffer of n bytes for a stored value (pinned host memory on CUDA).
BufferFactory = Callable[[int], bytearray | memoryview]


class TierObserver(Protocol):
    """Told which keys a tier took and dropped (``tier_events.py``: as KV events)."""

    def stored(self, tier: str, keys: Sequence[bytes]) -> None:
        """``tier`` holds ``keys`` now."""
        ...

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        """``tier`` dropped ``keys`` (deleted, or evicted to stay within its budget)."""
        ...


class Tier(Protocol):
    """A store of encoded blocks (see ``blob.py``), keyed as in ``keys.py``.

    ``observer``, where set, hears of every key stored and dropped by this process's
    calls, the tier's own evictions included where the tier sees them (a Redis server's
    expiry and eviction it does not see).
    """

    observer: TierObserver | None

    @property
    def name(self) -> str:
        """Its label in metrics and logs (``host``, ``redis``)."""
        ...

    @property
    def is_remote(self) -> bool:
        """Whether a call is a network round trip: the connector then asks it from a
        worker thread, never from the engine's loop (``lookups.py``)."""
        ...

    def store_id(self) -> str | None:
        """Names the store where other engines read what this tier holds, the same from
        every engine that reaches it (None: this process's alone). A router credits a
        replica with the blocks any replica of the same store published there."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the tier holds it now."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """Per key, its stored value, or None where it is missing."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store values (a tier may drop some to stay within its budget)."""
        ...

    def delete(self, keys: Sequence[bytes]) -> None:
        """Drop keys (missing ones are ignored)."""
        ...

    def close(self) -> None:
        """Release connections and memory."""
        ...
