"""Paged KV writes and paged attention on torch SDPA.

This package imports nothing else of hybridkv but ``hybridkv.errors``: torch and attrs.

    workspace = GatherWorkspace()                        # once per executor
    meta = PagedMetadata.build(query_lens, context_lens, block_tables, block_size, device,
                               workspace=workspace)      # once per step per KV group
    write_kv(kv_cache, key, value, meta)                 # every layer of the group
    out = paged_attention(query, kv_cache, meta, scale=head_dim**-0.5)
"""

from __future__ import annotations

if __name__ == "kernels":
    # Imported by its bare folder name (the repository root on sys.path, e.g. a checkout without
    # an install). Hugging Face's `kernels` package has the same name, and transformers needs
    # it (a requirement since 5.25; before, transformers probed for it by importing whatever
    # find_spec("kernels") found, without catching a failure). So this module becomes the
    # installed `kernels` where there is one, found on sys.path past the checkout, and an
    # empty module otherwise, which a probe reads as "not installed"; AttributeError (not
    # ImportError) keeps getattr/hasattr probes of sys.modules working.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _installed  # what `import kernels` returns
        _spec.loader.exec_module(_installed)
    else:

        def __getattr__(name: str) -> object:
            raise AttributeError(
                f"module 'kernels' has no attribute {name!r}: this kernels/ folder is "
                "hybridkv's, import it as hybridkv.kernels"
            )
else:
    from hybridkv.kernels.attention import paged_attention
    from hybridkv.kernels.cache_ops import write_kv
    from hybridkv.kernels.errors import KernelInputError
    from hybridkv.kernels.metadata import PagedMetadata
    from hybridkv.kernels.workspace import GatherWorkspace

__all__ = ["GatherWorkspace", "KernelInputError", "PagedMetadata", "paged_attention", "write_kv"]
