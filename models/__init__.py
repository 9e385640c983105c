"""Hugging Face-format models (Llama, Gemma 2, Gemma 3 text) on paged KV caches.

``ModelExecutor`` (in ``hybridkv.models.executor``) loads a checkpoint folder, lays out the
KV tensors from the planner and runs the engine's steps; ``PipelineExecutor``
(``hybridkv.models.pipeline_executor``) splits the layers into stages over processes.
They are imported lazily so that ``import hybridkv.models.specs`` (used by ``hybridkv
plan``) does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.models.executor import ModelExecutor
    from hybridkv.models.pipeline_executor import PipelineExecutor

__all__ = ["ModelExecutor", "PipelineExecutor"]


def __getattr__(name: str) -> Any:
    if name == "ModelExecutor":
        from hybridkv.models.executor import ModelExecutor

        return ModelExecutor
    if name == "PipelineExecutor":
        from hybridkv.models.pipeline_executor import PipelineExecutor

        return PipelineExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
