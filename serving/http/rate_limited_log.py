"""A log line that a flood cannot multiply: at most one per interval, with the count of
those left out (the connection layer's refusals, timeouts and accept errors)."""

from __future__ import annotations

from typing import Any

import attrs

from hybridkv.errors.events import get_logger

log = get_logger(__name__)


@attrs.define
class RateLimitedLog:
    """One kind of log line, at most once per ``interval_s``: the lines that come sooner
    are left out and counted, and the count goes with the next line (``suppressed=N``).

    The caller passes the time (``now``, seconds on any monotonic clock), so that a test
    can drive it with made-up times.
    """

    event: str
    level: str = "warning"
    interval_s: float = 1.0
    _last: float | None = attrs.field(default=None, init=False)
    _suppressed: int = attrs.field(default=0, init=False)

    def __call__(self, now: float, **fields: Any) -> bool:
        """Log ``event`` with ``fields`` unless one was logged under ``interval_s`` ago;
        whether it was logged."""
        if self._last is not None and now - self._last < self.interval_s:
            self._suppressed += 1
            return False
        self._last = now
        if self._suppressed:
            fields["suppressed"] = self._suppressed
            self._suppressed = 0
        getattr(log, self.level)(self.event, **fields)
        return True


__all__ = ["RateLimitedLog"]
