"""The state mixers on the device: Mamba2's chunked prefill scan and recurrent decode,
against the CPU's results on the same inputs, with their speed.

Correctness runs a moderate shape on both devices (the CPU is the reference); speed runs
a real layer's shape (Mamba2 2.7B: 80 heads of 64, state 128, one group, SSD chunks of
256) on the device alone. A decode step reads and writes every request's float32 state:
its bytes over its time is the bandwidth it achieves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from benchmarks.gpu.device import Probe, time_rounds
from hybridkv.kernels.ssm import causal_conv1d_decode, causal_conv1d_states, ssd_decode, ssd_scan


@attrs.frozen
class MambaShape:
    heads: int
    head_dim: int
    state: int
    groups: int
    chunk: int
    conv: int = 4


REAL = MambaShape(heads=80, head_dim=64, state=128, groups=1, chunk=256)
SMALL = MambaShape(heads=8, head_dim=16, state=16, groups=2, chunk=32)


def _inputs(shape: MambaShape, length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, p, n, grp = shape.heads, shape.head_dim, shape.state, shape.groups
    return {
        "x": torch.randn(length, h, p, generator=g),
        "dt": F.softplus(torch.randn(length, h, generator=g) - 2),
        "a": -torch.exp(torch.randn(h, generator=g) * 0.5),
        "b": torch.randn(length, grp, n, generator=g),
        "c": torch.randn(length, grp, n, generator=g),
        "d": torch.randn(h, generator=g),
    }


def _mixer_calls(
    shape: MambaShape, length: int, batch: int, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable[[], Any]]:
    """A prefill of ``length`` tokens (conv, then scan), and a decode of ``batch``."""
    t = {k: v.to(device) for k, v in _inputs(shape, length, 0).items()}
    for k in ("x", "b", "c"):
        t[k] = t[k].to(dtype)
    width = shape.heads * shape.head_dim
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(width, shape.conv, generator=g).to(device, dtype)
    state = torch.randn(shape.heads, shape.head_dim, shape.state, generator=g).to(device)
    states = state.expand(batch, -1, -1, -1).contiguous()
    conv_state = torch.zeros(width, shape.conv - 1, device=device, dtype=dtype)
    conv_states = conv_state.expand(batch, -1, -1).contiguous()
    step = {k: (v[:batch] if v.dim() > 1 else v) for k, v in t.items()}
    flat = t["x"].reshape(length, width)
    return {
        "prefill": lambda: (
            causal_conv1d_states(flat, conv_state, weight, None, ()),
            ssd_scan(**t, ssm_state=state, chunk_size=shape.chunk),
        ),
        "decode": lambda: (
            causal_conv1d_decode(step["x"].reshape(batch, width), conv_states, weight, None),
            ssd_decode(**step, ssm_states=states),
        ),
    }


def _flatten(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _flatten(item)]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the largest value (0 for an empty output)."""
    if not want.numel():
        return 0.0
    scale = float(want.float().abs().max())
    return float((got.cpu().float() - want.float()).abs().max()) / max(scale, 1e-30)


def run(probe: Probe, dtype: torch.dtype, dry_run: bool) -> dict[str, Any]:
    """Device against CPU on the small shape, then the speed of the real one."""
    device = probe.device
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch.")}
    with torch.inference_mode():
        errors = {}
        for name in ("prefill", "decode"):
            got = _flatten(_mixer_calls(SMALL, 300, 16, device, dtype)[name]())
            want = _flatten(_mixer_calls(SMALL, 300, 16, torch.device("cpu"), dtype)[name]())
            errors[name] = round(max(map(_relative_error, got, want)), 6)
        out["relative_error_vs_cpu"] = errors
        shape = SMALL if dry_run else REAL
        length, batch = (512, 8) if dry_run else (8192, 64)
        timings = time_rounds(device, _mixer_calls(shape, length, batch, device, dtype), rounds=3)
    out["shape"] = {**attrs.asdict(shape), "prefill_tokens": length, "decode_batch": batch}
    out.update({f"{name}_ms": t.as_dict() for name, t in timings.items()})
    out["prefill_tokens_per_s"] = round(length / timings["prefill"].median)
    state_bytes = batch * shape.heads * shape.head_dim * shape.state * 4
    bandwidth = 2 * state_bytes / timings["decode"].median  # each state read and written
    out["decode_gbps"] = round(bandwidth / 1e9, 1)
    out["decode_of_copy_bw"] = round(bandwidth / probe.copy_bandwidth, 3)
    return out
