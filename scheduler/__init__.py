"""The async engine and everything a user of hybridkv touches.

``Engine`` runs continuous batching over an ``Executor`` and one shared paged KV pool;
``generate`` streams :class:`RequestOutput` values. See docs/architecture.md.
"""

from hybridkv.errors import HybridKVError
from hybridkv.memory.layout import PoolSpec
from hybridkv.scheduler.batch import (
    Executor,
    ExecutorBrokenError,
    PipelinedExecutor,
    StepBatch,
    StepRequest,
    StepResult,
)
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
from hybridkv.scheduler.fake_pipelined import PipelinedFakeExecutor
from hybridkv.scheduler.outputs import EngineStats, FinishReason, RequestOutput, TokenLogprobs
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
    "PipelinedExecutor",
    "PipelinedFakeExecutor",
    "PoolSpec",
    "PromptTooLongError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StepBatch",
    "StepRequest",
    "StepResult",
    "TokenLogprobs",
]
