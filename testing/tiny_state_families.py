"""Tiny random-weight models of the families with state layers beyond Mamba2's (Gated
DeltaNet, short convolutions, Mamba1, lightning attention; layers that keep nothing), and
of models of state layers alone, as transformers builds them:
``hybridkv.testing.tiny_models`` saves them beside those of ``tiny_families.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridkv.testing.tiny_families import COMMON, NO_SPECIAL_TOKENS, WINDOW


def _qwen3_next() -> Any:
    """Qwen3-Next: three Gated DeltaNet layers (4 value heads of 16 over 2 key heads of 8,
    a conv of 4) to one gated full attention layer with rope on a quarter of each head;
    experts (4, two a token) beside a gated shared expert, a dense first layer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**qwen3_next_fields(), num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=32,
                             mlp_only_layers=[0])  # fmt: skip
    return Qwen3NextForCausalLM(config)


def _qwen3_5() -> Any:
    """Qwen3.5 (text): Qwen3-Next's mixers with Qwen3.5's projections, a dense MLP."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**qwen3_next_fields()))


def _qwen3_5_moe() -> Any:
    """Qwen3.5-MoE (text): Qwen3.5's mixers, experts (4, two a token) in every layer beside
    a gated shared expert."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    fields = {k: v for k, v in qwen3_next_fields().items() if k != "intermediate_size"}
    experts: dict[str, Any] = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    config = Qwen3_5MoeTextConfig(**fields, **experts, shared_expert_intermediate_size=32)
    return Qwen3_5MoeForCausalLM(config)


def _olmo_hybrid() -> Any:
    """OLMo Hybrid: three DeltaNet layers (pre-norm, write rates up to 2) to a post-norm
    full attention layer without rope."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    fields = {k: v for k, v in qwen3_next_fields().items() if k != "head_dim"}
    return OlmoHybridForCausalLM(OlmoHybridConfig(**fields))


def qwen3_next_fields() -> dict[str, Any]:
    return {
        **COMMON,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        **NO_SPECIAL_TOKENS,
    }


def _lfm2() -> Any:
    """LFM2: short convolutions (3 taps) with full attention in layers 1 and 3, q/k norms,
    the MLP's width derived (2/3 of 144, up to a multiple of 32)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        **{**COMMON, "intermediate_size": 144}, num_hidden_layers=4, num_key_value_heads=2,
        full_attn_idxs=[1, 3], conv_L_cache=3, block_multiple_of=32,
        block_ffn_dim_multiplier=1.0, norm_eps=1e-5, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return Lfm2ForCausalLM(config)


def _lfm2_moe() -> Any:
    """LFM2-MoE: LFM2's mixers, a dense first layer, then experts (4, two a token) chosen
    by sigmoid scores plus a learned bias, scaled."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    config = Lfm2MoeConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention"] * 2,
        conv_L_cache=3, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, routed_scaling_factor=1.5, norm_eps=1e-5,
        **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    model = Lfm2MoeForCausalLM(config)
    import torch

    with torch.no_grad():  # the selection bias is a buffer the redraw leaves at zero
        for layer in model.model.layers[1:]:
            layer.feed_forward.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    return model


def _lfm3() -> Any:
    """LFM3: short convolutions (3 taps), a sliding window of 8 and full attention (its rope
    proportional over half of each head), a gate per head, sandwich norms."""
    from transformers import Lfm3Config, Lfm3ForCausalLM

    config = Lfm3Config(
        **COMMON, num_hidden_layers=5, num_key_value_heads=2, head_dim=16,
        layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
        sliding_window=WINDOW, conv_L_cache=3, norm_eps=1e-5, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return Lfm3ForCausalLM(config)


def _jamba() -> Any:
    """Jamba: Mamba1 layers (8 states, a conv of 4, time steps of rank 4) with attention at
    layer 1 of every 2, experts (4, two a token) in every second layer."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=2, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=4, use_mamba_kernels=False, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return JambaForCausalLM(config)


def _mamba_fields() -> dict[str, Any]:
    return {
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "state_size": 8,
        "conv_kernel": 4, "expand": 2, "layer_norm_epsilon": 1e-5, **NO_SPECIAL_TOKENS,
    }  # fmt: skip


def _mamba() -> Any:
    """Mamba: three Mamba1 blocks (8 states, a conv of 4), no attention, no MLP."""
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(**_mamba_fields(), time_step_rank=4))


def _falcon_mamba() -> Any:
    """Falcon-Mamba: Mamba's blocks, the time step, B and C normalised without weights."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    config = FalconMambaConfig(**_mamba_fields(), time_step_rank=4, mixer_rms_eps=1e-6)
    return FalconMambaForCausalLM(config)


def _mamba2() -> Any:
    """Mamba2: three Mamba2 blocks (8 heads of 16, two B/C groups, SSD chunks of 8)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(**_mamba_fields(), num_heads=8, head_dim=16, n_groups=2, chunk_size=8)
    return Mamba2ForCausalLM(config)


def _nemotron_h() -> Any:
    """Nemotron-H: Mamba2 (8 heads of 16, two B/C groups, SSD chunks of 8), attention
    without rope, a squared-ReLU MLP layer and a layer of experts (Nemotron 3's: 8 in 2
    groups, two a token from the best group, over a latent width of 32, beside a shared
    expert), which keep nothing, ``M-*EM``."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        **COMMON, num_key_value_heads=2, head_dim=16,
        layers_block_type=["linear_attention", "mlp", "full_attention", "moe", "linear_attention"],
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=8,
        conv_kernel=4, use_mamba_kernels=False, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        moe_latent_size=32, routed_scaling_factor=2.5, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return NemotronHForCausalLM(config)


def _minimax() -> Any:
    """MiniMax: lightning attention (4 heads of 16) and full attention alternating,
    experts (4, two a token) in every layer, residual alpha factors of 1.5 to 2."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    config = MiniMaxConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, full_attn_alpha_factor=1.5,
        linear_attn_alpha_factor=2.0, mlp_alpha_factor=1.7, linear_attn_beta_factor=0.8,
        **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return MiniMaxForCausalLM(config)


def _falcon_h1(**fields: Any) -> Any:
    """Falcon-H1: three layers of full attention and Mamba2 (8 heads of 16, two B/C groups,
    SSD chunks of 8) side by side, its norm before the gate; every muP multiplier set."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    multipliers: dict[str, Any] = {
        "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "key_multiplier": 1.2,
        "attention_in_multiplier": 0.9, "attention_out_multiplier": 1.1,
        "ssm_in_multiplier": 1.3, "ssm_out_multiplier": 0.6, "mlp_multipliers": [0.7, 1.3],
        "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 0.9],
    }  # fmt: skip
    shape: dict[str, Any] = {
        "num_hidden_layers": 3, "num_key_value_heads": 2, "mamba_d_ssm": 128,
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8,
        "mamba_d_conv": 4, "mamba_chunk_size": 8, "mamba_rms_norm": True,
        "mamba_norm_before_gate": True,
    }  # fmt: skip
    config = FalconH1Config(**{**COMMON, **shape, **multipliers, **NO_SPECIAL_TOKENS, **fields})
    return FalconH1ForCausalLM(config)


def _zamba2() -> Any:
    """Zamba2: six layers, Mamba2 (8 heads of 16, two B/C groups, SSD chunks of 8) and three
    hybrid layers running two shared blocks in turn (rope, adapters of rank 8 per use);
    tied embeddings, which tie the blocks too: the checkpoint holds each at its first use."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    m, h = "mamba", "hybrid"
    config = Zamba2Config(**{
        **COMMON, "num_hidden_layers": 6, "layers_block_type": [m, h, m, h, m, h],
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 2,
        "n_mamba_heads": 8, "chunk_size": 8, "num_mem_blocks": 2,
        "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": True,
        "rms_norm_eps": 1e-5, **NO_SPECIAL_TOKENS,
    })  # fmt: skip
    return Zamba2ForCausalLM(config)


#: Each family's builder, by the name the tests know it by.
STATE_BUILDERS: dict[str, Callable[[], Any]] = {
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "olmo_hybrid": _olmo_hybrid,
    "jamba": _jamba,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
    "lfm3": _lfm3,
    "mamba": _mamba,
    "falcon_mamba": _falcon_mamba,
    "mamba2": _mamba2,
    "nemotron_h": _nemotron_h,
    "minimax": _minimax,
    "falcon_h1": _falcon_h1,
    "falcon_h1_gate_only": lambda: _falcon_h1(mamba_rms_norm=False, projectors_bias=True),
    "zamba2": _zamba2,
}
