"""Execution over several processes on torch.distributed (pipeline, context and tensor
parallelism), and the KV events routers read across replicas.

``rank_layout`` places every rank on the data, pipeline, context and tensor axes;
``pipeline_*`` runs a model's layers as stages in worker processes (``PipelineExecutor``
is the engine's side); ``context_*`` shards each request's tokens and KV pages over the
ranks of a stage; ``tensor_*`` cuts each rank's share of every layer; ``kv_events*``
publish the prefix cache (a router's side of them is ``serving/router/``; its modules'
old paths here still import for one release, with a ``DeprecationWarning``).
``PipelineExecutor`` is imported lazily, so that reading this package's names does not
load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridkv.errors import moved

moved.install()

if TYPE_CHECKING:
    from hybridkv.parallel.pipeline_executor import PipelineExecutor

__all__ = ["PipelineExecutor"]


def __getattr__(name: str) -> Any:
    if name == "PipelineExecutor":
        from hybridkv.parallel.pipeline_executor import PipelineExecutor

        return PipelineExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
