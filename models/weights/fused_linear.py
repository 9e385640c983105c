"""Linear layers that read the same input, joined into one after loading.

An attention layer's q, k and v projections and a gated MLP's gate and up projections
each multiply the same activations. Joined by output rows, a decode step runs one
matrix product where it ran three (or two), and pays one call's overhead::

    q_proj [Nq, K]                       qkv_proj [Nq + 2 Nkv, K]
    k_proj [Nkv, K]   -- cat_linears ->  y = x @ W^T, then split by columns
    v_proj [Nkv, K]                      [Nq | Nkv | Nkv]

Parts are joined in the form they are stored in, after any quantisation, so each keeps
exactly the values it had (an int8 part its per-row scales, an int4 part its groups).
Parts stored differently (a quantised file's 4-bit q beside its 6-bit v, which int4
keeps at int8) are left apart. A checkpoint that stores them joined is read as the parts
(``split_joined``), so quantisation and tensor parallelism see the parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hybridkv.models.weights.quantized_linear import QuantizedLinear


def cat_linears(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One linear layer computing the outputs of ``parts`` side by side, or None when
    they cannot be joined (different classes, input widths or dtypes, or some with a
    bias and some without)."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts) or not issubclass(kind, _JOINABLE):
        return None
    # All parts are of one joinable class: the isinstance filters keep every part and
    # give each its type.
    joinable = [p for p in parts if isinstance(p, _JOINABLE)]
    if len({p.in_features for p in joinable}) != 1:
        return None
    biases = [p.bias for p in joinable]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
    if issubclass(kind, QuantizedLinear):
        return kind.cat_rows([p for p in parts if isinstance(p, QuantizedLinear)], bias)
    weights = [p.weight.detach() for p in parts if isinstance(p, nn.Linear)]
    if len({w.dtype for w in weights}) != 1:
        return None
    with torch.device("meta"):  # no random init of a weight about to be replaced
        joined = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=False)
    joined.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
    if bias is not None:
        joined.bias = nn.Parameter(bias, requires_grad=False)
    return joined


_JOINABLE = (nn.Linear, QuantizedLinear)


def split_joined(
    state_dict: dict[str, Any], prefix: str, joined: str, parts: Sequence[tuple[str, int]]
) -> None:
    """A checkpoint that stores joined parts (Phi-3's ``qkv_proj``, ``gate_up_proj``)
    read as the parts: ``prefix + joined`` (weight, and bias where stored) cut by output
    rows into each ``(name, rows)`` of ``parts``, in place in ``state_dict``."""
    for tensor_name in ("weight", "bias"):
        tensor = state_dict.pop(f"{prefix}{joined}.{tensor_name}", None)
        if tensor is None:
            continue
        pieces = torch.split(tensor, [rows for _, rows in parts])
        for (name, _), piece in zip(parts, pieces, strict=True):
            state_dict[f"{prefix}{name}.{tensor_name}"] = piece
