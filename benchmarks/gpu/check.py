"""``make gpu-check``: does the GPU path work, and how fast is it, in one command.

    make gpu-check OUT=results/gpu            # on a machine with CUDA, within 8 minutes
    make gpu-check OUT=/tmp/dry DRY_RUN=1     # the same code on the CPU, at toy sizes

Sections, in order, each reported even when one before it failed:

- ``tests``: the tests marked ``cuda`` (paged and span attention against a reference in
  fp32, bf16 and fp16, every policy's mask, the paged KV writes, the Mamba2 kernels, the
  engine on tiny Llama, Gemma 3 and Bamba against its CPU tokens, pages round-tripped
  through pinned host memory), run by pytest on the device under check;
- ``attention``: paged attention against contiguous SDPA, FlexAttention's paged attention
  and flash_attn where installed (``benchmarks/gpu/attention.py``);
- ``state``: the state mixers against their CPU results, with their speed (``state.py``);
- ``engine``: throughput of a 0.5B-shaped random model, memory against the plan (``engine.py``);
- ``families``: every tiny architecture of the tests on the device against its CPU tokens.

It writes ``gpu-check.json`` (everything) and ``summary.txt`` (what it printed last) under
``--out``. Nothing is downloaded: the models are random checkpoints it writes. Exit status
0 when every test and every family passed, 1 otherwise, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import attention, engine, families, state
from benchmarks.gpu.device import Probe, grouped_mm_support, probe
from benchmarks.gpu.report import summary

#: The test files holding the tests marked ``cuda`` (tests/benchmarks/test_gpu_check.py
#: checks that no other file has one).
CUDA_TEST_FILES = (
    "tests/kernels/test_paged_attention.py",
    "tests/kernels/test_span_attention.py",
    "tests/kernels/test_write_kv.py",
    "tests/kernels/test_ssm.py",
    "tests/executor/test_engine_on_device.py",
)
ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and summary")
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU at toy sizes")
    parser.add_argument(
        "--attention-budget", type=float, default=150.0, help="seconds for the attention rows"
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA "
            "device; this check needs one (DRY_RUN=1 runs the same code on the CPU)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("TQDM_DISABLE", "1")  # save_pretrained's progress bars
    device = torch.device("cpu" if args.dry_run else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    measured = probe(device, (16 << 20) if args.dry_run else (1 << 30))
    result: dict[str, Any] = {
        "dry_run": args.dry_run,
        "device": measured.as_dict(),
        "grouped_mm": grouped_mm_support(device),
    }
    print(f"gpu-check on {measured.name}, torch {measured.torch_version}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        sections: dict[str, Callable[[], Any]] = {
            "tests": lambda: run_tests(device, args.out, args.dry_run),
            "attention": lambda: attention.run(
                measured, torch.bfloat16, args.dry_run, args.attention_budget
            ),
            "state": lambda: _state(measured, args.dry_run),
            "engine": lambda: engine.run(measured, Path(scratch) / "engine", args.dry_run),
            "families": lambda: families.run(device, Path(scratch) / "families"),
        }
        for name, section in sections.items():
            result[name] = _timed(section)
            print(f"  {name}: {result[name]['seconds']} s", flush=True)
    (args.out / "gpu-check.json").write_text(json.dumps(result, indent=1) + "\n")
    text = summary(result)
    (args.out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0 if passed(result) else 1


def _state(measured: Probe, dry_run: bool) -> dict[str, Any]:
    """The state mixers in float32 and in bf16."""
    dtypes = (torch.float32, torch.bfloat16)
    return {str(d).removeprefix("torch."): state.run(measured, d, dry_run) for d in dtypes}


def _timed(section: Callable[[], Any]) -> dict[str, Any]:
    """A section's result and its seconds; an exception is its result, not the end."""
    started = time.perf_counter()
    try:
        out = {"result": section()}
    except Exception as error:
        out = {"error": repr(error)[:1000]}
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def run_tests(device: torch.device, out: Path, dry_run: bool) -> dict[str, Any]:
    """The ``cuda`` tests by pytest in a child process, on ``device``: their counts and
    the failures' names (the JUnit XML and the log land in ``out``)."""
    xml, log = out / "cuda-tests.xml", out / "cuda-tests.log"
    # Only the plugins these tests use: a GPU machine's image has others, of its own versions.
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    command += ["-p", "xdist.plugin", "-p", "pytest_asyncio.plugin"]
    if not dry_run:
        # The card's machine has its own torch and transformers: their deprecation
        # warnings are not what this check is about (the suite's own runs keep them errors).
        command += ["-W", "ignore::DeprecationWarning", "-W", "ignore::FutureWarning"]
    command += [*CUDA_TEST_FILES, f"--junitxml={xml}"]
    env = {
        **os.environ,
        "HYBRIDKV_CHECK_DEVICE": device.type,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    with log.open("w") as sink:
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    counts: dict[str, Any] = {"exit_code": code, "failed_tests": []}
    if xml.exists():
        suite = ET.parse(xml).getroot().find("testsuite")
        assert suite is not None
        for key in ("tests", "failures", "errors", "skipped"):
            counts[key] = int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                counts["failed_tests"].append(f"{case.get('classname')}::{case.get('name')}")
    return counts


def passed(result: dict[str, Any]) -> bool:
    """Every cuda test ran and passed, and every family gave its CPU tokens."""
    tests = result["tests"].get("result", {})
    ok_tests = tests.get("exit_code") == 0 and tests.get("tests", 0) > tests.get("skipped", 0)
    fams = result["families"].get("result", {})
    return ok_tests and bool(fams) and all(f["passed"] for f in fams.values())


if __name__ == "__main__":
    sys.exit(main())
