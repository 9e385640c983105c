"""The top-k mixture of experts (Granite 4.0-H's beside its shared MLP, Qwen3-MoE's,
gpt-oss's), of the shape ``models/shapes/moe.py`` reads.

Weight names follow Granite 4.0-H checkpoints: ``block_sparse_moe.input_linear`` holds
each expert's gate and up stacked (``[experts, 2 * inner, hidden]``), ``output_linear``
``[experts, hidden, inner]``, and ``router.layer`` the routing logits. The other
checkpoints' layouts load into the same stacks: one MLP per expert (Qwen3-MoE:
``experts.{e}.gate_proj``, ``up_proj``, ``down_proj``, the router as ``gate``), and
transposed stacks (``experts.gate_up_proj`` ``[experts, hidden, 2 * inner]``, gate and up
channels alternating in gpt-oss's and gate's first in Llama 4's; ``experts.down_proj``;
gpt-oss's ``_bias`` of each; the router as ``router``, with gpt-oss's bias, or
``router.gate``). A shared expert every token runs (Llama 4's ``shared_expert``, AFMoE's
``shared_experts``) is added to the routed experts' output. Nemotron-H's experts have no
gate (``experts.up_proj`` ``[experts, inner, latent]``, ``down_proj``), read and write a
latent width projected from and back to the hidden size (``fc1_latent_proj``,
``fc2_latent_proj``), beside a shared expert without a gate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.blocks.mlp import ACTIVATIONS, GatedMLP, PlainMLP
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.shapes.moe import ExpertsShape, Stacks
from hybridkv.models.weights.cuts import TensorCut, gated_share, param

#: The router's names in Qwen3-MoE's, gpt-oss's, AFMoE's, MiMo-V2-Flash's and Ling's
#: checkpoints -> ours.
_ROUTER_NAMES = {
    "gate.weight": "router.layer.weight",
    "router.weight": "router.layer.weight",
    "router.bias": "router.layer.bias",
    "router.gate.weight": "router.layer.weight",
    "gate.e_score_correction_bias": "expert_bias",
    "gate.expert_bias": "expert_bias",
    "gate.tid2eid": "tid2eid",
    "router.proj.weight": "router.layer.weight",
}


class _ExpertWeights(nn.Module):
    """One stacked parameter named ``weight`` ``[experts, out, in]``, as the checkpoint
    stores it, and a ``bias`` ``[experts, out]`` where the experts have one."""

    def __init__(self, experts: int, out: int, inputs: int, *, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out, inputs))
        self.bias = nn.Parameter(torch.empty(experts, out)) if bias else None


class RouterLinear(nn.Linear):
    """The router's projection: kept in the model's dtype by ``--weights int8/int4``
    (which replace plain ``nn.Linear`` only), as vLLM keeps its gates: it is a few
    thousandths of a layer's weights, and a rounding that flips a token's experts
    changes its output far more than the rounding of any expert does."""


class _Router(nn.Module):
    """The routing projection, as ``router.layer``; Gemma 4's scale of its normalised
    input (``scale``) and of each expert's weight (``per_expert_scale``) where it has them."""

    def __init__(self, hidden: int, shape: ExpertsShape) -> None:
        super().__init__()
        experts = shape.num_experts
        self.layer = RouterLinear(hidden, experts, bias=shape.bias)
        self.scale = nn.Parameter(torch.empty(hidden)) if shape.router_norm_eps else None
        self.per_expert_scale = nn.Parameter(torch.empty(experts)) if shape.expert_scales else None
        self.eps = shape.router_norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 routing logits ``[T, experts]``."""
        if self.scale is not None:
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
            x = normed * self.scale * x.shape[-1] ** -0.5
        logits: torch.Tensor = self.layer(x).float()
        return logits


class MixtureOfExperts(nn.Module):
    """Each token goes to its ``top_k`` experts, weighted as the shape's router says
    (``models/shapes/moe.py``), plus the shared expert where there is one.

    The (token, expert) pairs are sorted by expert, and one grouped matmul
    (``F.grouped_mm``) runs each expert over its run of them, the runs' ends found on the
    device: nothing is read back, where a loop over the experts chosen would read them
    back in every layer (a device sync per layer per step). On a CPU the grouped matmul
    loops over the experts itself, at least as fast as that loop; on a GPU its bfloat16
    kernel reads the ends on the device (torch's fallback for other dtypes reads them
    back). Its rows must be 16-byte aligned: hidden and inner sizes multiples of 8, as
    every released Granite MoE's are.
    """

    def __init__(
        self,
        hidden: int,
        shape: ExpertsShape,
        shared: GatedMLP | PlainMLP | None = None,
        *,
        hashed: bool = False,
    ) -> None:
        super().__init__()
        inner, width = shape.inner, shape.latent or hidden
        if width % 8 or inner % 8:
            raise ModelConfigError(
                f"experts of width {width} and inner size {inner}: both must be "
                "multiples of 8 (the grouped matmul's rows are 16-byte aligned)"
            )
        experts, bias = shape.num_experts, shape.bias
        self.router = _Router(hidden, shape)
        rows = 2 * inner if shape.gated else inner
        self.input_linear = _ExpertWeights(experts, rows, width, bias=bias)
        self.output_linear = _ExpertWeights(experts, width, inner, bias=bias)
        self.fc1_latent_proj = nn.Linear(hidden, width, bias=False) if shape.latent else None
        self.fc2_latent_proj = nn.Linear(width, hidden, bias=False) if shape.latent else None
        self.shared_expert = shared
        self.shared_expert_gate = RouterLinear(hidden, 1, bias=False) if shape.shared_gate else None
        self._sum: Callable[[torch.Tensor], None] | None = None
        biased = shape.selection_bias and not hashed
        self.expert_bias = nn.Parameter(torch.empty(experts)) if biased else None
        # DeepSeek V4's hashed layers: each token's experts, a row of a table by its id.
        table = torch.empty(shape.vocab_size, shape.top_k).long() if hashed else None
        self.tid2eid: torch.Tensor | None
        self.register_buffer("tid2eid", table)
        self.shape = shape

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Take one MLP per expert (``experts.{e}.gate_proj`` ...), or another layout of
        stacks (``shape.stacks``), as ours; the routers' and shared experts' names."""
        _stacks(state_dict, prefix, self.shape.stacks)
        names: dict[str, list[torch.Tensor]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
        for e in range(self.input_linear.weight.shape[0]):
            for part, tensors in names.items():
                key = f"{prefix}experts.{e}.{part}.weight"
                if key in state_dict:
                    tensors.append(state_dict.pop(key))
        if names["up_proj"]:  # gate and up stacked, or up alone (no gate)
            parts = zip(names["gate_proj"], names["up_proj"], strict=True)
            gate_up = [torch.cat(p) for p in parts] if names["gate_proj"] else names["up_proj"]
            state_dict[f"{prefix}input_linear.weight"] = torch.stack(gate_up)
            state_dict[f"{prefix}output_linear.weight"] = torch.stack(names["down_proj"])
        for old, new in _ROUTER_NAMES.items():
            if f"{prefix}{old}" in state_dict:
                state_dict[f"{prefix}{new}"] = state_dict.pop(f"{prefix}{old}")
        shared = f"{prefix}shared_experts."  # AFMoE's name of the shared expert
        for key in [k for k in state_dict if k.startswith(shared)]:
            state_dict[f"{prefix}shared_expert.{key[len(shared) :]}"] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def shard(self, cut: TensorCut) -> None:
        """Keep every expert's run of the width (gate and up rows with their biases, down
        columns) and the shared expert's; the output is then summed over the group
        (the router runs whole on every rank, so each routes a token alike; the down
        biases are added by the first rank only)."""
        stacked, out = self.input_linear.weight.detach(), self.output_linear.weight.detach()
        width = out.shape[2] // cut.size
        held = torch.arange(cut.rank * width, (cut.rank + 1) * width)
        rows = torch.cat((held, held + width * cut.size)) if self.shape.gated else held
        self.input_linear.weight = param(stacked[:, rows])
        self.output_linear.weight = param(out[:, :, held])
        if self.input_linear.bias is not None:
            self.input_linear.bias = param(self.input_linear.bias.detach()[:, rows])
        if self.output_linear.bias is not None and cut.rank:
            self.output_linear.bias = param(torch.zeros_like(self.output_linear.bias))
        shared = self.shared_expert
        if isinstance(shared, PlainMLP):
            shared.shard(cut, summed=False)
        elif shared is not None:  # its share of the width, summed with the experts'
            parts = gated_share(
                cut, shared.gate_proj, shared.up_proj, shared.down_proj, summed=False
            )
            for name, part in zip(("gate_proj", "up_proj", "down_proj"), parts, strict=True):
                shared.set_submodule(name, part)
        self._sum = cut.all_reduce
        self.shape = self.shape.tensor_share(cut.size)

    def _route(
        self, x: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts ``[T, k]`` and their weights, in ``x``'s dtype
        (in a hashed layer, the experts of ``token_ids``' rows of ``tid2eid``)."""
        logits = self.router(x)
        shape = self.shape
        if shape.router != "softmax":
            scores = _SCORES[shape.router](logits)
            chosen = scores if self.expert_bias is None else scores + self.expert_bias.float()
            if shape.groups > 1:
                chosen = _in_top_groups(chosen, shape.groups, shape.top_groups)
            if self.tid2eid is not None:
                assert token_ids is not None, "a hashed layer routes by the token ids"
                experts = self.tid2eid[token_ids]
            else:
                experts = chosen.topk(shape.top_k, dim=-1).indices
            weights = scores.gather(1, experts)
            if shape.renormalize:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        elif shape.renormalize:  # the softmax of the top k: their probabilities summing to 1
            top_logits, experts = logits.topk(shape.top_k, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        else:  # their probabilities among all the experts
            weights, experts = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)
        if shape.route_scale != 1.0:
            weights = weights * shape.route_scale
        if self.router.per_expert_scale is not None:
            weights = weights * self.router.per_expert_scale[experts]
        return experts, weights.to(x.dtype)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' activation, of the MLPs' table (``ACTIVATIONS``) but gpt-oss's."""
        activation = self.shape.activation
        if not self.shape.gated:
            return ACTIVATIONS[activation](gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if activation not in ("clamped", "silu_clamped"):
            return ACTIVATIONS[activation](gate) * up
        limit = self.shape.limit
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        if activation == "silu_clamped":
            return F.silu(gate) * up
        return (up + 1) * gate * torch.sigmoid(gate * self.shape.alpha)

    def forward(
        self,
        x: torch.Tensor,
        route_input: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts' output for ``x``, routed by ``route_input`` where given (Gemma 4's
        router reads the layer's input before the experts' norm), else by ``x`` (and in a
        hashed layer, by ``token_ids``)."""
        experts, weights = self._route(x if route_input is None else route_input, token_ids)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # pairs by expert, each expert's tokens in order
        tokens, by_expert = order // self.shape.top_k, flat[order]
        every = torch.arange(self.input_linear.weight.shape[0], device=x.device)
        ends = torch.searchsorted(by_expert, every, right=True).to(torch.int32)
        latent = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        rows = latent[tokens]
        if self.shape.weight_inputs:
            rows = rows * weights.flatten()[order, None]
        gate_up = _grouped_mm(rows, self.input_linear.weight.transpose(1, 2), ends)
        if self.input_linear.bias is not None:
            gate_up = gate_up + self.input_linear.bias[by_expert]
        y = _grouped_mm(self._activate(gate_up), self.output_linear.weight.transpose(1, 2), ends)
        if self.output_linear.bias is not None:
            y = y + self.output_linear.bias[by_expert]
        if not self.shape.weight_inputs:
            y = y * weights.flatten()[order, None]
        base = torch.zeros_like(x) if self.shared_expert is None else self.shared_expert(x)
        if self.shared_expert_gate is not None:
            base = base * torch.sigmoid(self.shared_expert_gate(x))
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(torch.zeros_like(latent).index_add_(0, tokens, y))
            out: torch.Tensor = base + y
        else:
            out = base.index_add_(0, tokens, y)
        if self._sum is not None:  # a tensor-parallel rank's share
            self._sum(out)
        return out


def _sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(logits))


#: The score of each expert a router's logits give, by router kind (``softmax`` apart).
_SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": _sqrt_softplus,
}


def _in_top_groups(scores: torch.Tensor, groups: int, top_groups: int) -> torch.Tensor:
    """``scores`` ``[T, experts]`` with every expert outside each token's ``top_groups``
    groups (ranked by the sum of their two best scores) set to -inf."""
    grouped = scores.view(scores.shape[0], groups, -1)
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(top_groups, dim=-1).indices
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)


def _stacks(state_dict: dict[str, Any], prefix: str, layout: Stacks) -> None:
    """``experts.gate_up_proj`` and ``experts.down_proj``, with any biases, laid out as
    ``layout`` says (``models/shapes/moe.py``), as ``input_linear`` (gate rows, then up
    rows) and ``output_linear``."""
    stacks = {  # ``up_proj``: experts without a gate
        "gate_up_proj": "input_linear",
        "up_proj": "input_linear",
        "down_proj": "output_linear",
    }
    for theirs, ours in stacks.items():
        for suffix, name in (("", "weight"), ("_bias", "bias")):
            key = f"{prefix}experts.{theirs}{suffix}"
            if key not in state_dict:
                continue
            tensor = state_dict.pop(key)
            if theirs == "gate_up_proj" and layout == "transposed_alternating":
                tensor = torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)
            if name == "weight" and layout != "plain":
                tensor = tensor.transpose(1, 2).contiguous()
            state_dict[f"{prefix}{ours}.{name}"] = tensor


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``[ends[e-1], ends[e])`` of ``a`` times ``b[e]``: ``F.grouped_mm``, or on a
    torch without it, one matmul per expert (which reads the ends back: a sync on a GPU)."""
    grouped = getattr(F, "grouped_mm", None)
    if grouped is not None:
        out: torch.Tensor = grouped(a, b, offs=ends)
        return out
    starts = [0, *ends.tolist()]
    return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(itertools.pairwise(starts))])
