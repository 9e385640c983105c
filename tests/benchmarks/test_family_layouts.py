"""benchmarks/hybrid/family_layouts.py without vLLM: every published shape planned, none
holding more than a uniform layout, Gemma 4 31B's packed pages without padding."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_scripts import benchmark_module


@pytest.fixture(scope="module")
def layouts() -> ModuleType:
    """The script, imported from the repository root."""
    return benchmark_module("benchmarks.hybrid.family_layouts")


def test_rows_of_every_shape_at_both_lengths(
    layouts: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    assert layouts.main(["--no-reference", "--budget", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    expected = [(s, t) for t in layouts.TOKENS for s in layouts.SHAPES]
    assert [(r["shape"], r["tokens"]) for r in rows] == expected
    for row in rows:
        # Beyond its padding (DeepSeek V3.2's part-filled last slots), never more.
        held = row["hybridkv_bytes"] * (1 - row["hybridkv_padding"])
        assert 0 < held <= row["uniform_bytes"] * 1.0001, row
        assert "vllm_bytes" not in row
    gemma = [r for r in rows if r["shape"] == "gemma-4-31b-like"]
    assert all(r["hybridkv_padding"] == 0 for r in gemma)
    assert "vLLM not run: skipped" in capsys.readouterr().out
