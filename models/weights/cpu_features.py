"""What this CPU can do natively, read once from ``/proc/cpuinfo``.

The weight-only linears choose their many-rows path by it (``quantized_linear.py``), the
weight format ``auto`` its default (``weights.py``), and the llama.cpp peer its build
(``benchmarks/peers/llama_peers.py``).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


def cpu_flags() -> set[str]:
    """The instruction-set flags the kernel lists for the first CPU (empty if unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def has_native_bfloat16() -> bool:
    """Whether matrix products in bfloat16 run on bfloat16 dot-product instructions
    (AVX-512 BF16 or AMX on x86): there they are faster than float32 ones, while without
    them (AVX2) oneDNN converts and they are slower (docs/benchmarks.md, "Decode on the
    CPU")."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
