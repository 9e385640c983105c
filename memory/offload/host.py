"""The host-memory tier: encoded blocks in this process, within a byte budget, LRU.

On CUDA the executor passes a buffer factory that returns pinned memory, so loads copy
to the device without a staging copy. A value larger than the whole budget is not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from hybridkv.memory.offload.errors import OffloadConfigError
from hybridkv.memory.offload.tier import BufferFactory, TierObserver


class HostTier:
    """Blocks in host memory, the least recently used dropped first.

    Args:
        capacity_bytes: Most bytes of values held at once.
        allocate: Makes the buffer a value is copied into (default: ``bytearray``).
    """

    name = "host"
    is_remote = False

    def __init__(self, capacity_bytes: int, *, allocate: BufferFactory | None = None) -> None:
        if capacity_bytes < 1:
            raise OffloadConfigError(f"a host tier needs >= 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._allocate = allocate or bytearray
        self._values: OrderedDict[bytes, bytearray | memoryview] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_evicted = 0
        self.observer: TierObserver | None = None

    def __len__(self) -> int:
        return len(self._values)

    def held_keys(self) -> list[bytes]:
        """The keys held now, the least recently used first."""
        with self._lock:
            return list(self._values)

    def store_id(self) -> None:
        """This process's memory: no other engine reads it."""
        return None

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        values = self._values
        return [key in values for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = []
        with self._lock:
            for key in keys:
                value = self._values.get(key)
                if value is not None:
                    self._values.move_to_end(key)
                    out.append(memoryview(value))
                else:
                    out.append(None)
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for key, value in items:
            size = len(value)
            if size > self.capacity_bytes:
                continue
            buffer = self._allocate(size)
            buffer[:] = value
            with self._lock:
                old = self._values.pop(key, None)
                if old is not None:
                    self.num_bytes -= len(old)
                dropped = []
                while self.num_bytes + size > self.capacity_bytes:
                    dropped_key, evicted = self._values.popitem(last=False)
                    dropped.append(dropped_key)
                    self.num_bytes -= len(evicted)
                    self.num_evicted += 1
                self._values[key] = buffer
                self.num_bytes += size
                # Under the lock: the observer hears of one key's changes in their order.
                if self.observer is not None:
                    self.observer.removed(self.name, dropped)
                    self.observer.stored(self.name, [key])

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            dropped = []
            for key in keys:
                value = self._values.pop(key, None)
                if value is not None:
                    self.num_bytes -= len(value)
                    dropped.append(key)
            if self.observer is not None:
                self.observer.removed(self.name, dropped)

    def close(self) -> None:
        with self._lock:
            if self.observer is not None:
                self.observer.removed(self.name, list(self._values))
            self._values.clear()
            self.num_bytes = 0
