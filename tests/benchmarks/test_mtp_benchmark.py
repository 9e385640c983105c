"""benchmarks/speculative/mtp.py, small and without vLLM: MTP's tokens are plain
decoding's, and the chat hits as many tokens with MTP as without."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import benchmark_module


def test_mtp_changes_no_token_and_no_hit(tmp_path: Path) -> None:
    mtp = benchmark_module("benchmarks.speculative.mtp")
    out = tmp_path / "mtp.json"
    mtp.main(["--no-reference", "--layers", "2", "--hidden", "64", "--rounds", "1", "--k", "2",
              "--requests", "2", "--batch", "2", "--prompt-len", "20", "--max-tokens", "12",
              "--threads", "1", "--sessions", "4", "--json", str(out)])  # fmt: skip
    results = json.loads(out.read_text())
    for cell in results["speed"]["cells"].values():
        assert all(row["identical"] for row in cell.values())
        assert cell["mtp k=2"]["accept"] > 0.5 and cell["mtp k=2"]["tok_per_step"] > 1
    hits = results["hits"]
    assert hits["hybridkv mtp"]["hits"] == hits["hybridkv off"]["hits"]
    assert hits["hybridkv off"]["hit_rate"] == hits["settings"]["goal_hit_rate"]
    assert "vllm off" not in hits and "skipped" in hits["vllm_status"]
