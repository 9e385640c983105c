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
    # an install): transformers probes for Hugging Face's `kernels` by importing whatever
    # find_spec("kernels") finds, and does not catch that import failing
    # (transformers.utils.import_utils._is_package_available), so raising here would crash it.
    # An empty module without __version__ reads to it as "not installed"; AttributeError (not
    # ImportError) keeps getattr/hasattr probes of sys.modules working.
    def __getattr__(name: str) -> object:
        raise AttributeError(
            f"module 'kernels' has no attribute {name!r}: this kernels/ folder is hybridkv's, "
            "import it as hybridkv.kernels"
        )
else:
    from hybridkv.kernels.attention import paged_attention
    from hybridkv.kernels.cache_ops import write_kv
    from hybridkv.kernels.errors import KernelInputError
    from hybridkv.kernels.metadata import PagedMetadata
    from hybridkv.kernels.workspace import GatherWorkspace

__all__ = ["GatherWorkspace", "KernelInputError", "PagedMetadata", "paged_attention", "write_kv"]
