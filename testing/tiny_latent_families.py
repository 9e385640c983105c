"""Tiny random-weight models of the families with latent attention (DeepSeek V3) and
Kimi Delta Attention (Kimi Linear), as transformers builds them; listed after every other
family in ``hybridkv.testing.tiny_models`` (each model's seed is its place in that list)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridkv.models.shapes.compressed import CSA, HCA
from hybridkv.testing.tiny_families import COMMON, NO_SPECIAL_TOKENS, YARN

#: DeepSeek V3's tiny shape (V3.2's too).
_DEEPSEEK: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,  # transformers' eager path repeats its expanded heads by this
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 1.5,
    "first_k_dense_replace": 1,
    "rope_parameters": {**YARN, "rope_theta": 10_000.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    **COMMON,
}


#: Kimi Linear's and Ling's tiny shape: 4 layers, latent attention of one ``q_proj`` (latent
#: 16 beside 8), experts (4 in 2 groups, two a token) beside a shared one.
_LATENT_HYBRID: dict[str, Any] = {
    **COMMON,
    "num_hidden_layers": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 1.5,
}


def _deepseek_v3() -> Any:
    """DeepSeek V3: multi-head latent attention (latent 32 beside a rope key of 8, low-rank
    queries, interleaved rope, YaRN with ``mscale_all_dim``), a dense first layer, experts
    (4 in 2 groups, the best group's two a token) beside a shared one."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**_DEEPSEEK, **NO_SPECIAL_TOKENS)
    return DeepseekV3ForCausalLM(config)


def _kimi_linear() -> Any:
    """Kimi Linear: Kimi Delta Attention layers (4 heads of 16, decays per key channel)
    and latent attention without rope (latent 16 beside 8, one ``q_proj``), alternating; a
    dense first layer, then experts (4 in 2 groups, two a token) beside a shared one."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    linear, full = "linear_attention", "full_attention"
    config = KimiLinearConfig(
        **_LATENT_HYBRID,
        linear_head_dim=16,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        layer_types=[linear, full, linear, full],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        **NO_SPECIAL_TOKENS,
    )
    return KimiLinearForCausalLM(config)


def _bailing_hybrid() -> Any:
    """Ling 3.0: Kimi Delta Attention layers (4 heads of 16, decays per key channel,
    bounded) and latent attention with rope and a gate per head, alternating; a dense
    first layer, then experts (4 in 2 groups, two a token) beside a shared one."""
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    config = BailingHybridConfig(
        **_LATENT_HYBRID,
        head_dim=16,
        layer_group_size=2,
        first_k_dense_replace=1,
        **NO_SPECIAL_TOKENS,
    )
    return BailingHybridForCausalLM(config)


def _deepseek_v32() -> Any:
    """DeepSeek V3.2: DeepSeek V3's tiny layers with a lightning indexer (16 heads of 16,
    the best 8 keys a query: prompts of tens of tokens attend sparsely; enough heads that
    no two keys tie at a zero score)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config = DeepseekV32Config(
        **_DEEPSEEK, index_topk=8, index_head_dim=16, index_n_heads=16, **NO_SPECIAL_TOKENS
    )
    return DeepseekV32ForCausalLM(config)


def _deepseek_v4() -> Any:
    """DeepSeek V4: a window of 8 in every layer; beside it entries of 4 tokens (CSA, an
    indexer of 16 heads keeping the best 4 a query) or of 32 (HCA, two blocks of 16 an
    entry), YaRN on the compressed layers' rope; two residual streams; experts (4, two a
    token) chosen by a random table of the token id in the first layer, clamped at 2."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(
        **{**COMMON, "intermediate_size": 16},
        num_hidden_layers=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=24,
        partial_rotary_factor=0.25,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=8,
        layer_types=["sliding_attention", CSA, HCA, CSA],
        compress_rates={CSA: 4, HCA: 32},
        index_n_heads=16,
        index_head_dim=16,
        index_topk=4,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        hc_mult=2,
        hc_sinkhorn_iters=3,
        swiglu_limit=2.0,
        rope_parameters=dict(YARN),
        **NO_SPECIAL_TOKENS,
    )
    model = DeepseekV4ForCausalLM(config)
    table = model.model.layers[0].mlp.gate.tid2eid
    table.copy_(torch.randint(0, 4, table.shape, generator=torch.Generator().manual_seed(4)))
    return model


#: Each architecture's builder of a fresh (untrained) transformers model.
LATENT_BUILDERS: dict[str, Callable[[], Any]] = {
    "deepseek_v3": _deepseek_v3,
    "kimi_linear": _kimi_linear,
    "bailing_hybrid": _bailing_hybrid,
    "deepseek_v32": _deepseek_v32,
    "deepseek_v4": _deepseek_v4,
}
