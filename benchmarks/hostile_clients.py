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

    python benchmarks/hostile_clients.py [--cases 2,3,5,7] [--probes 15] [--seconds 12]
                                         [--json FILE]

Results: docs/benchmarks.md, section "Hostile clients: a fresh request and /health
beside each".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _results import add_json_argument, write_json

from hybridkv.executor.grammar_bounds import DEFAULT_LIMITS

MODEL = "fake-model"
HOST = "127.0.0.1"
FRESH_GOAL_S = 2.0  # a fresh completion: at most this over the unloaded median
HEALTH_GOAL_S = 1.0  # /health: at most this
PROBE_TIMEOUT_S = 30.0
JSON = {"Content-Type": "application/json"}
FRESH = {"model": MODEL, "prompt": "w2 w3", "max_tokens": 4, "ignore_eos": True}

CASES = {
    "2": "guided_choice of 100,000, 1,000 and 1,999 new words in turn, 4 connections",
    "3": "1,000 idle sockets (--max-connections), each one closed reopened",
    "5": "n=128 (max_num_seqs 32) beside a flood at priority -100 on 8 connections",
    "7": "echo + logprobs 20 + prompt_logprobs 20 on an 8,000-token prompt",
}
MAX_CONNECTIONS = 1000  # the server's default cap, held by case 3
BIG_PROMPT_TOKENS = 8000
CHOICES_ACCEPTED = DEFAULT_LIMITS.max_choices  # the largest choice list the bounds accept
CHOICES_PARSED = 1999  # the largest one llguidance's parser takes (a row of 2,000 items)
BYTE_EOS = 256


# -- the server (a child process) ----------------------------------------------------------


def word_tokenizer(num_words: int = 62) -> Any:
    """The tests' whitespace word-level tokenizer: ``[UNK]``, ``<eos>``, ``w2 .. w63``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, num_words + 2)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer


def byte_tokenizer() -> Any:
    """The tests' byte-level tokenizer: one token per byte, then ``<eos>`` (256)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return tokenizer


def sampling_fake_executor_class() -> type:
    """The tests' ``SamplingFakeExecutor``: the fake, with random logits per position that
    the real sampler samples (structured output applies), on the byte vocabulary."""
    import torch

    from hybridkv.executor.sampler import Sampler
    from hybridkv.scheduler import FakeExecutor, StepBatch, StepResult
    from hybridkv.scheduler.params import StructuredOutput

    class SamplingFakeExecutor(FakeExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.sampler = Sampler(eos_token_ids=[BYTE_EOS], seed=0)
            self.tokenizer = byte_tokenizer()

        def compile_grammar(self, spec: StructuredOutput) -> None:
            self.sampler.compile_grammar(spec, self.tokenizer, BYTE_EOS + 1)

        def execute(self, batch: StepBatch) -> StepResult:
            fake = super().execute(batch)
            rows = [i for i, r in enumerate(batch.requests) if r.sample]
            if not rows:
                return fake
            logits = torch.stack([self._logits(batch.requests[i]) for i in rows])
            sampled = self.sampler.sample(
                logits, [batch.requests[i] for i in rows], tokenizer=self.tokenizer
            )
            tokens = list(fake.token_ids)
            for i, token in zip(rows, sampled, strict=True):
                tokens[i] = token
            return StepResult(token_ids=tuple(tokens), prompt_logprobs=fake.prompt_logprobs)

        def _logits(self, request: Any) -> Any:
            position = request.start_position + request.num_tokens - 1
            h = self._read(request.block_tables, position)
            generator = torch.Generator().manual_seed(h & 0x7FFFFFFF)
            return torch.randn(self.vocab_size, generator=generator) * 3

    return SamplingFakeExecutor


def serve(case: str) -> None:
    """Serve the case's engine on a free loopback port (printed) until stdin closes."""
    import functools

    import anyio

    from hybridkv.policies import FullAttention, SlidingWindow
    from hybridkv.scheduler import Engine, EngineConfig, FakeExecutor
    from hybridkv.serving.app import build_app
    from hybridkv.serving.chat import ChatTemplate
    from hybridkv.serving.cli.console import configure_logging
    from hybridkv.serving.connection import ConnectionLimits
    from hybridkv.serving.server import bound_port, open_socket, serve_http

    configure_logging("warning")
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=32)],
        "num_blocks": 1024,
        "block_size": 4,
        "max_model_len": 256,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 128,
        "eos_token_ids": [1],
        "vocab_size": 64,
    }
    executor_class: type[FakeExecutor] = FakeExecutor
    tokenizer = word_tokenizer()
    if case == "2":
        settings.update(vocab_size=BYTE_EOS + 1, eos_token_ids=[BYTE_EOS])
        executor_class = sampling_fake_executor_class()
        tokenizer = byte_tokenizer()
    elif case == "7":
        settings.update(max_model_len=8300, num_blocks=4400, max_num_batched_tokens=2048)
    config = EngineConfig(**settings)
    executor = executor_class.for_config(config)
    limits = ConnectionLimits(max_connections=MAX_CONNECTIONS)

    async def main() -> None:
        sock = open_socket(HOST, 0)
        port = bound_port(sock)
        async with Engine(config, executor) as engine:
            app = build_app(
                engine,
                tokenizer,
                model_name=MODEL,
                max_model_len=config.max_model_len,
                chat_template=ChatTemplate.plain(),
            )
            async with anyio.create_task_group() as tg:
                server = await tg.start(functools.partial(serve_http, limits=limits), app, sock)
                print(port, flush=True)
                await anyio.to_thread.run_sync(sys.stdin.read)  # the driver closes it
                server.should_exit = True

    anyio.run(main)


# -- the hostile clients (a child process) -------------------------------------------------


class Tally:
    """Outcomes by label (thread-safe), and a bound on the requests sent."""

    def __init__(self, limit: int) -> None:
        self.counts: dict[str, Counter[str]] = {}
        self.notes: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.sent = itertools.count()
        self.limit = limit

    def more(self, deadline: float) -> bool:
        return time.monotonic() < deadline and next(self.sent) < self.limit

    def add(self, label: str, outcome: str) -> None:
        with self.lock:
            self.counts.setdefault(label, Counter())[outcome] += 1

    def note_max(self, name: str, value: float) -> None:
        with self.lock:
            self.notes[name] = max(self.notes.get(name, value), value)


def _post_loop(
    port: int,
    body: Callable[[int], tuple[str, dict[str, Any]]],
    check: Callable[[dict[str, Any], Any], bool] | None,
    tally: Tally,
    deadline: float,
) -> None:
    """Send ``body(i)`` (a label, a request) on one kept-alive connection until the
    deadline or the bound; tally the outcomes by label."""
    import httpx

    with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=120) as client:
        for i in itertools.count():
            if not tally.more(deadline):
                return
            label, sent = body(i)
            try:
                response = client.post("/v1/completions", content=json.dumps(sent), headers=JSON)
            except httpx.HTTPError as exc:
                tally.add(label, type(exc).__name__)
                continue
            outcome = str(response.status_code)
            if response.status_code == 200:
                tally.note_max(f"{label}: largest answer, bytes", len(response.content))
            if response.status_code == 200 and check is not None:
                outcome += "" if check(sent, response.json()) else " (wrong answer)"
            tally.add(label, outcome)


def _threads(jobs: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    print("ready", flush=True)
    for thread in threads:
        thread.join()


def hostile(case: str, port: int, seconds: float) -> None:
    """Run case ``case``'s hostile client for ``seconds``; print "ready" once it is
    active, and at the end one JSON line: its outcomes by status code."""
    deadline = time.monotonic() + seconds
    if case == "3":
        tally = _idle_sockets(port, MAX_CONNECTIONS, deadline)
    else:
        tally = Tally(limit={"2": 400, "5": 20_000, "7": 60}[case])
        _threads(_jobs(case, port, tally, deadline))
    print(json.dumps({"counts": tally.counts, "notes": tally.notes}), flush=True)


def _jobs(case: str, port: int, tally: Tally, deadline: float) -> list[Callable[[], None]]:
    def job(body: Callable[[int], tuple[str, dict[str, Any]]], check: Any = None) -> Any:
        return lambda: _post_loop(port, body, check, tally, deadline)

    base = {"model": MODEL, "prompt": "w2 w3"}
    if case == "2":
        huge = [f"word{i}" for i in range(100_000)]

        def body(worker: int) -> Callable[[int], tuple[str, dict[str, Any]]]:
            def make(i: int) -> tuple[str, dict[str, Any]]:
                if i % 3 == 0:  # over the bound: a 400 before anything compiles
                    return "100,000 choices", {**base, "max_tokens": 16, "guided_choice": huge}
                count = CHOICES_ACCEPTED if i % 3 == 1 else CHOICES_PARSED
                words = [f"{worker}x{i}c{j}" for j in range(count)]  # new each time
                return f"{count:,} choices", {**base, "max_tokens": 24, "guided_choice": words}

            return make

        def in_choices(sent: dict[str, Any], answer: Any) -> bool:
            return answer["choices"][0]["text"] in sent["guided_choice"]

        return [job(body(w), in_choices) for w in range(4)]
    if case == "5":

        def many(_: int) -> tuple[str, dict[str, Any]]:
            return "n=128", {**base, "max_tokens": 16, "ignore_eos": True, "n": 128}

        def priority(_: int) -> tuple[str, dict[str, Any]]:
            return "priority -100", {**base, "max_tokens": 4, "priority": -100}

        def all_choices(_: dict[str, Any], answer: Any) -> bool:
            return len(answer["choices"]) == 128

        return [job(many, all_choices), *[job(priority) for _ in range(8)]]
    if case == "7":

        def echo(i: int) -> tuple[str, dict[str, Any]]:
            words = " ".join(f"w{2 + (i + k) % 60}" for k in range(BIG_PROMPT_TOKENS))
            return "echo + logprobs", {
                **base,
                "prompt": words,
                "max_tokens": 4,
                "ignore_eos": True,
                "echo": True,
                "logprobs": 20,
                "prompt_logprobs": 20,
            }

        def whole(_: dict[str, Any], answer: Any) -> bool:
            tokens = answer["choices"][0]["logprobs"]["tokens"]
            return len(tokens) == BIG_PROMPT_TOKENS + 4

        return [job(echo, whole)]
    raise ValueError(f"no case {case!r}")


def _idle_sockets(port: int, count: int, deadline: float) -> Tally:
    """Hold ``count`` sockets that send nothing; reopen each one the server closes."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 64
    if soft != resource.RLIM_INFINITY and soft < wanted:
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    tally = Tally(limit=50_000)
    selector = selectors.DefaultSelector()
    label = "idle socket"

    def open_one() -> None:
        try:
            sock = socket.create_connection((HOST, port), timeout=5)
        except OSError as exc:
            tally.add(label, f"connect failed ({type(exc).__name__})")
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, bytearray())
        tally.add(label, "opened")

    for _ in range(count):
        open_one()
    print("ready", flush=True)
    while time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.2):
            sock, received = key.fileobj, key.data
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionError:
                data = b""
            if data:
                received += data
                continue
            selector.unregister(sock)
            sock.close()
            status = _status(bytes(received))
            tally.add(label, f"closed, {status}" if status else "closed, no response")
            if tally.more(deadline):
                open_one()
    for key in list(selector.get_map().values()):
        selector.unregister(key.fileobj)
        key.fileobj.close()  # type: ignore[union-attr]
    return tally


# -- the probe and the driver --------------------------------------------------------------


def _status(data: bytes) -> str | None:
    if not data.startswith(b"HTTP/"):
        return None
    return data.split(b" ", 2)[1].decode()


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
    status = _status(data) or "no response"
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
    """The engine's gauges and the server's 5xx count, from ``/metrics``."""
    status, _, body = http_once(port, METRICS)
    if status != "200":
        raise RuntimeError(f"/metrics answered {status}")
    out = {"running": 0.0, "waiting": 0.0, "pages held": 0.0, "5xx counted": 0.0}
    for line in body.decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name == "hybridkv_requests_running":
            out["running"] = float(value)
        elif name == "hybridkv_requests_waiting":
            out["waiting"] = float(value)
        elif name.startswith("hybridkv_kv_blocks_used{"):
            out["pages held"] += float(value)
        elif name.startswith("hybridkv_http_requests_total{") and 'status="5' in name:
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
    return [sys.executable, str(Path(__file__).resolve()), *args]


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            script_command("--serve", case),
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
        "server_stderr_events": sorted(set(_events(stderr))),
        "engine_after": stats,
        "resources_before": before,
        "resources_after": after,
        "leaked": leaked,
        "case_s": round(time.monotonic() - started, 1),
    }


def _events(stderr: str) -> list[str]:
    """The event names of the server's log lines ("12:00:00 [warning ] name key=...")."""
    names = []
    for line in stderr.splitlines():
        _, bracket, rest = line.partition("] ")
        names.append(rest.split(" ", 1)[0] if bracket else line[:80])
    return names


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _yes(value: bool) -> str:
    return "yes" if value else "NO"


def print_case(r: dict[str, Any]) -> None:
    print(f"\ncase {r['case']}: {r['hostile']} ({r['seconds']:g} s)\n")
    print("| probe | unloaded median / max ms | loaded median / max ms | median diff ms | goal |")
    print("| --- | --- | --- | --- | --- |")
    for name, goal, limit in (
        ("fresh", "fresh_goal", f"max within {FRESH_GOAL_S:g} s of unloaded median"),
        ("health", "health_goal", f"max within {HEALTH_GOAL_S:g} s"),
    ):
        u, lo = r[name]["unloaded"], r[name]["loaded"]
        diff = (
            None
            if u["median_ms"] is None or lo["median_ms"] is None
            else lo["median_ms"] - u["median_ms"]
        )
        label = "fresh completion" if name == "fresh" else "GET /health"
        bad = "" if lo["all_200"] else f", statuses {lo['statuses']}"
        print(
            f"| {label} | {_ms(u['median_ms'])} / {_ms(u['max_ms'])} "
            f"| {_ms(lo['median_ms'])} / {_ms(lo['max_ms'])} | {diff:+.1f} "
            f"| {'holds' if r[goal] else 'FAILS'} ({limit}{bad}) |"
            if diff is not None
            else f"| {label} | - | - | - | FAILS{bad} |"
        )
    outcomes = "; ".join(
        f"{label}: " + ", ".join(f"{code} x {n}" for code, n in sorted(counts.items()))
        for label, counts in r["hostile_outcomes"].items()
    )
    print(f"\nhostile client: {outcomes}")
    for note, value in r["hostile_notes"].items():
        if value < 100_000:  # only the large answers (case 7) are worth a line
            continue
        print(f"  {note}: {value:,.0f}")
    e, before, after = r["engine_after"], r["resources_before"], r["resources_after"]
    print(
        f"5xx: {'none' if r['no_5xx'] else 'SOME'} (server counted {e['5xx counted']:.0f}); "
        f"hostile active through the probes: {_yes(r['hostile_active_through_probes'])}"
    )
    print(
        f"server: {'alive, /health 200' if r['server_alive_after'] else 'DEAD or unhealthy'} "
        f"after the case; exit code {r['server_exit_code']} when told to stop; "
        f"stderr {r['server_stderr_lines']} lines ({r['server_stderr_bytes']:,} bytes), "
        f"{r['server_tracebacks']} tracebacks"
        + (
            f" (events: {', '.join(r['server_stderr_events'])})"
            if r["server_stderr_events"]
            else ""
        )
    )
    print(
        f"after: running {e['running']:.0f}, waiting {e['waiting']:.0f}, pages held "
        f"{e['pages held']:.0f}; descriptors {before['descriptors']} -> {after['descriptors']}, "
        f"threads {before['threads']} -> {after['threads']}; "
        f"{'LEAK' if r['leaked'] else 'no leak'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="2,3,5,7", help="the cases to run (2,3,5,7)")
    parser.add_argument("--probes", type=int, default=15, help="probes of each kind per phase")
    parser.add_argument(
        "--seconds", type=float, default=12.0, help="how long each hostile client runs"
    )
    add_json_argument(parser)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--hostile", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
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
