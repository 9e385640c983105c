"""What the check runs on, its memory-bandwidth ceiling, and a timer that waits for the
device only where a timing needs it.

On CUDA a timing is a pair of CUDA events around ``n`` calls, read after one synchronize;
on the CPU (the dry run) it is ``perf_counter`` around the same calls. Rounds of the
compared variants interleave, and the median round is reported with the spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

#: Published HBM bandwidth of the cards the check expects, bytes per second.
NOMINAL_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12}


@attrs.frozen
class Probe:
    """The device under check and the copy bandwidth measured on it."""

    device: torch.device
    name: str
    torch_version: str
    cuda_version: str | None
    total_memory: int | None
    copy_bandwidth: float  # bytes read plus bytes written per second, device to device

    @property
    def nominal_bandwidth(self) -> float | None:
        """The card's published HBM bandwidth, where the card is one we know."""
        return next((v for k, v in NOMINAL_BANDWIDTH.items() if k in self.name), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            **attrs.asdict(self, filter=lambda a, _: a.name != "device"),
            "device": str(self.device),
            "nominal_bandwidth": self.nominal_bandwidth,
        }


def probe(device: torch.device, copy_bytes: int) -> Probe:
    """Name the device and measure a ``copy_bytes`` device-to-device copy."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total = props.name, int(props.total_memory)
    else:
        name, total = "cpu", None
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = time_rounds(device, {"copy": lambda: dst.copy_(src)}, rounds=5)["copy"].median
    return Probe(
        device=device,
        name=name,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        total_memory=total,
        copy_bandwidth=2 * copy_bytes / seconds,
    )


def synchronize(device: torch.device) -> None:
    """Wait for the device (a timing's end); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@attrs.frozen
class Timing:
    """Seconds per call: the median round, and the fastest and slowest rounds."""

    median: float
    low: float
    high: float

    def as_dict(self, scale: float = 1e3) -> dict[str, float]:
        """Milliseconds (by default), rounded to what the spread can tell."""
        return {k: round(v * scale, 4) for k, v in attrs.asdict(self).items()}


def time_rounds(
    device: torch.device,
    calls: dict[str, Callable[[], object]],
    *,
    rounds: int = 5,
    round_seconds: float = 0.02,
) -> dict[str, Timing]:
    """Time each call, its rounds interleaved with the others' (a round is as many calls
    as fill about ``round_seconds``, counted from a warm-up call)."""
    counts = {}
    for name, call in calls.items():
        call()  # warm-up: first-use allocations, autotuning, compiles
        started = time.perf_counter()
        call()
        synchronize(device)
        counts[name] = max(
            1, min(200, int(round_seconds / max(time.perf_counter() - started, 1e-6)))
        )
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(_one_round(device, call, counts[name]))
    return {name: _summary(values) for name, values in samples.items()}


def _one_round(device: torch.device, call: Callable[[], object], count: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            call()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / count
    started = time.perf_counter()
    for _ in range(count):
        call()
    return (time.perf_counter() - started) / count


def _summary(values: Sequence[float]) -> Timing:
    return Timing(median=statistics.median(values), low=min(values), high=max(values))


def grouped_mm_support(device: torch.device) -> dict[str, str]:
    """Whether ``F.grouped_mm`` (one matmul over experts' jagged token runs) runs on the
    device in each dtype, and how far it lands from a loop of plain matmuls."""
    out = {}
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.randn(40, 64, generator=g).to(device, dtype)
        b = torch.randn(4, 64, 32, generator=g).to(device, dtype)
        ends = torch.tensor([8, 8, 30, 40], dtype=torch.int32, device=device)
        try:
            got = torch.nn.functional.grouped_mm(a, b, offs=ends)
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            out[str(dtype).removeprefix("torch.")] = f"refused: {str(error)[:160]}"
            continue
        runs = zip([0, 8, 8, 30], [8, 8, 30, 40], strict=True)
        want = torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(runs)])
        diff = float((got.float() - want.float()).abs().max())
        out[str(dtype).removeprefix("torch.")] = f"ok (max abs diff {diff:.2g})"
    return out
