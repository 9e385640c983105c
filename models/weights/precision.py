"""Weight precision: which format the linear layers and the LM head are stored in.

A decode step reads every weight of the model once per step (the LM head's tied
embedding, 640 x 262,144 for Gemma 3 270M, is most of them), so on a CPU its time is
bounded below by weight bytes / memory bandwidth. Fewer bytes per weight lower that floor::

    format   linear layers and LM head                     activations, KV cache
    dtype    in the model dtype (--dtype), exact path      the model dtype
    int8     int8, one scale per output row                the model dtype
    int4     4 bits, a (scale, zero) per row and 32 inputs the model dtype
             (int8 for a tensor a quantised GGUF shipped at 5-8 bits)

Norms, softmax, rotary tables, the embedding lookup, sampling and any Mamba state keep
the model dtype or float32 as before; only ``nn.Linear`` modules are replaced (a weight
whose shape the int4 kernel cannot pack stays as it is). ``--dtype bfloat16`` with
``--weights dtype`` is the bfloat16 mode.

``auto`` is the machine's default: the fastest format whose quality stays within the
bound ``benchmarks/decode/weight_quality.py`` checks (mean KL against float32 <= 0.05), as
measured by ``benchmarks/decode/bandwidth.py`` (see :func:`machine_default`).
"""

from __future__ import annotations

import platform

import torch
from torch import nn

from hybridkv.errors import HybridKVError
from hybridkv.models.weights.cpu_features import cpu_flags
from hybridkv.models.weights.formats import WEIGHT_CHOICES
from hybridkv.models.weights.grid import grid_steps, on_grid
from hybridkv.models.weights.quantized_linear import (
    INT4_GROUP,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    fits_int4,
    linear_weight_bytes,
)
from hybridkv.models.weights.rescored_head import RescoredHead


class WeightFormatError(HybridKVError, ValueError):
    """An unknown weight format, or one this model or device cannot take."""


def check_weight_format(weights: str) -> str:
    """``weights`` if it names a format (or ``auto``); raises otherwise."""
    if weights not in WEIGHT_CHOICES:
        raise WeightFormatError(
            f"weight format {weights!r} is unknown; known: {', '.join(WEIGHT_CHOICES)}"
        )
    return weights


def machine_default() -> str:
    """The weight format ``auto`` means on this machine.

    int8 where torch's weight-only int8 CPU kernel has a vectorised path (x86 with AVX2,
    or ARM): measured fastest at 1 and 8 concurrent requests with mean KL well within the
    bound (docs/benchmarks.md, "Decode on the CPU"); the model dtype elsewhere.
    """
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "int8"
    if machine in ("x86_64", "amd64") and "avx2" in cpu_flags():
        return "int8"
    return "dtype"


def quantize_linears(model: nn.Module, weights: str, *, device: torch.device) -> int:
    """Replace ``model``'s ``nn.Linear`` modules by ``weights``-format ones, in place.

    Args:
        model: The model (a :class:`~hybridkv.models.transformer.CausalLM`).
        weights: One of ``WEIGHT_FORMATS`` (``hybridkv.models.weights.formats``; ``dtype``
            changes nothing).
        device: Where the model lives; the weight-only kernels run on the CPU.

    Returns:
        The number of layers replaced.

    Raises:
        WeightFormatError: an unknown format, or int8/int4 on a device other than the CPU.
    """
    if check_weight_format(weights) == "dtype":
        return 0
    if weights == "auto":
        raise WeightFormatError("resolve 'auto' with machine_default() before loading")
    if device.type != "cpu":
        raise WeightFormatError(f"--weights {weights} runs on the CPU only, not {device}")
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        weight, bias = module.weight, module.bias
        if weights == "int4" and not fits_int4(*weight.shape):
            continue
        new = Int8Linear(weight, bias) if weights == "int8" else _four_bits(weight, bias)
        model.set_submodule(name, new)
        replaced += 1
    return replaced


def _four_bits(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantizedLinear:
    """int4 for one weight, never below the bits a quantised file shipped it with.

    On a 4-bit grid per 32 inputs (a GGUF Q4_K tensor): packed on that grid, losslessly.
    On a finer grid per 16 (Q5_0, Q6_K, Q8_0): int8, as llama.cpp's Q4_K_M keeps those
    tensors above 4 bits (requantising them, the built-in model's mean KL against
    float32 was 0.24, ``benchmarks/decode/weight_quality.py``). A float weight: min-max int4.
    """
    if on_grid(weight, INT4_GROUP, 16):
        found = grid_steps(weight, INT4_GROUP)
        if found is not None and found[1] <= 16:
            return Int4Linear(weight, bias, steps=found[0])
    if on_grid(weight, 16, 256):
        return Int8Linear(weight, bias)
    return Int4Linear(weight, bias)


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer and the LM head once
    (as its kernel reads it: a rescored head its 4-bit pass), plus the norms and any
    other parameter outside the embedding (whose lookup reads a row per token; when the
    LM head is tied to it, the head counts it once)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    skip = {id(p) for p in embed.parameters()} if isinstance(embed, nn.Module) else set()

    def walk(module: nn.Module) -> int:
        if isinstance(module, (nn.Linear, QuantizedLinear, RescoredHead)):
            return linear_weight_bytes(module)
        own = [p for p in module.parameters(recurse=False) if id(p) not in skip]
        return sum(p.numel() * p.element_size() for p in own) + sum(
            walk(child) for child in module.children()
        )

    # A float head tied to a parameter elsewhere counts once, as the head.
    skip.update(id(m.weight) for m in model.modules() if isinstance(m, nn.Linear))
    return walk(model)
