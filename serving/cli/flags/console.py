"""Terminal output of the command line: log level and format, one stream for every logger.

The library never configures logging; the command line is an application, so it does,
once, at start. Everything goes to stderr in one format: hybridkv's structlog events,
and the standard library's records (uvicorn's access and error lines, hypercorn's,
transformers') rendered by the same processors::

    text   18:17:21 [info     ] request_finished   finish_reason=length ...
    json   {"event": "request_finished", "finish_reason": "length", "level": "info", ...}

Third-party libraries log at warning and above; the HTTP servers' loggers follow
``--log-level`` (their access lines are info).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import structlog

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
#: Standard-library loggers that follow --log-level (the others: warning and above).
SERVER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "hypercorn", "hypercorn.error")


def configure_logging(level: str = "warning", fmt: str = "text") -> None:
    """Send structlog events and standard-library records of ``level`` and above (warning
    for third parties but the HTTP servers) to stderr, as text lines or JSON objects."""
    numeric = logging.getLevelNamesMapping()[level.upper()]
    shared: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso" if fmt == "json" else "%H:%M:%S"),
    ]
    # Tracebacks without local variables in both formats: a failed request's locals
    # hold its prompt and messages, which the default level must not write out.
    renderer: Any
    if fmt == "json":
        transformer = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(transformer))
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback
        )
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))
    for name in SERVER_LOGGERS:
        server = logging.getLogger(name)
        server.handlers.clear()
        server.propagate = True
        server.setLevel(numeric)


def add_log_level_argument(parser: argparse._ActionsContainer, default: str) -> None:
    """The ``--log-level`` and ``--log-format`` flags."""
    parser.add_argument(
        "--log-level", choices=LEVELS, default=default, help=f"log level ({default})"
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="log lines as text, or one JSON object each (text)",
    )
