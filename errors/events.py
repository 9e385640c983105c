"""Library logging: every event on the standard-library logger of its module, quiet until
the application says otherwise.

A library never configures logging. hybridkv's modules log structured events (snake_case
names, key-values) through :func:`get_logger`, which picks the route per call::

    the application configured structlog     the event goes through its configuration
                                             (``hybridkv``'s command line does this)
    it did not                               a standard-library record on the module's
                                             logger (``hybridkv.scheduler.core``, ...):
                                             "request_finished request_id='3f..' ..."

The ``hybridkv`` logger carries a ``NullHandler``, so an application that configured
neither prints nothing, and one that configured the standard library (``logging.basicConfig``
or its own handlers) gets hybridkv's records like any other library's, levels included.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

logging.getLogger("hybridkv").addHandler(logging.NullHandler())


def get_logger(name: str) -> EventLogger:
    """The event logger of module ``name`` (use ``get_logger(__name__)``)."""
    return EventLogger(name)


class EventLogger:
    """A structlog-style logger (``bind``, ``debug`` ... ``exception``) that follows the
    application's logging (see the module docstring). Cheap when nobody listens: a
    disabled level costs one ``isEnabledFor``."""

    __slots__ = ("_context", "_name", "_stdlib")

    def __init__(self, name: str, context: Mapping[str, Any] | None = None) -> None:
        self._name = name
        self._context = dict(context or {})
        self._stdlib = logging.getLogger(name)

    def bind(self, **values: Any) -> EventLogger:
        """A logger that adds ``values`` to every event."""
        return EventLogger(self._name, {**self._context, **values})

    def debug(self, event: str, **values: Any) -> None:
        """Log ``event`` at debug level."""
        self._log(logging.DEBUG, event, values)

    def info(self, event: str, **values: Any) -> None:
        """Log ``event`` at info level."""
        self._log(logging.INFO, event, values)

    def warning(self, event: str, **values: Any) -> None:
        """Log ``event`` at warning level."""
        self._log(logging.WARNING, event, values)

    def error(self, event: str, **values: Any) -> None:
        """Log ``event`` at error level."""
        self._log(logging.ERROR, event, values)

    def exception(self, event: str, **values: Any) -> None:
        """Log ``event`` at error level with the exception being handled."""
        self._log(logging.ERROR, event, values, exc_info=True)

    def _log(
        self, level: int, event: str, values: dict[str, Any], *, exc_info: bool = False
    ) -> None:
        if structlog.is_configured():
            bound = structlog.get_logger(self._name).bind(**self._context)
            method = logging.getLevelName(level).lower()
            if exc_info:
                values = {**values, "exc_info": True}
            getattr(bound, method)(event, **values)
            return
        if not self._stdlib.isEnabledFor(level):
            return
        fields = {**self._context, **values}
        self._stdlib.log(level, _Event(event, fields), exc_info=exc_info)


class _Event:
    """A record's message, rendered only if a handler formats it."""

    __slots__ = ("fields", "name")

    def __init__(self, name: str, fields: MutableMapping[str, Any]) -> None:
        self.name = name
        self.fields = fields

    def __str__(self) -> str:
        pairs = " ".join(f"{key}={value!r}" for key, value in self.fields.items())
        return f"{self.name} {pairs}" if pairs else self.name
