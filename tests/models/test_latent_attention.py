"""Multi-head latent attention (DeepSeek V3, Kimi K2, V3.2's sparse attention) beyond the
shared scenarios of ``test_model_logits.py``: Kimi K2's model type, queries without a
low-rank projection and rope on the halves, the weight formats, the latent pages through
the offload path, and the indexer's keys beside the latent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.executor.offload_pages import KVPages
from hybridkv.models.blocks.latent_attention import LatentAttention


def test_kimi_k2_reads_as_deepseek_v3(
    tiny_models: Any, tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """Kimi K2's checkpoints are DeepSeek V3's layers under ``model_type`` kimi_k2."""
    folder = tmp_path / "kimi_k2"
    shutil.copytree(tiny_models["deepseek_v3"].path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    executor = ModelExecutor.from_pretrained(folder, LoadOptions(kv_cache_bytes=1 << 20))
    assert executor.config.model_type == "kimi_k2"
    driver = drive(executor)
    driver.add("a", prompt_of(30, 3))
    driver.run(3)
    check_reference(tiny_models["deepseek_v3"], driver, "a")


def test_multi_token_prediction_layers_after_the_decoder_are_left_unread(
    tiny_models: Any, tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """DeepSeek V3's checkpoints store their MTP layer after the decoder's
    (``model.layers.61.*`` of V3's 61): such tensors load as nothing, and the model
    serves its logits."""
    from safetensors.torch import save_file

    folder = tmp_path / "with_mtp"
    shutil.copytree(tiny_models["deepseek_v3"].path, folder)
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
             "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(96, 32)}  # fmt: skip
    save_file(extra, str(folder / "mtp.safetensors"))
    executor = ModelExecutor.from_pretrained(folder, LoadOptions(kv_cache_bytes=1 << 20))
    driver = drive(executor)
    driver.add("a", prompt_of(20, 2))
    driver.run(3)
    check_reference(tiny_models["deepseek_v3"], driver, "a")


def test_full_rank_queries_and_half_split_rope_match(
    tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """``q_lora_rank`` null (one ``q_proj``: DeepSeek V2 Lite, Kimi Linear), rope on the
    two halves (``rope_interleave`` false), plain rope, no experts in the first layer
    only: a prompt, chunks and decodes give transformers' logits."""
    from model_fixtures import TinyModel
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from hybridkv.testing.tiny_families import COMMON, NO_SPECIAL_TOKENS
    from hybridkv.testing.tiny_models import save_redrawn

    config = DeepseekV3Config(
        **COMMON, num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=24,
        moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=2,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        rope_interleave=False, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = save_redrawn(DeepseekV3ForCausalLM(config), tmp_path / "full_rank", seed=5)
    reference = TinyModel.load("deepseek_v3", folder)
    executor = ModelExecutor.from_pretrained(
        folder, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    driver = drive(executor)
    driver.add("a", prompt_of(27, 8))
    driver.add("b", prompt_of(9, 9))
    driver.run(4, chunk=6)
    check_reference(reference, driver, "a")
    check_reference(reference, driver, "b")


def test_int8_weights_leave_the_latent_up_projection_in_the_models_dtype(
    tiny_models: Any, drive: Any, prompt_of: Any
) -> None:
    """``kv_b_proj`` is read as two matrices per head, never run as a linear layer: int8
    weights quantise the other projections and leave it, and the model still serves."""
    options = LoadOptions(kv_cache_bytes=1 << 20, weights="int8")
    executor = ModelExecutor.from_pretrained(tiny_models["deepseek_v3"].path, options)
    layers = [m for m in executor.model.modules() if isinstance(m, LatentAttention)]
    assert len(layers) == 3
    for layer in layers:
        assert layer.kv_b_proj.weight.dtype == torch.float32
        assert type(layer.o_proj).__name__ == "Int8Linear"
    driver = drive(executor)
    driver.add("a", prompt_of(20, 1))
    driver.run(3)
    assert len(driver.active["a"].output) == 3


def test_latent_pages_go_to_the_host_and_back_once(tiny_models: Any) -> None:
    """A latent page is moved as the one vector a token it keeps (not twice, as key and
    value), and written back into the keys' bytes."""
    executor = ModelExecutor.from_pretrained(
        tiny_models["deepseek_v3"].path, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    pages = executor.kv_pages()
    assert isinstance(pages, KVPages)
    (group,) = pages.groups
    cache = executor.kv_caches[0]
    keys = cache[:, 0]
    keys.copy_(torch.arange(keys.numel(), dtype=cache.dtype).view(keys.shape))
    blocks = pages.read_pages(group, [3, 5])
    assert blocks[0].shape == (3, 1, 1, 4, 40)
    before = cache[3].clone()
    pages.write_pages(group, [7], blocks[:1])
    torch.testing.assert_close(cache[7], before)


def test_the_indexer_keeps_its_keys_beside_the_latent_and_picks_what_each_query_reads(
    tiny_models: Any, tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """DeepSeek V3.2: each layer's index keys are a second memory (16 values a token) in
    slots of their own; with a top k of 8 the logits are transformers' (test_model_logits)
    and not dense attention's, and with a top k at least the context they are dense
    attention's, transformers' at that top k."""
    from model_fixtures import TinyModel

    from hybridkv.memory.layout import AttentionSpec

    executor = ModelExecutor.from_pretrained(
        tiny_models["deepseek_v32"].path, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    spec = executor.config.layers[1]
    assert isinstance(spec, AttentionSpec) and isinstance(spec.beside, AttentionSpec)
    assert (spec.beside.name, spec.beside.head_dim) == ("model.layers.1.self_attn.indexer", 16)
    slots = {executor.plan.slot_of(s)[1] for s in (spec, spec.beside)}
    assert len(slots) == 2  # 40 and 16 values a token: pages of their own in the group
    executor.close()
    folder = tmp_path / "dense"
    shutil.copytree(tiny_models["deepseek_v32"].path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "index_topk": 64}))
    dense = TinyModel.load("deepseek_v32", folder)
    driver = drive(ModelExecutor.from_pretrained(folder, LoadOptions(kv_cache_bytes=1 << 20)))
    prompt = prompt_of(40, 4)
    driver.add("a", prompt)
    driver.run(4)
    check_reference(dense, driver, "a")
    sparse = tiny_models["deepseek_v32"].reference_logits(prompt)[-1]
    assert float((driver.logits["a"][0] - sparse).abs().max()) > 0.1
