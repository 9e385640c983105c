"""benchmarks/hybrid/frontier_fit.py: the latent-attention models' parameters at their
published shapes, and the longest request their cache holds beside the weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_scripts import benchmark_module


@pytest.fixture(scope="module")
def frontier_fit() -> ModuleType:
    """The script, imported from the repository root."""
    return benchmark_module("benchmarks.hybrid.frontier_fit")


def test_parameters_and_the_context_beside_the_weights(
    frontier_fit: ModuleType, tmp_path: Path
) -> None:
    """DeepSeek V3 counts its published 671B parameters and Kimi K2 over a trillion; on
    one GPU of 80 GiB no FP8 release fits, on eight V3's latent cache holds tens of
    thousands of tokens beside its weights, and Kimi Linear reaches its whole context."""
    out = tmp_path / "fit.json"
    assert frontier_fit.main(["--json", str(out)]) == 0
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert round(rows["DeepSeek-V3"]["parameters"] / 1e9) == 671
    assert rows["Kimi K2"]["parameters"] > 1e12
    assert all(r["longest_tokens"]["1"] == 0 for r in rows.values())
    assert 10_000 < rows["DeepSeek-V3"]["longest_tokens"]["8"] < 163840
    linear = rows["Kimi-Linear-48B-A3B"]
    assert linear["longest_tokens"]["8"] == linear["context"] == 1048576
    # DeepSeek V4-Flash: its published 284B; its compressed cache holds a million tokens.
    v4 = rows["DeepSeek-V4-Flash"]
    assert round(v4["parameters"] / 1e9) == 284
    assert v4["longest_tokens"]["8"] == v4["context"] == 1048576
