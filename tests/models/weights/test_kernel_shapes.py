"""The weight-only linears over every input width: each shape matches a float reference
or is refused with a clear error, and none reaches a native kernel that cannot take it.

torch 2.13's int8 kernel crashes the process (or returns inf with one row) for K not a
multiple of 16 with AVX-512, and of 8 with AVX2, so every sweep runs in a child process,
once per CPU kernel set torch can be told to use (``ATEN_CPU_CAPABILITY``): a crash fails
the test and names the shape. A set the CPU lacks is skipped: torch does not fall back
from it, its kernels die of an illegal instruction (AVX-512 on an AVX2-only EPYC).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybridkv.models.weights.quantized_linear import DEQUANT_ROWS

# K mod 16 for every residue, around the sizes real shards reach (24: the test model's
# row-parallel cut; 360: gpt-oss's 2880 inputs over 8 ranks).
WIDTHS = sorted({16 * 4 + r for r in range(16)} | {8, 24, 40, 100, 360, 2880 // 8})
OUTPUTS = [16, 48, 64]
ROWS = [1, 5, DEQUANT_ROWS + 8]

CHILD = """
import json, sys
import torch
import torch.nn.functional as F
from hybridkv.models.weights.quantized_linear import Int4Linear, Int8Linear

def int4_cut(weight, bias):
    # A tensor-parallel share of rows the kernel cannot pack: kept in row order, expanded.
    whole = -(-weight.shape[0] // 32) * 32
    padding = (0, 0, 0, whole - weight.shape[0])
    cut = slice(0, weight.shape[0])
    return Int4Linear(F.pad(weight, padding), F.pad(bias, padding[2:])).take_rows(cut)

layer_class = {"int8": Int8Linear, "int4": Int4Linear, "int4-cut": int4_cut}[sys.argv[1]]
widths, outputs, rows = (json.loads(a) for a in sys.argv[2:5])
generator = torch.Generator().manual_seed(0)
for width in widths:
    for out_features in outputs:
        weight = torch.randn(out_features, width, generator=generator) * 0.3
        bias = torch.randn(out_features, generator=generator)
        for num_rows in rows:
            shape = {"K": width, "N": out_features, "rows": num_rows}
            print(json.dumps({"start": shape}), flush=True)  # names a shape that crashes
            try:
                layer = layer_class(weight, bias)
            except ValueError as error:
                print(json.dumps({"refused": shape, "error": str(error)}), flush=True)
                continue
            x = torch.randn(num_rows, width, generator=generator)
            got = layer(x)
            want = F.linear(x, layer.expand(0, out_features, torch.float32), bias)
            quantised = F.linear(x, weight, bias)
            print(json.dumps({
                "ran": shape,
                "finite": bool(got.isfinite().all()),
                "error": float((got - want).abs().max() / want.abs().max()),
                "quantisation": float((got - quantised).abs().max() / quantised.abs().max()),
            }), flush=True)
"""

# Relative to the largest output: the kernels take bfloat16 activations (8 bits of
# mantissa, summed over K), and the format's own rounding against the float weight.
TOLERANCE = {"int8": (0.02, 0.05), "int4": (0.02, 0.25), "int4-cut": (0.02, 0.25)}


def _sweep(layer: str, capability: str) -> list[dict[str, object]]:
    """Runs the sweep in a child process on one kernel set; its lines, or a failure
    naming the shape it died on."""
    args = [json.dumps(WIDTHS), json.dumps(OUTPUTS), json.dumps(ROWS)]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, layer, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
    )
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0:
        last = lines[-1]["start"] if lines and "start" in lines[-1] else None
        pytest.fail(
            f"{layer} on {capability} exited {child.returncode} at {last}:\n{child.stderr[-2000:]}"
        )
    return lines


#: The x86 kernel sets in order: a CPU that runs one runs those before it.
_SETS = ["default", "avx2", "avx512"]


@pytest.mark.parametrize("capability", _SETS)
@pytest.mark.parametrize("layer", ["int8", "int4", "int4-cut"])
def test_every_width_matches_or_is_refused(layer, capability):
    """Every (K, N, rows) either matches the float product of the stored weights (and
    of the original ones within the format's rounding) or is refused by name."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    if best in _SETS and _SETS.index(capability) > _SETS.index(best):
        pytest.skip(f"this CPU's best kernel set is {best}; {capability}'s would not run")
    lines = _sweep(layer, capability)
    ran = [line for line in lines if "ran" in line]
    refused = [line for line in lines if "refused" in line]
    assert len(ran) + len(refused) == len(WIDTHS) * len(OUTPUTS) * len(ROWS)
    kernel_tolerance, format_tolerance = TOLERANCE[layer]
    for line in ran:
        assert line["finite"], line
        assert line["error"] < kernel_tolerance, line
        assert line["quantisation"] < format_tolerance, line
    for line in refused:
        assert "multiples of 32" in str(line["error"]), line
    if layer == "int8":
        assert not refused  # every width runs, padded to the kernel's multiple
    elif layer == "int4":  # the kernel packs N and K in multiples of 32
        assert {(line["ran"]["K"], line["ran"]["N"]) for line in ran} == {
            (k, n) for k in WIDTHS for n in OUTPUTS if k % 32 == 0 and n % 32 == 0
        }
    else:  # any share of rows runs; K is cut on whole groups
        assert {line["ran"]["K"] for line in ran} == {k for k in WIDTHS if k % 32 == 0}
