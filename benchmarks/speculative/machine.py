"""What else uses the machine while the speculative benchmark measures: CPU time of other
processes from ``/proc/stat``, and runs made again once the machine is quiet."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import attrs

T = TypeVar("T")


@attrs.frozen
class CpuSample:
    wall: float
    busy: float  # CPU seconds the machine has been busy
    own: float  # CPU seconds of this process and the processes it watches


def _process_cpu(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_sample(watched: Sequence[int] = ()) -> CpuSample:
    """The machine's busy CPU seconds, and this process's (with ``watched``'s)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    own = sum(os.times()[:2]) + sum(_process_cpu(pid) for pid in watched)
    return CpuSample(time.perf_counter(), busy, own)


def foreign_cores(begin: CpuSample, end: CpuSample) -> float:
    """Cores other processes kept busy, on average, between two samples."""
    other = (end.busy - begin.busy) - (end.own - begin.own)
    return max(0.0, other) / max(1e-9, end.wall - begin.wall)


def wait_quiet(args: argparse.Namespace, deadline: float) -> None:
    """Return once other processes use under ``--quiet-below`` cores over 5 s (or at
    ``deadline``, the end of the waiting allowed)."""
    while time.monotonic() < deadline:
        begin = cpu_sample()
        time.sleep(5)
        used = foreign_cores(begin, cpu_sample())
        if used < args.quiet_below:
            return
        print(f"  waiting: other processes use {used:.2f} cores", flush=True)


def measured(
    args: argparse.Namespace,
    label: str,
    deadline: float,
    redone: list[str],
    attempt: Callable[[], tuple[T, float]],
) -> T:
    """``attempt``'s result (it returns the most cores others used in any of its runs),
    made on a quiet machine: made again while others used too much and waiting is still
    allowed; ``label`` is added to ``redone`` for each attempt thrown away."""
    while True:
        wait_quiet(args, deadline)
        result, used = attempt()
        if used < args.quiet_below or time.monotonic() >= deadline:
            return result
        print(f"  {label}: other processes used {used:.2f} cores; again", flush=True)
        redone.append(label)
