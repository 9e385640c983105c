"""A mixture of experts' shape, read from config.json (torch-free;
``hybridkv.models.blocks.moe`` builds it).

The families differ in how a token picks its experts and in what an expert computes:

=====================  =========================================================
router ``softmax``     softmax of the router's logits; the top k (Qwen3-MoE,
                       Granite, gpt-oss), their weights renormalised or not
router ``sigmoid``     sigmoid of each logit; the top k, chosen by score plus a
                       learned per-expert bias where ``selection_bias`` (AFMoE),
                       weighted by their scores, renormalised or not (Llama 4:
                       not, and the weight multiplies the expert's input)
router                 ``sqrt(softplus(logit))``, chosen and weighted as ``sigmoid``
``sqrtsoftplus``       (DeepSeek V4); in its ``hashed_layers`` the experts are a
                       fixed table's row for the token id (``tid2eid``)
activation ``silu``    ``silu(gate) * up`` (SwiGLU)
activation ``clamped`` gpt-oss's: gate clamped above and up on both sides at
                       ``limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``
activation             ``gelu_tanh(gate) * up`` (GeGLU: Gemma 4)
``gelu_tanh``
activation ``relu2``   ``relu(up) ** 2``, no gate (Nemotron-H's experts)
activation             ``silu(gate) * up``, gate clamped above and up on both sides
``silu_clamped``       at ``limit`` (DeepSeek V4's ``swiglu_limit``)
=====================  =========================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from hybridkv.models.errors import ModelConfigError
from hybridkv.models.hf_config import flag_field, int_field

Router = Literal["softmax", "sigmoid", "sqrtsoftplus"]
ExpertActivation = Literal["silu", "clamped", "gelu_tanh", "relu2", "silu_clamped"]
Stacks = Literal["transposed_alternating", "transposed", "plain"]


@attrs.frozen(kw_only=True)
class ExpertsShape:
    """The experts of a model's MoE layers.

    Attributes:
        num_experts: Experts in each MoE layer.
        top_k: Experts each token is routed to.
        inner: Width of one expert's gated MLP.
        renormalize: The chosen experts' weights sum to 1 (else: their share of every
            expert's probability; Qwen3-MoE's ``norm_topk_prob`` false).
        dense_layers: The layers with a dense MLP instead.
        router: ``softmax`` or ``sigmoid`` (see the module).
        bias: The router and every expert's projections have biases (gpt-oss).
        activation: ``silu`` or ``clamped`` (see the module).
        alpha: ``clamped``: the sigmoid's slope.
        limit: ``clamped``: where gate and up are clamped.
        shared_inner: Width of a shared expert every token also runs (Llama 4, AFMoE),
            0 for none.
        weight_inputs: The routing weight multiplies each expert's input, not its output
            (Llama 4).
        selection_bias: A learned per-expert bias added to the scores that choose the
            experts, not to their weights (``expert_bias``: AFMoE).
        route_scale: The routing weights are multiplied by it (AFMoE, MiMo-V2-Flash).
        groups: The experts form this many groups, and a token chooses only among those
            of the ``top_groups`` groups whose two best biased scores sum highest
            (DeepSeek V3's ``n_group`` and ``topk_group``; 1: no groups).
        top_groups: See ``groups``.
        stacks: How a checkpoint that stacks every expert's gate and up in one tensor
            (``experts.gate_up_proj``) lays it out: ``[E, hidden, 2 * inner]`` with gate
            and up channels alternating (``transposed_alternating``: gpt-oss) or gate's
            first (``transposed``: Llama 4), or ``[E, 2 * inner, hidden]`` gate's first
            (``plain``: Granite SWA, Gemma 4); ``experts.down_proj`` is transposed alike.
        router_norm_eps: The router reads its input RMS-normalised with this epsilon (no
            weight), times its learned ``scale`` and ``hidden ** -0.5`` (Gemma 4); None:
            as it is.
        expert_scales: Each chosen expert's weight is multiplied by its learned
            ``per_expert_scale`` (Gemma 4).
        shared_gate: The shared expert's output is multiplied by the sigmoid of a learned
            projection of the input (``shared_expert_gate``: Qwen3-Next).
        latent: The experts read and write this width, projected from and back to the
            hidden size around them (``fc1_latent_proj``, ``fc2_latent_proj``:
            Nemotron-H's ``moe_latent_size``); 0: the hidden size itself.
        hashed_layers: The layers whose experts a token's id picks, from a table of
            ``vocab_size`` rows the checkpoint holds (``tid2eid``: DeepSeek V4's first
            layers), their scores weighting them; no selection bias there.
        vocab_size: The table's rows, where there are hashed layers.
    """

    num_experts: int
    top_k: int
    inner: int
    renormalize: bool = True
    dense_layers: frozenset[int] = frozenset()
    router: Router = "softmax"
    bias: bool = False
    activation: ExpertActivation = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    shared_inner: int = 0
    weight_inputs: bool = False
    selection_bias: bool = False
    route_scale: float = 1.0
    groups: int = 1
    top_groups: int = 1
    stacks: Stacks = "transposed_alternating"
    router_norm_eps: float | None = None
    expert_scales: bool = False
    shared_gate: bool = False
    latent: int = 0
    hashed_layers: frozenset[int] = frozenset()
    vocab_size: int = 0

    @property
    def gated(self) -> bool:
        """Each expert has a gate beside its up projection (all but ``relu2``)."""
        return self.activation != "relu2"

    def tensor_share(self, size: int) -> ExpertsShape:
        """The shape one of ``size`` tensor-parallel ranks holds: each expert's width
        (and the shared expert's) split."""
        return attrs.evolve(self, inner=self.inner // size, shared_inner=self.shared_inner // size)


def grouped_sigmoid_router(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ExpertsShape`` fields of DeepSeek V3's router, as a config names them
    (MiMo-V2-Flash, Nemotron 3): ``n_routed_experts`` chosen ``num_experts_per_tok`` at a
    time by sigmoid scores plus a learned bias, within the best ``topk_group`` of
    ``n_group`` groups, renormalised under ``norm_topk_prob`` and scaled by
    ``routed_scaling_factor``.

    Raises:
        ModelConfigError: experts that the groups do not divide.
    """
    experts, groups = int_field(hf, "n_routed_experts"), int_field(hf, "n_group", 1)
    if experts % groups:
        raise ModelConfigError(f"n_routed_experts={experts} is not a multiple of n_group={groups}")
    return {
        "num_experts": experts,
        "top_k": int_field(hf, "num_experts_per_tok"),
        "inner": int_field(hf, "moe_intermediate_size"),
        "router": "sigmoid",
        "selection_bias": True,
        "renormalize": flag_field(hf, "norm_topk_prob", True),
        "route_scale": float(hf.get("routed_scaling_factor") or 1.0),
        "groups": groups,
        "top_groups": int_field(hf, "topk_group", 1),
    }
