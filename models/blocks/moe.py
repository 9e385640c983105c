"""The top-k mixture of experts (Granite 4.0-H's beside its shared MLP, Qwen3-MoE's).

Weight names follow Granite 4.0-H checkpoints: ``block_sparse_moe.input_linear`` holds
each expert's gate and up stacked (``[experts, 2 * inner, hidden]``), ``output_linear``
``[experts, hidden, inner]``, and ``router.layer`` the routing logits. Checkpoints that
store one MLP per expert (Qwen3-MoE: ``experts.{e}.gate_proj``, ``up_proj``,
``down_proj``, the router as ``gate``) load into the same stacks.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.errors import ModelConfigError


class _ExpertWeights(nn.Module):
    """One stacked parameter named ``weight``, as the checkpoint stores it."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class _Router(nn.Module):
    """The routing projection, as ``router.layer``."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class MixtureOfExperts(nn.Module):
    """Each token goes to its ``top_k`` experts, weighted by the softmax of their logits.

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
        self, hidden: int, inner: int, num_experts: int, top_k: int, *, renormalize: bool = True
    ) -> None:
        super().__init__()
        if hidden % 8 or inner % 8:
            raise ModelConfigError(
                f"experts of hidden size {hidden} and inner size {inner}: both must be "
                "multiples of 8 (the grouped matmul's rows are 16-byte aligned)"
            )
        self.router = _Router(hidden, num_experts)
        self.input_linear = _ExpertWeights(num_experts, 2 * inner, hidden)
        self.output_linear = _ExpertWeights(num_experts, hidden, inner)
        self.top_k = top_k
        self.renormalize = renormalize

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Take one MLP per expert (``experts.{e}.gate_proj`` ...) as the stacks."""
        names: dict[str, list[torch.Tensor]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
        for e in range(self.input_linear.weight.shape[0]):
            for part, tensors in names.items():
                key = f"{prefix}experts.{e}.{part}.weight"
                if key in state_dict:
                    tensors.append(state_dict.pop(key))
        if names["gate_proj"]:
            gate_up = [torch.cat(p) for p in zip(names["gate_proj"], names["up_proj"], strict=True)]
            state_dict[f"{prefix}input_linear.weight"] = torch.stack(gate_up)
            state_dict[f"{prefix}output_linear.weight"] = torch.stack(names["down_proj"])
        if f"{prefix}gate.weight" in state_dict:
            state_dict[f"{prefix}router.layer.weight"] = state_dict.pop(f"{prefix}gate.weight")
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.router.layer(x).float()
        if self.renormalize:  # the softmax of the top k: their probabilities summing to 1
            top_logits, experts = logits.topk(self.top_k, dim=-1)  # [T, k]
            weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        else:  # their probabilities among all the experts
            top, experts = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
            weights = top.to(x.dtype)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # pairs by expert, each expert's tokens in order
        tokens = order // self.top_k
        every = torch.arange(self.input_linear.weight.shape[0], device=x.device)
        ends = torch.searchsorted(flat[order], every, right=True).to(torch.int32)
        up_in = self.input_linear.weight.transpose(1, 2)
        gate, up = _grouped_mm(x[tokens], up_in, ends).chunk(2, dim=-1)
        y = _grouped_mm(F.silu(gate) * up, self.output_linear.weight.transpose(1, 2), ends)
        return torch.zeros_like(x).index_add_(0, tokens, y * weights.flatten()[order, None])


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``[ends[e-1], ends[e])`` of ``a`` times ``b[e]``: ``F.grouped_mm``, or on a
    torch without it, one matmul per expert (which reads the ends back: a sync on a GPU)."""
    grouped = getattr(F, "grouped_mm", None)
    if grouped is not None:
        out: torch.Tensor = grouped(a, b, offs=ends)
        return out
    starts = [0, *ends.tolist()]
    return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(itertools.pairwise(starts))])
