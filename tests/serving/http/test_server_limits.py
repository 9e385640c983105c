"""Slow and stalled clients, too many connections, a hung step, and work kept off the
event loop: the server stays reachable and every case ends cleanly."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

import httpx
import pytest

from hybridkv.scheduler import FakeExecutor, StepBatch, StepResult
from hybridkv.scheduler.watchdog import StepWatchdog
from hybridkv.serving.http.app import ServerOptions
from hybridkv.serving.http.connection import ConnectionLimits
from hybridkv.serving.openai.chat_template import ChatTemplate

MODEL = "fake-model"
FAST = ConnectionLimits(head_timeout_s=0.3, idle_timeout_s=0.3, write_timeout_s=0.5)


def connect(server: Any, *, receive_buffer: int | None = None) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (10 s at most)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def head(length: int, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


@pytest.fixture
def fast(make_server: Any) -> Any:
    """A server with sub-second connection timeouts and body timeout."""
    return make_server(limits=FAST, options=ServerOptions(body_timeout_s=0.3))


def test_silent_connection_is_closed(fast: Any) -> None:
    """A client that connects and sends nothing is disconnected after the head timeout."""
    with connect(fast) as sock:
        assert read_until_closed(sock) == b""


def test_half_request_head_is_closed(fast: Any) -> None:
    """A client that stops in the middle of its headers is disconnected."""
    with connect(fast) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert read_until_closed(sock) == b""


@pytest.mark.parametrize("kept_alive", [False, True])
def test_a_request_head_over_16_kib_is_a_431(fast: Any, kept_alive: bool) -> None:
    """A head past the cap gets a 431 and the connection ends, on a fresh connection or
    after a request with a head just under it (served)."""
    lines = [f"X-Filler-{i}: {'a' * 100}\r\n" for i in range(150)]  # 116 bytes each
    under, over = "".join(lines[:130]), "".join(lines)
    with connect(fast) as sock:
        answer = b""
        if kept_alive:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{under}\r\n".encode())
            while not answer.endswith(b'"ok"}'):  # the whole answer first
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{over}".encode())
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"connection: close" in answer


def test_idle_kept_alive_connection_is_closed(fast: Any) -> None:
    """After a response, a silent kept-alive connection is closed (uvicorn's idle timeout)."""
    with connect(fast) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200")


def test_half_body_is_a_request_timeout(fast: Any) -> None:
    """A body that stops arriving gets a 408 with an error body, and the connection ends."""
    with connect(fast) as sock:
        sock.sendall(head(100) + b'{"model": ')
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408")
    assert b'"request_timeout"' in answer


def test_stalled_clients_do_not_lock_others_out(fast: Any) -> None:
    """With stalled connections around, a normal client is still served."""
    stalled = [connect(fast) for _ in range(20)]
    try:
        for sock in stalled[::2]:
            sock.sendall(head(1000) + b"{")
        body = {"model": MODEL, "prompt": "w2", "max_tokens": 2}
        response = httpx.post(f"{fast.url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 200
    finally:
        for sock in stalled:
            sock.close()


def test_connection_beyond_the_limit_closes_the_oldest_idle_one(make_server: Any) -> None:
    """Past max_connections, the oldest connection that has sent no request is closed
    and the new one kept; the others work (test_server_connections.py has the rest)."""
    limits = ConnectionLimits(max_connections=3, first_byte_timeout_s=60, head_timeout_s=60)
    server = make_server(limits=limits)
    held = [connect(server) for _ in range(3)]
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    try:
        with connect(server) as extra:
            assert read_until_closed(held[0]) == b""
            extra.sendall(request)
            assert read_until_closed(extra).startswith(b"HTTP/1.1 200")
        held[1].sendall(request)
        assert read_until_closed(held[1]).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()


def test_client_that_stops_reading_is_cut_and_its_request_aborted(make_server: Any) -> None:
    """A stream nobody reads fills the socket; past the write timeout the server closes it,
    aborts the request and frees its pages."""
    # Small socket buffers, and chunks of ~900 bytes (20 top logprobs each): the server's
    # writes stall after about 90 of the 250 tokens, which take 5 s to generate.
    server = make_server(limits=FAST, send_buffer=4096, step_delay_s=0.02)
    body = b'{"model": "fake-model", "prompt": "w2 w3", "max_tokens": 250, "logprobs": 20, '
    body += b'"stream": true, "ignore_eos": true}'
    with watched_logs() as logs, connect(server, receive_buffer=4096) as sock:
        sock.sendall(head(len(body)) + body)
        server.wait_until_running()
        server.wait_until_free(timeout=20)
        read_until_closed(sock)
        logs.wait_for("client_disconnected")
    assert server.executor.num_steps < 250
    events = [e["event"] for e in logs]
    assert "client_not_reading" in events
    assert events.count("client_disconnected") == 1


# -- disconnects are logged once, at info, without a traceback --------------------------


class WatchedLogs(list[dict[str, Any]]):
    """structlog events as they come, from any thread, and a wait for one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def __call__(self, _: Any, method_name: str, event_dict: dict[str, Any]) -> NoReturn:
        import structlog

        event_dict["log_level"] = structlog.testing.map_method_name(method_name)
        with self.changed:
            self.append(event_dict)
            self.changed.notify_all()
        raise structlog.DropEvent

    def wait_for(self, event: str, timeout: float = 30.0) -> None:
        """Return once ``event`` was logged (woken by each log line, never polled)."""
        with self.changed:
            found = self.changed.wait_for(lambda: any(e["event"] == event for e in self), timeout)
        assert found, f"no {event} event within {timeout} s"


@contextlib.contextmanager
def watched_logs() -> Iterator[WatchedLogs]:
    """As structlog's ``capture_logs``, with :class:`WatchedLogs` capturing."""
    import structlog

    logs = WatchedLogs()
    processors = structlog.get_config()["processors"]
    saved = processors.copy()
    try:
        processors.clear()
        processors.append(logs)
        structlog.configure(processors=processors)
        yield logs
    finally:
        processors.clear()
        processors.extend(saved)
        structlog.configure(processors=processors)


class AppProbe:
    """ASGI middleware around the app (``make_server(wrap_app=probe)``): an event once a
    request's handler has received a piece of its body, and one once the handler returned."""

    def __init__(self) -> None:
        self.read_body = threading.Event()
        self.returned = threading.Event()

    def __call__(self, app: Any) -> Any:
        async def probed(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                return await app(scope, receive, send)

            async def watched() -> Any:
                message = await receive()
                if message["type"] == "http.request" and message.get("body"):
                    self.read_body.set()
                return message

            try:
                await app(scope, watched, send)
            finally:
                self.returned.set()

        return probed


@pytest.fixture
def quiet_logs(caplog: pytest.LogCaptureFixture) -> Iterator[WatchedLogs]:
    """structlog events of the test; afterwards, no error-level line from anyone."""
    with watched_logs() as logs:
        yield logs
    assert [e for e in logs if e["log_level"] in ("error", "critical")] == []
    assert [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []


def test_disconnect_mid_upload_is_one_info_line(make_server: Any, quiet_logs: WatchedLogs) -> None:
    """A client leaving while sending its body: one client_disconnected at info, no error."""
    probe = AppProbe()
    server = make_server(wrap_app=probe)
    with connect(server) as sock:
        sock.sendall(head(1000) + b'{"model": "fake-model", ')
        assert probe.read_body.wait(30)  # the handler has what was sent, and waits for more
    assert probe.returned.wait(30)  # it saw the client go, logged, and answered nobody
    disconnects = [e for e in quiet_logs if e["event"] == "client_disconnected"]
    assert [(e["log_level"], e.get("phase")) for e in disconnects] == [("info", "request")]


def test_disconnect_mid_stream_is_one_info_line(make_server: Any, quiet_logs: WatchedLogs) -> None:
    """A client leaving a stream: one client_disconnected at info, the request aborted."""
    probe = AppProbe()
    server = make_server(step_delay_s=0.01, wrap_app=probe)
    body = {"model": MODEL, "prompt": "w2", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=server.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as stream,
    ):
        next(stream.iter_lines())
    server.wait_until_free()
    assert probe.returned.wait(30)  # the stream's handler is done: nothing more to log
    assert [e["log_level"] for e in quiet_logs if e["event"] == "client_disconnected"] == ["info"]


# -- a hung step -------------------------------------------------------------------------


class HangingExecutor(FakeExecutor):
    """Hangs any step that runs token w9 (id 9) until released."""

    release = threading.Event()

    def execute(self, batch: StepBatch) -> StepResult:
        if any(9 in r.token_ids for r in batch.requests):
            self.release.wait(60)
        return super().execute(batch)


@pytest.fixture
def hanging(make_server: Any) -> Iterator[Any]:
    """A server whose steps are watched with a 0.3 s limit; the hung step is released at
    the end."""
    HangingExecutor.release.clear()
    yield make_server(
        executor_class=HangingExecutor, wrap=lambda executor: StepWatchdog(executor, 0.3)
    )
    HangingExecutor.release.set()


def test_hung_step_fails_requests_and_health(hanging: Any) -> None:
    """A step past the limit: its request fails with the reason, /health says 503, and
    later requests are refused with 503."""
    body = {"model": MODEL, "prompt": "w2 w9", "max_tokens": 3}
    failed = httpx.post(f"{hanging.url}/v1/completions", json=body, timeout=30)
    assert failed.status_code == 500
    assert "ran longer than 0.3 s" in failed.json()["error"]["message"]
    health = httpx.get(f"{hanging.url}/health", timeout=10)
    assert health.status_code == 503
    assert "step timeout" in health.json()["error"]["message"]
    later = httpx.post(f"{hanging.url}/v1/completions", json={**body, "prompt": "w2"}, timeout=30)
    assert later.status_code == 503


def test_watched_steps_run_normally(hanging: Any) -> None:
    """Steps under the limit pass through the watchdog unchanged."""
    body = {"model": MODEL, "prompt": "w2 w3", "max_tokens": 4, "ignore_eos": True}
    response = httpx.post(f"{hanging.url}/v1/completions", json=body, timeout=30)
    assert response.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{hanging.url}/health", timeout=10).status_code == 200


# -- work kept off the event loop -------------------------------------------------------


def test_huge_prompt_is_refused_before_tokenizing(make_server: Any) -> None:
    """A 3 MiB prompt is refused from its length alone, with the numbers."""
    server = make_server(options=ServerOptions(max_body_bytes=8 * 2**20))
    body = {"model": MODEL, "prompt": "w2 " * (2**20)}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "context_length_exceeded")
    assert "characters" in error["message"]


class BlockedTemplate(ChatTemplate):
    """The plain template, whose rendering holds its worker thread until released."""

    def __init__(self) -> None:
        plain = ChatTemplate.plain()
        super().__init__(plain.source, is_builtin=plain.is_builtin)
        self.started = threading.Event()
        self.release = threading.Event()

    def render(self, *args: Any, **kwargs: Any) -> str:
        self.started.set()
        assert self.release.wait(timeout=60), "the test never released the rendering"
        return super().render(*args, **kwargs)


def test_health_answers_while_a_template_renders(make_server: Any) -> None:
    """A chat template still rendering does not hold /health (it renders in a thread)."""
    template = BlockedTemplate()
    server = make_server(chat_template=template)
    results: list[int] = []
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w2"}], "max_tokens": 2}

    def render() -> None:
        url = f"{server.url}/v1/chat/completions"
        results.append(httpx.post(url, json=chat, timeout=60).status_code)

    worker = threading.Thread(target=render)
    worker.start()
    try:
        assert template.started.wait(timeout=60)
        for _ in range(5):
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert not results  # the rendering is still held
    finally:
        template.release.set()
        worker.join()
    assert results == [200]
