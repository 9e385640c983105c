"""The hostile clients of hostile_clients.py, each in a child process that stops by itself:
slow grammars, idle sockets, n=128 beside a priority flood, a 15.7 MB answer."""

from __future__ import annotations

import itertools
import json
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from benchmarks.robustness.server import HOST, MAX_CONNECTIONS, MODEL
from hybridkv.executor.grammar_bounds import DEFAULT_LIMITS

JSON = {"Content-Type": "application/json"}
BIG_PROMPT_TOKENS = 8000
CHOICES_ACCEPTED = DEFAULT_LIMITS.max_choices  # the largest choice list the bounds accept
CHOICES_PARSED = 1999  # the largest one llguidance's parser takes (a row of 2,000 items)


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
            status = http_status(bytes(received))
            tally.add(label, f"closed, {status}" if status else "closed, no response")
            if tally.more(deadline):
                open_one()
    for key in list(selector.get_map().values()):
        selector.unregister(key.fileobj)
        key.fileobj.close()  # type: ignore[union-attr]
    return tally


def http_status(data: bytes) -> str | None:
    """The status code of an HTTP response's first bytes, or None."""
    if not data.startswith(b"HTTP/"):
        return None
    return data.split(b" ", 2)[1].decode()
