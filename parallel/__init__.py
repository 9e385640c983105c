"""Execution over several processes on torch.distributed: pipeline and context parallelism.

``rank_layout`` places every rank on the data, pipeline, context and tensor axes;
``pipeline_*`` runs a model's layers as stages in worker processes (``PipelineExecutor``
is the engine's side); ``context_*`` shards each request's tokens and KV pages over the
ranks of a stage. ``PipelineExecutor`` is imported lazily, so that reading this package's
names does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.parallel.pipeline_executor import PipelineExecutor

__all__ = ["PipelineExecutor"]


def __getattr__(name: str) -> Any:
    if name == "PipelineExecutor":
        from hybridkv.parallel.pipeline_executor import PipelineExecutor

        return PipelineExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
