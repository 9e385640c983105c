"""The model executor: runs the scheduler's steps through a model, samples, keeps the KV tensors.

``ModelExecutor`` (``model_executor``, loaded by ``loader`` with one ``LoadOptions``) is
the one implementation of the scheduler's
``Executor`` protocol over real models: it owns the KV tensors (``kv_caches``), checks each
batch (``batch_checks``), runs torch on one thread (``torch_thread``), samples
(``sampler``, ``draw``, ``penalties``, ``structured`` and ``grammars``), computes
log-probabilities (``logprobs``) and gives the KV connector its pages (``offload_pages``).
It is imported lazily, so that reading this package's names does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.executor.load_options import LoadOptions
    from hybridkv.executor.model_executor import ModelExecutor

__all__ = ["LoadOptions", "ModelExecutor"]


def __getattr__(name: str) -> Any:
    if name == "ModelExecutor":
        from hybridkv.executor.model_executor import ModelExecutor

        return ModelExecutor
    if name == "LoadOptions":
        from hybridkv.executor.load_options import LoadOptions

        return LoadOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
