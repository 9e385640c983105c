"""``make gpu-check``: its dry run (the same code on the CPU at toy sizes) passes, so the
script cannot rot between the rare runs on a GPU; without CUDA it refuses in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmark_scripts import ROOT, benchmark_module


def cuda_test_files() -> tuple[str, ...]:
    """benchmarks/gpu/check.py's list, imported as ``python -m`` does from the root."""
    files: tuple[str, ...] = benchmark_module("benchmarks.gpu.check").CUDA_TEST_FILES
    return files


@pytest.mark.slow
def test_the_dry_run_runs_every_section_and_passes(tmp_path: Path) -> None:
    """Every section ran without an error; every cuda test and family passed on the CPU."""
    done = subprocess.run(
        ["make", "-s", "gpu-check", "DRY_RUN=1", f"OUT={tmp_path}", f"PY={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    for section in ("tests", "attention", "state", "engine", "families"):
        assert "error" not in result[section], result[section]
    tests = result["tests"]["result"]
    assert tests["tests"] >= 40 and tests["failures"] == tests["errors"] == tests["skipped"] == 0
    rows = result["attention"]["result"]["rows"]
    assert {row["mode"] for row in rows} == {"decode", "prefill"}
    assert all("error" not in row and row["max_abs_diff"] < 0.05 for row in rows)
    assert any("flex_paged_ms" in row and row["flex_max_abs_diff"] < 0.05 for row in rows)
    for dtype in ("float32", "bfloat16"):
        assert result["state"]["result"][dtype]["relative_error_vs_cpu"] == {
            "prefill": 0.0,
            "decode": 0.0,
        }
    engine = result["engine"]["result"]
    assert engine["output_tokens"] == engine["requests"] * engine["max_tokens"]
    assert all(f["passed"] for f in result["families"]["result"].values())
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"cuda tests: \d+ passed, 0 failed, 0 skipped", summary)
    assert summary.strip().splitlines()[-1] in done.stdout


def test_every_test_marked_cuda_is_in_a_file_the_check_runs() -> None:
    """The check runs named files (the GPU machine lacks the server's packages that the
    rest of the suite imports): a cuda test elsewhere would never run on a GPU."""
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"mark\.cuda\b|pytestmark = pytest\.mark\.cuda", path.read_text())
    }
    assert marked == set(cuda_test_files())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_check_refuses_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.check", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "finds no CUDA device" in done.stderr and "DRY_RUN=1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
