"""Terminal output of the command line: log level, and quiet third-party loggers.

The library never configures logging; the command line is an application, so it does,
once, at start: structlog events at ``level`` and above go to stderr as key-value lines.
"""

from __future__ import annotations

import argparse
import logging
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "warning") -> None:
    """Send structlog events of ``level`` and above to stderr."""
    numeric = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    # transformers and friends log through the standard library.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)


def add_log_level_argument(parser: argparse._ActionsContainer, default: str) -> None:
    """The ``--log-level`` flag."""
    parser.add_argument(
        "--log-level", choices=LEVELS, default=default, help=f"log level ({default})"
    )
