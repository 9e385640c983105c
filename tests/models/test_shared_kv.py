"""Layers that read another layer's KV cache (Gemma 4's last ``num_kv_shared_layers``):
they own no pages, read their owner's, and offloading copies each page once."""

from __future__ import annotations

from typing import Any

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.layout import AttentionSpec


def test_shared_layers_read_their_owners_pages(tiny_models: Any) -> None:
    """Tiny Gemma 4 (s s f s | s f, the last two shared): layer 4 reads layer 3's pages
    and layer 5 layer 2's, through the same views and groups; the plan holds four layers,
    and the transfer worker's page access sees each page once."""
    executor = ModelExecutor.from_pretrained(
        tiny_models["gemma4"].path, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    try:
        specs = executor.specs
        assert [getattr(s, "reads", None) for s in specs][4:] == [
            "model.layers.3.self_attn",
            "model.layers.2.self_attn",
        ]
        assert sorted(executor.plan.layer_slots) == [
            f"model.layers.{i}.self_attn" for i in range(4)
        ]
        caches = executor.kv_caches
        for reader, owner in ((4, 3), (5, 2)):
            assert caches[reader].data_ptr() == caches[owner].data_ptr()
            assert caches[reader].shape == caches[owner].shape
            assert executor.plan.slot_of(specs[reader]) == executor.plan.slot_of(specs[owner])
        full = specs[2]
        assert isinstance(full, AttentionSpec) and (full.num_kv_heads, full.head_dim) == (2, 32)
        pages = executor.kv_pages()
        layers = sum(len(group) for group in pages._layers.values())
        assert layers == 4
    finally:
        executor.close()
