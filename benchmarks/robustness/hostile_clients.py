"""Hostile clients: a fresh request and /health beside each, on a live server.

One hostile client at a time against a server on 127.0.0.1: the engine on the fake
executor with the OpenAI-compatible app, as the serving tests run it, in a child process
of its own (one server per case). A probe in this process measures, each on a new
connection with one request, the latency of a fresh small completion (``max_tokens`` 4)
and of ``GET /health``: first with no hostile client (the unloaded baseline, on the same
server), then while the hostile client, in another child process, is active:

    2  structured output slow to compile: 4 connections each sending in turn
       ``guided_choice`` with 100,000 words and with 1,999 (both refused by the bound),
       and with 1,000 (the largest list the bounds accept; llguidance's parser takes at
       most 1,999: a choice list is one row of its items), new words each time so that
       no cache helps; this server samples with the real sampler on a byte-level
       vocabulary (the tests' ``SamplingFakeExecutor``), so the choice is checked,
       compiled and enforced, and an answer outside the choices is counted
    3  ``--max-connections`` (1,000, the default) idle sockets that never send a byte,
       each one the server closes (to make room for a newcomer, or at the first-byte
       timeout) reopened at once
    5  ``n=128`` (``max_num_seqs`` 32), one request after the other, beside 8
       connections flooding requests at ``priority`` -100, which the default FCFS
       policy refuses
    7  ``echo`` + ``logprobs: 20`` + ``prompt_logprobs: 20`` on an 8,000-token prompt
       (the prompt shifted each time, so no prefix is cached), one after the other

Each hostile client stops by itself after ``--seconds`` or a bounded number of requests.
The goal of each case: every fresh completion is a 200 within 2 s of the unloaded
median, every /health a 200 within 1 s. Printed per case: the probes' median and max,
unloaded and loaded, the difference of the medians and whether the goal holds; the
status codes the hostile client got (5xx: none expected) and the 5xx the server counted
(``/metrics``); whether the server process lives after the case and exits cleanly when
told to; and leaks once the hostile client is gone: the engine's running and waiting
requests and the KV pages held (``/metrics``; 0 expected), and the server's open file
descriptors (no more than before the baseline; Linux) and threads (shown, not judged:
idle worker threads end on their own).

The defaults (15 probes of each kind per phase, 12 s per hostile client) are sized for
a run of under 3 minutes on 2 shared cores.

    python -m benchmarks.robustness.hostile_clients [--cases 2,3,5,7] [--probes 15] [--seconds 12]
                                         [--front-end] [--json FILE]

With ``--front-end`` the target is ``serve -dp``'s front end (the same app, limits and
connection cap) over two such servers, each in a process of its own: the honest
clients' outcomes through it are to match a single server's under the same attack.

Results: docs/benchmarks.md, section "Hostile clients: a fresh request and /health
beside each".
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common.results import add_json_argument, write_json
from benchmarks.robustness.attackers import hostile, http_status
from benchmarks.robustness.report import FRESH_GOAL_S, HEALTH_GOAL_S, log_events, print_case
from benchmarks.robustness.server import HOST, MODEL, serve, serve_front_end

PROBE_TIMEOUT_S = 30.0
FRESH = {"model": MODEL, "prompt": "w2 w3", "max_tokens": 4, "ignore_eos": True}
CASES = {
    "2": "guided_choice of 100,000, 1,000 and 1,999 new words in turn, 4 connections",
    "3": "1,000 idle sockets (--max-connections), each one closed reopened",
    "5": "n=128 (max_num_seqs 32) beside a flood at priority -100 on 8 connections",
    "7": "echo + logprobs 20 + prompt_logprobs 20 on an 8,000-token prompt",
}


# -- the probe and the driver --------------------------------------------------------------


def http_once(port: int, request: bytes) -> tuple[str, float, bytes]:
    """One request on a new connection (closed after it): status, seconds, body."""
    start = time.perf_counter()
    data = b""
    try:
        with socket.create_connection((HOST, port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.settimeout(PROBE_TIMEOUT_S)
            sock.sendall(request)
            while chunk := sock.recv(65536):
                data += chunk
    except OSError as exc:
        return type(exc).__name__, time.perf_counter() - start, b""
    status = http_status(data) or "no response"
    return status, time.perf_counter() - start, data.partition(b"\r\n\r\n")[2]


def request_bytes(method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
    content = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(content)}\r\n"
    return (head + "\r\n").encode() + content


COMPLETION = request_bytes("POST", "/v1/completions", FRESH)
HEALTH = request_bytes("GET", "/health")
METRICS = request_bytes("GET", "/metrics")


def probe(port: int, count: int, start: float, interval: float) -> dict[str, list[Any]]:
    """``count`` fresh completions and /health requests, the i-th pair at ``start`` +
    i * ``interval`` (or at once, when late)."""
    out: dict[str, list[Any]] = {"fresh": [], "health": []}
    for i in range(count):
        time.sleep(max(0.0, start + i * interval - time.monotonic()))
        for name, request in (("fresh", COMPLETION), ("health", HEALTH)):
            status, seconds, _ = http_once(port, request)
            out[name].append((status, seconds))
    return out


def metrics(port: int) -> dict[str, float]:
    """The engine's gauges and the server's 5xx count, from ``/metrics`` (a front end's
    holds every replica's, labelled: they are summed, and its unrouted requests count
    as 5xx)."""
    status, _, body = http_once(port, METRICS)
    if status != "200":
        raise RuntimeError(f"/metrics answered {status}")
    out = {"running": 0.0, "waiting": 0.0, "pages held": 0.0, "5xx counted": 0.0}
    for line in body.decode().splitlines():
        name, _, value = line.rpartition(" ")
        family = name.partition("{")[0]
        if family == "hybridkv_requests_running":
            out["running"] += float(value)
        elif family == "hybridkv_requests_waiting":
            out["waiting"] += float(value)
        elif family == "hybridkv_kv_blocks_used":
            out["pages held"] += float(value)
        elif (
            family == "hybridkv_http_requests_total" and 'status="5' in name
        ) or family == "hybridkv_router_unrouted_total":
            out["5xx counted"] += float(value)
    return out


def resources(pid: int) -> dict[str, int | None]:
    """The process's open descriptors and threads (None where /proc is not there)."""
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():
        return {"descriptors": None, "threads": None}
    threads = None
    for line in (proc / "status").read_text().splitlines():
        if line.startswith("Threads:"):
            threads = int(line.split()[1])
    return {"descriptors": len(os.listdir(proc / "fd")), "threads": threads}


def wait_free(port: int, pid: int, before: dict[str, int | None], timeout: float = 30.0) -> Any:
    """The stats once nothing runs, waits or holds pages and the descriptors are back to
    ``before`` (or as they are at the timeout)."""
    end = time.monotonic() + timeout
    while True:
        stats, used = metrics(port), resources(pid)
        busy = stats["running"] + stats["waiting"] + stats["pages held"]
        fds, fds_before = used["descriptors"], before["descriptors"]
        back = fds is None or fds_before is None or fds <= fds_before
        if (busy == 0 and back) or time.monotonic() > end:
            return stats, used
        time.sleep(0.2)


def summarize(samples: list[tuple[str, float]]) -> dict[str, Any]:
    times = [s for status, s in samples if status == "200"]
    statuses = Counter(status for status, _ in samples)
    return {
        "statuses": dict(statuses),
        "ms": [round(s * 1000, 2) for _, s in samples],
        "median_ms": round(statistics.median(times) * 1000, 2) if times else None,
        "max_ms": round(max(times) * 1000, 2) if times else None,
        "all_200": statuses == Counter({"200": len(samples)}),
    }


def script_command(*args: str) -> list[str]:
    """This script again, as a module of the benchmarks package (from the repository
    root: ``ROOT`` is the child's working directory)."""
    return [sys.executable, "-m", __spec__.name if __spec__ else _MODULE, *args]


_MODULE = "benchmarks.robustness.hostile_clients"
#: The repository root, where ``python -m benchmarks...`` finds the package.
ROOT = Path(__file__).resolve().parents[2]


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    with tempfile.TemporaryFile() as log:
        serve_flag = "--serve-front-end" if args.front_end else "--serve"
        server = subprocess.Popen(
            script_command(serve_flag, case),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            return _measure(case, args, server, log, started)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def _measure(
    case: str, args: argparse.Namespace, server: subprocess.Popen[str], log: Any, started: float
) -> dict[str, Any]:
    assert server.stdin is not None and server.stdout is not None
    line = server.stdout.readline()
    if not line.strip().isdigit():
        raise RuntimeError(f"the server of case {case} did not start (exit {server.wait()})")
    port = int(line)
    for _ in range(3):  # warm-up: the first requests import and build what they need
        http_once(port, COMPLETION)
    if case == "2":  # starts the grammar checker's child process before the baseline
        http_once(
            port, request_bytes("POST", "/v1/completions", {**FRESH, "guided_choice": ["a", "b"]})
        )
    before = resources(server.pid)
    unloaded = probe(port, args.probes, time.monotonic(), 0.0)

    child = subprocess.Popen(
        script_command("--hostile", case, "--port", str(port), "--seconds", str(args.seconds)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    if child.stdout.readline() != "ready\n":
        raise RuntimeError(f"the hostile client of case {case} did not start")
    active_from = time.monotonic()
    window = max(args.seconds - 2.0, 1.0)  # probes from 1 s in to 1 s before it stops
    loaded = probe(port, args.probes, active_from + 1.0, window / args.probes)
    still_active = child.poll() is None
    out, _ = child.communicate(timeout=args.seconds + 180)
    hostile_out = json.loads(out.splitlines()[-1])

    stats, after = wait_free(port, server.pid, before)
    alive = server.poll() is None
    final_health = http_once(port, HEALTH)[0] if alive else None
    server.stdin.close()
    try:
        exit_code = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        exit_code = None
    log.seek(0)
    stderr = log.read().decode(errors="replace")

    fresh_u, fresh_l = summarize(unloaded["fresh"]), summarize(loaded["fresh"])
    health_u, health_l = summarize(unloaded["health"]), summarize(loaded["health"])
    fresh_ok = (
        fresh_u["all_200"]
        and fresh_l["all_200"]
        and fresh_l["max_ms"] <= fresh_u["median_ms"] + FRESH_GOAL_S * 1000
    )
    health_ok = health_l["all_200"] and health_l["max_ms"] <= HEALTH_GOAL_S * 1000
    codes: Counter[str] = Counter()
    for counts in hostile_out["counts"].values():
        codes.update(counts)
    fds_before, fds_after = before["descriptors"], after["descriptors"]
    leaked = stats["running"] + stats["waiting"] + stats["pages held"] > 0 or (
        fds_before is not None and fds_after is not None and fds_after > fds_before
    )
    no_5xx = stats["5xx counted"] == 0 and not any(
        code.startswith("5") or " 5" in code for code in codes
    )
    return {
        "case": case,
        "hostile": CASES[case],
        "seconds": args.seconds,
        "fresh": {"unloaded": fresh_u, "loaded": fresh_l},
        "health": {"unloaded": health_u, "loaded": health_l},
        "hostile_outcomes": hostile_out["counts"],
        "hostile_notes": hostile_out["notes"],
        "hostile_active_through_probes": still_active,
        "fresh_goal": fresh_ok,
        "health_goal": health_ok,
        "no_5xx": no_5xx,
        "server_alive_after": alive and final_health == "200",
        "server_exit_code": exit_code,
        "server_stderr_lines": len(stderr.splitlines()),
        "server_tracebacks": stderr.count("Traceback"),
        "server_stderr_bytes": len(stderr.encode()),
        "server_stderr_events": sorted(set(log_events(stderr))),
        "engine_after": stats,
        "resources_before": before,
        "resources_after": after,
        "leaked": leaked,
        "case_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="2,3,5,7", help="the cases to run (2,3,5,7)")
    parser.add_argument("--probes", type=int, default=15, help="probes of each kind per phase")
    parser.add_argument(
        "--seconds", type=float, default=12.0, help="how long each hostile client runs"
    )
    add_json_argument(parser)
    parser.add_argument(
        "--front-end",
        action="store_true",
        help="attack serve -dp's front end over two replicas instead of one server",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--serve-front-end", help=argparse.SUPPRESS)
    parser.add_argument("--hostile", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    if args.serve_front_end is not None:
        serve_front_end(args.serve_front_end, script_command("--serve", args.serve_front_end))
        return
    if args.hostile is not None:
        hostile(args.hostile, args.port, args.seconds)
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or args.probes < 1 or args.seconds <= 0:
        parser.error(f"--cases takes {','.join(CASES)}; --probes >= 1; --seconds > 0")
    start = time.monotonic()
    results = []
    for case in cases:
        result = run_case(case, args)
        print_case(result)
        results.append(result)
    total = time.monotonic() - start
    failed = [
        f"case {r['case']}: {goal}"
        for r in results
        for goal in ("fresh_goal", "health_goal", "no_5xx", "server_alive_after")
        if not r[goal]
    ]
    failed += [f"case {r['case']}: leak" for r in results if r["leaked"]]
    failed += [
        f"case {r['case']}: {label}: {code} x {n}"
        for r in results
        for label, counts in r["hostile_outcomes"].items()
        for code, n in counts.items()
        if "wrong answer" in code
    ]
    print(f"\nrun time {total:.0f} s; goal {'holds in every case' if not failed else 'FAILS'}")
    for line in failed:
        print(f"  {line}")
    write_json(
        args.json,
        {
            "front_end": args.front_end,
            "probes": args.probes,
            "seconds": args.seconds,
            "fresh_goal_s": FRESH_GOAL_S,
            "health_goal_s": HEALTH_GOAL_S,
            "run_s": round(total, 1),
            "failed": failed,
            "cases": results,
        },
    )


if __name__ == "__main__":
    main()
