"""Probes from outside, with a bounded number of real sockets, of the connection cap: idle
sockets filling it (and reopened as fast as the server closes them) cannot lock fresh
clients or /health out, one address cannot take more than its share, the cap fits the
descriptor limit, and the log lines a flood causes are rate-limited."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from structlog.testing import capture_logs

from hybridkv.scheduler import FakeExecutor, StepBatch, StepResult
from hybridkv.serving.http.connection import ConnectionLimits
from hybridkv.serving.http.rate_limited_log import RateLimitedLog
from hybridkv.serving.http.uvicorn_server import AcceptErrorLog

MODEL = "fake-model"
#: Timeouts long enough that no timer closes a connection during a test: what closes
#: one is the cap.
SLOW = {"first_byte_timeout_s": 60.0, "head_timeout_s": 60.0, "idle_timeout_s": 60.0}
COMPLETION = {"model": MODEL, "prompt": "w2 w3", "max_tokens": 2}
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def address(server: Any) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def connect(server: Any) -> socket.socket:
    sock = socket.create_connection(address(server), timeout=10)
    sock.settimeout(10)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout,
    10 s, if it never does)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def is_open(sock: socket.socket) -> bool:
    """Whether the server has neither closed nor reset the connection (as of now)."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1))  # the server sent something: open
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.settimeout(10)


def completion(server: Any) -> httpx.Response:
    """A completion on a new connection, closed after it."""
    return httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=10)


def health(server: Any) -> int:
    return httpx.get(f"{server.url}/health", timeout=10).status_code


def completion_request(*, close: bool = True) -> bytes:
    body = json.dumps(COMPLETION).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    )
    return head.encode() + body


# -- a cap filled by idle sockets -------------------------------------------------------


def test_idle_sockets_at_the_cap_do_not_lock_out_fresh_clients(make_server: Any) -> None:
    """With every slot held by a socket that never sends a byte, a fresh completion and
    /health are served: each closes the oldest idle socket, not itself."""
    server = make_server(limits=ConnectionLimits(max_connections=8, **SLOW))
    idle = [connect(server) for _ in range(8)]
    try:
        with capture_logs() as logs, connect(server) as fresh:
            fresh.sendall(completion_request())
            answer = read_until_closed(fresh)
        assert answer.startswith(b"HTTP/1.1 200")
        assert b'"completion_tokens":2' in answer
        assert read_until_closed(idle[0]) == b""  # the oldest made room
        assert "connection_evicted" in [e["event"] for e in logs]
        idle.append(connect(server))  # the cap is full again (the fresh one is closed)
        with connect(server) as probe:
            probe.sendall(HEALTH)
            assert read_until_closed(probe).startswith(b"HTTP/1.1 200")
        assert read_until_closed(idle[1]) == b""
        assert all(is_open(sock) for sock in idle[2:])
    finally:
        for sock in idle:
            sock.close()


FLOOD = textwrap.dedent(
    """
    import selectors, socket, sys

    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)  # closed: stop
    reopened = 0

    def open_one():
        sock = socket.create_connection((host, port), timeout=10)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)

    for _ in range(count):
        open_one()
    print("ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=30):
            if key.fileobj is sys.stdin:
                print(reopened, flush=True)
                sys.exit(0)
            sock = key.fileobj
            try:
                data = sock.recv(1)
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if not data:  # the server closed it: open another at once
                selector.unregister(sock)
                sock.close()
                open_one()
                reopened += 1
    """
)

#: Fresh clients in a process of their own (in the server's process a client waits for
#: the interpreter lock between connecting and sending, which no real client does): one
#: request per connection, "Connection: close", read to the end; prints the status lines.
PROBE = textwrap.dedent(
    """
    import json, socket, sys

    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    body = json.dumps({"model": "fake-model", "prompt": "w2 w3", "max_tokens": 2}).encode()
    completion = (
        b"POST /v1/completions HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n"
        b"Content-Type: application/json\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body
    )
    health = b"GET /health HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n"

    def ask(request):
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(request)
            answer = b""
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
            except ConnectionResetError:
                pass
        return answer.split(b"\\r\\n", 1)[0].decode()

    print(json.dumps([[ask(completion), ask(health)] for _ in range(count)]))
    """
)


#: The flood's sockets, and the cap. A fresh client is pushed out only if the flood
#: cycles through all of them before the client sends its request (here about 1.5 ms a
#: socket: a client stalled 50 ms between connecting and sending; in production a
#: client's request follows its handshake at once, and the cap is 1,000).
FLOOD_SOCKETS = 32


@pytest.fixture
def flood(make_server: Any) -> Iterator[tuple[Any, subprocess.Popen[str]]]:
    """A server at its cap of idle sockets, held by a child process that reopens each
    one the server closes, at once (it prints its reopen count on exit)."""
    server = make_server(limits=ConnectionLimits(max_connections=FLOOD_SOCKETS, **SLOW))
    host, port = address(server)
    args = [sys.executable, "-c", FLOOD, host, str(port), str(FLOOD_SOCKETS)]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "ready\n"
            yield server, child
        finally:
            child.kill()


def test_a_client_reopening_every_closed_socket_cannot_starve_fresh_requests(
    flood: tuple[Any, subprocess.Popen[str]],
) -> None:
    """The flood pushes out only its own oldest sockets: every fresh completion and
    /health probe is served."""
    server, child = flood
    host, port = address(server)
    probe = [sys.executable, "-c", PROBE, host, str(port), "10"]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == [["HTTP/1.1 200 OK"] * 2] * 10
    out, _ = child.communicate(timeout=10)  # stdin closed: it stops, prints its count
    assert int(out) >= 1  # the first fresh connection, at least, pushed one of its out


# -- the monitoring reserve --------------------------------------------------------------


class GatedExecutor(FakeExecutor):
    """The fake, whose steps wait until the test opens the gate: the requests stay in
    flight however slow the test."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def execute(self, batch: StepBatch) -> StepResult:
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super().execute(batch)


def wait_for_requests(server: Any, count: int) -> None:
    """Return once the engine holds ``count`` requests (their bodies were read)."""

    async def queued() -> None:
        with anyio.fail_after(30):
            await server.engine.wait_until(lambda s: s.num_running + s.num_waiting == count)

    server.portal.call(queued)


def test_health_is_served_when_every_connection_has_a_request(make_server: Any) -> None:
    """With every slot held by a request in flight (nothing to close), a new connection
    goes to the reserve: it answers /health, a completion there is a 503, and once the
    others are done it serves anything."""
    limits = ConnectionLimits(max_connections=4, monitoring_reserve=1, **SLOW)
    server = make_server(limits=limits, executor_class=GatedExecutor)
    busy = [connect(server) for _ in range(4)]
    try:
        for sock in busy:
            sock.sendall(completion_request())
        wait_for_requests(server, 4)
        # Each probe asks for "Connection: close" and is read to the end: the server has
        # counted it out before the next one connects.
        with connect(server) as probe:
            probe.sendall(HEALTH)
            assert read_until_closed(probe).startswith(b"HTTP/1.1 200")
        with connect(server) as probe:
            probe.sendall(completion_request())
            refused = read_until_closed(probe)
        assert refused.startswith(b"HTTP/1.1 503")
        assert b'"code":"connection_limit"' in refused
        with connect(server) as reserved:  # in the reserve, until the others are done
            server.executor.gate.set()
            for sock in busy:
                assert read_until_closed(sock).startswith(b"HTTP/1.1 200")
            reserved.sendall(completion_request())
            assert read_until_closed(reserved).startswith(b"HTTP/1.1 200")
    finally:
        server.executor.gate.set()
        for sock in busy:
            sock.close()


# -- one address, the first byte ---------------------------------------------------------


def test_connections_past_the_per_client_cap_are_refused(make_server: Any) -> None:
    """Past max_connections_per_client from one address (far under the global cap), the
    next connection is closed at once; those before it are served, and one closing
    makes room for another."""
    limits = ConnectionLimits(max_connections=8, max_connections_per_client=3, **SLOW)
    server = make_server(limits=limits)
    held = [connect(server) for _ in range(3)]
    try:
        with capture_logs() as logs, connect(server) as extra:
            assert read_until_closed(extra) == b""  # no timer could close it this soon
        refused = [e for e in logs if e["event"] == "connection_refused"]
        assert [e["reason"] for e in refused] == ["max_connections_per_client"]
        held[0].sendall(HEALTH)
        assert read_until_closed(held[0]).startswith(b"HTTP/1.1 200")  # and it is closed
        with connect(server) as again:
            again.sendall(HEALTH)
            assert read_until_closed(again).startswith(b"HTTP/1.1 200")
        held[1].sendall(HEALTH)
        assert read_until_closed(held[1]).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()


def test_silent_connection_is_closed_at_the_first_byte_timeout(make_server: Any) -> None:
    """A connection that sends nothing is closed at the first-byte timeout, well before
    the request-head timeout."""
    server = make_server(
        limits=ConnectionLimits(first_byte_timeout_s=0.2, head_timeout_s=60, idle_timeout_s=60)
    )
    with capture_logs() as logs, connect(server) as sock:
        assert read_until_closed(sock) == b""
    events = [e["event"] for e in logs]
    assert "first_byte_timeout" in events
    assert "request_head_timeout" not in events


# -- the descriptor limit ----------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from structlog.testing import capture_logs
    from hybridkv.serving.cli.main import build_parser
    from hybridkv.serving.cli.flags.serve import http_settings

    soft, hard = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    args = build_parser().parse_args(["serve", "--max-connections", sys.argv[3]])
    with capture_logs() as logs:
        settings = http_settings(args, max_body_bytes=1024, default_max_tokens=None)
    print(json.dumps({
        "max_connections": settings.limits.max_connections,
        "soft_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "logs": logs,
    }))
    """
)


def serve_limits_under(soft: int, hard: int, max_connections: int) -> dict[str, Any]:
    """What `hybridkv serve --max-connections N` makes of its limits in a process whose
    descriptor limit is (soft, hard)."""
    import resource

    ours = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if ours != resource.RLIM_INFINITY and ours < hard:
        pytest.skip(f"the hard descriptor limit ({ours}) is under {hard}")
    args = [sys.executable, "-c", CHILD, str(soft), str(hard), str(max_connections)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_max_connections_is_clamped_below_the_descriptor_limit() -> None:
    """Under `ulimit -n 200` (hard), 1000 connections cannot all be open: the cap is
    lowered to leave room for the engine's files and the reserve, in one log line."""
    result = serve_limits_under(200, 200, 1000)
    assert 0 < result["max_connections"] < 200 - 8
    [line] = result["logs"]
    assert line["event"] == "max_connections_clamped"
    assert (line["requested"], line["max_connections"]) == (1000, result["max_connections"])
    assert line["descriptor_limit"] == 200


def test_soft_descriptor_limit_is_raised_when_the_hard_one_allows() -> None:
    """With room under the hard limit, the soft limit is raised and the cap kept."""
    result = serve_limits_under(200, 2000, 1000)
    assert result["max_connections"] == 1000
    assert 1000 < result["soft_limit"] <= 2000
    assert [e["event"] for e in result["logs"]] == ["descriptor_limit_raised"]


def test_limit_that_fits_is_left_alone() -> None:
    """Nothing changes, and nothing is logged, when the descriptor limit has room."""
    result = serve_limits_under(4000, 4000, 1000)
    assert (result["max_connections"], result["soft_limit"], result["logs"]) == (1000, 4000, [])


# -- rate-limited log lines --------------------------------------------------------------


def test_rate_limited_log_counts_what_it_leaves_out() -> None:
    """One line a second at most; the next line carries the count of those left out."""
    limiter = RateLimitedLog("accept_failed", interval_s=1.0)
    with capture_logs() as logs:
        logged = [limiter(now, n=i) for i, now in enumerate([0.0, 0.1, 0.5, 0.99, 1.0, 1.5, 5.0])]
    assert logged == [True, False, False, False, True, False, True]
    assert [(e["n"], e.get("suppressed")) for e in logs] == [(0, None), (4, 3), (6, 1)]
    assert all(e["log_level"] == "warning" for e in logs)


def test_accept_errors_are_rate_limited_and_others_passed_on() -> None:
    """The loop's exception handler: 5,000 EMFILE accept failures in half a second are
    one line, as are the failures of asyncio's retries of the closed listener; an
    unrelated error goes to the handler before it."""
    now = [100.0]
    passed_on: list[dict[str, Any]] = []
    handler = AcceptErrorLog(lambda loop, context: passed_on.append(context), clock=lambda: now[0])
    emfile = OSError(errno.EMFILE, "Too many open files")
    accept = {"message": "socket.accept() out of system resource", "exception": emfile,
              "socket": object()}  # fmt: skip
    other = {"message": "Task exception was never retrieved", "exception": ValueError("x")}
    retry = {"message": "Exception in callback", "exception": ValueError("fd -1"),
             "handle": Handle(_start_serving)}  # fmt: skip
    loop: Any = None
    with capture_logs() as logs:
        for i in range(5000):
            now[0] = 100.0 + i * 0.0001
            handler(loop, accept)
            handler(loop, retry)
        handler(loop, other)
        now[0] = 101.0
        handler(loop, accept)
    assert [(e["event"], e.get("suppressed")) for e in logs] == [
        ("accept_failed", None),
        ("accept_retry_failed", None),
        ("accept_failed", 4999),
    ]
    assert logs[0]["error"] == "EMFILE"
    assert passed_on == [other]


class Handle:
    """A stand-in for the loop's timer handle of a callback."""

    def __init__(self, callback: Any) -> None:
        self._callback = callback


def _start_serving() -> None:
    """Named as asyncio's retry of a listener after a failed accept()."""


def test_the_server_loop_logs_through_the_accept_limiter(server: Any) -> None:
    """While serving, the loop's exception handler is the rate-limited one."""

    async def loop_handler() -> Any:
        return asyncio.get_running_loop().get_exception_handler()

    assert isinstance(server.portal.call(loop_handler), AcceptErrorLog)


# -- the flags ---------------------------------------------------------------------------


def test_connection_flags_make_the_limits() -> None:
    """--timeout-first-byte and --max-connections-per-client reach the limits; the
    per-client cap is off by default."""
    from hybridkv.serving.cli.flags.serve import http_settings
    from hybridkv.serving.cli.main import build_parser

    parser = build_parser()
    flags = ["serve", "--timeout-first-byte", "2.5", "--max-connections-per-client", "16"]
    limits = http_settings(parser.parse_args(flags), max_body_bytes=1, default_max_tokens=None)
    assert (limits.limits.first_byte_timeout_s, limits.limits.max_connections_per_client) == (
        2.5,
        16,
    )
    default = http_settings(parser.parse_args(["serve"]), max_body_bytes=1, default_max_tokens=None)
    assert default.limits.max_connections_per_client is None
    assert default.limits.first_byte_timeout_s == 5.0


@pytest.mark.parametrize(
    "flags", [["--timeout-first-byte", "0"], ["--max-connections-per-client", "0"]]
)
def test_bad_connection_flags_are_refused(flags: list[str]) -> None:
    """Out-of-range values are errors naming the flag."""
    from hybridkv.serving.cli.flags.serve import http_settings
    from hybridkv.serving.cli.main import build_parser

    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(ValueError, match=flags[0]):
        http_settings(args, max_body_bytes=1, default_max_tokens=None)
