"""What a caller of the engine may catch: one family, rooted at ``HybridKVError``.

Bad input is refused when ``generate`` is called, before anything is queued; failures
of a running request are raised by its output iterator.
"""

from __future__ import annotations

from hybridkv.errors import HybridKVError
from hybridkv.memory.errors import CapacityError, PromptTooLongError
from hybridkv.scheduler.batch import ExecutorBrokenError
from hybridkv.scheduler.params import InvalidRequestError


class EngineOverloadedError(HybridKVError):
    """Too many requests wait already; retry later (an HTTP server answers 503)."""


class EngineStoppedError(HybridKVError):
    """The engine is not running: not started yet, shut down, or broken by its executor."""


class RequestFailedError(HybridKVError):
    """The step that ran a request failed; ``__cause__`` is the executor's exception."""


__all__ = [
    "CapacityError",
    "EngineOverloadedError",
    "EngineStoppedError",
    "ExecutorBrokenError",
    "HybridKVError",
    "InvalidRequestError",
    "PromptTooLongError",
    "RequestFailedError",
]
