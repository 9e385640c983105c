"""The test suite beside a busy loop on every core: does it pass, and how long does it take.

Starts one process per core that spins (``while True: pass``), runs the command (by
default the README's test command, ``make test``: lint, types, docs, the whole suite) in
the repository, stops the spinners, and prints the command's exit status and wall time.
With ``--baseline`` it first runs the same command with the cores idle, for the ratio.

    python -m benchmarks.robustness.suite_under_load [--baseline] [--spinners N] [-- COMMAND ...]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def spin() -> None:
    while True:
        pass


def timed(command: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, check=False)
    return done.returncode, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spinners", type=int, default=os.cpu_count() or 1)
    p.add_argument("--baseline", action="store_true", help="also run it on idle cores first")
    p.add_argument("command", nargs="*", default=["make", "test"])
    args = p.parse_args()
    out: dict[str, object] = {"command": " ".join(args.command), "spinners": args.spinners}
    if args.baseline:
        out["idle_rc"], out["idle_s"] = timed(args.command)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.spinners)]
    for s in spinners:
        s.start()
    try:
        out["loaded_rc"], out["loaded_s"] = timed(args.command)
    finally:
        for s in spinners:
            s.kill()
            s.join()
    for key in ("idle_s", "loaded_s"):
        if key in out:
            print(f"{key.split('_')[0]}: {out[key]:.0f} s (exit {out[key.replace('_s', '_rc')]})")
    print(json.dumps(out))
    sys.exit(int(out["loaded_rc"] != 0 or out.get("idle_rc", 0) != 0))


if __name__ == "__main__":
    main()
