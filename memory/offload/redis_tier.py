"""The Redis tier: blocks shared by several engines, on one machine or many (redis-py).

Every call has a socket timeout. When the server cannot be reached the tier logs one
``kv_tier_unavailable`` warning, raises :class:`TierUnavailableError` at once for
``retry_after_s`` seconds (no call waits on a dead server again), then tries again and
logs ``kv_tier_recovered`` when it answers: the engine recomputes meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hybridkv.errors.events import get_logger
from hybridkv.memory.offload.errors import OffloadConfigError, TierUnavailableError
from hybridkv.memory.offload.tier import TierObserver

log = get_logger(__name__)

_T = TypeVar("_T")


class RedisTier:
    """Blocks in a Redis server.

    Args:
        url: ``redis://HOST:PORT[/DB]`` (``rediss://`` for TLS, ``unix://`` paths).
        timeout_s: Socket connect and read timeout of every call.
        ttl_s: Expiry of stored values (None: the server's eviction policy decides).
        retry_after_s: After a failure, calls fail at once for this long.
    """

    name = "redis"
    is_remote = True

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 1.0,
        ttl_s: int | None = None,
        retry_after_s: float = 5.0,
    ) -> None:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - redis is a core dependency
            raise OffloadConfigError("the Redis tier needs the redis package") from exc
        try:
            self._client: Any = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
        except ValueError as exc:
            raise OffloadConfigError(f"bad Redis URL {url!r}: {exc}") from exc
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.url = url
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self._down_until: float | None = None
        self._store_id: str | None = None
        self._lock = threading.Lock()
        self.observer: TierObserver | None = None

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        down = self._down_until
        if down is not None and time.monotonic() < down:
            raise TierUnavailableError(f"Redis at {self.url} is unavailable (retrying later)")
        try:
            result = fn()
        except self._errors as exc:
            with self._lock:
                if self._down_until is None:
                    log.warning("kv_tier_unavailable", tier=self.name, call=what, error=repr(exc))
                self._down_until = time.monotonic() + self.retry_after_s
            raise TierUnavailableError(f"Redis at {self.url} failed on {what}: {exc}") from exc
        if down is not None:
            with self._lock:
                if self._down_until is not None:
                    log.info("kv_tier_recovered", tier=self.name)
                self._down_until = None
        return result

    def store_id(self) -> str:
        """The server's run id and the database: the same from every engine, whatever
        host name its URL gives (``INFO server``; asked once)."""
        if self._store_id is None:
            info = self._call("info", lambda: self._client.info("server"))
            db = self._client.connection_pool.connection_kwargs.get("db", 0)
            self._store_id = f"redis:{info['run_id']}/{db}"
        return self._store_id

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def exists() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]

        return self._call("contains", exists)

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        if not keys:
            return []
        values: list[bytes | None] = self._call("get", lambda: self._client.mget(list(keys)))
        return list(values)

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items:
            return

        def store() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=self.ttl_s)
            pipe.execute()

        self._call("put", store)
        if self.observer is not None:
            self.observer.stored(self.name, [key for key, _ in items])

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call("delete", lambda: self._client.delete(*keys))
            if self.observer is not None:
                self.observer.removed(self.name, keys)

    def close(self) -> None:
        self._client.close()
