"""The async engine and everything a user of hybridkv touches.

``Engine`` runs continuous batching over an ``Executor`` and one shared paged KV pool;
``generate`` streams :class:`RequestOutput` values. See design.md (Scheduler).
"""

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.batch import Executor, ExecutorBrokenError, StepBatch, StepRequest
from hybridkv.scheduler.config import ConfigError, EngineConfig
from hybridkv.scheduler.engine import Engine, RequestStream
from hybridkv.scheduler.errors import (
    CapacityError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    PromptTooLongError,
    RequestFailedError,
)
from hybridkv.scheduler.fake import FakeExecutor
from hybridkv.scheduler.outputs import EngineStats, FinishReason, RequestOutput
from hybridkv.scheduler.params import SamplingParams

__all__ = [
    "CapacityError",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineOverloadedError",
    "EngineStats",
    "EngineStoppedError",
    "Executor",
    "ExecutorBrokenError",
    "FakeExecutor",
    "FinishReason",
    "HybridKVError",
    "InvalidRequestError",
    "PromptTooLongError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StepBatch",
    "StepRequest",
]
