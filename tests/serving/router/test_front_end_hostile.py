"""``serve -dp`` against hostile clients and a hung replica, with real replica processes:
the front end applies the replicas' limits and access rules itself, no request takes a
replica out of rotation, the replicas require the key, and a stopped replica holds no
stream."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import WAIT_S, Server

KEY = "sk-front-end-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMALL = ["--threads", "1", "--kv-memory", "4MiB", "--block-size", "4"]
LONG_PROMPT = " ".join(f"w{2 + k % 60}" for k in range(24))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def front_end(tiny_checkpoint: Path) -> Iterator[Server]:
    """``serve -dp 2`` with a key, a Host list, a 64 KiB body limit, a 2 s body timeout
    and a 3 s step timeout (so a stalled stream ends 3 s after its last byte)."""
    server = Server(
        ["serve", str(tiny_checkpoint), "--port", "0", *SMALL, "-dp", "2",
         "--api-key", KEY, "--allowed-hosts", "localhost,127.0.0.1",
         "--max-body-size", "64KiB", "--timeout-body", "2", "--step-timeout", "3"],
        env={"HYBRIDKV_API_KEY": ""},  # the key comes from the flag alone
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def _replicas(server: Server) -> dict[str, dict[str, Any]]:
    health = httpx.get(f"{server.url}/health", headers=AUTH, timeout=WAIT_S).json()
    return health["replicas"]  # type: ignore[no-any-return]


def _complete(url: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 4} | extra
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=WAIT_S)


def _model(url: str) -> str:
    answer = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=WAIT_S)
    return str(answer.json()["data"][0]["id"])


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_an_oversized_body_is_a_413_and_no_replica_falls(front_end: Server, path: str) -> None:
    """A body over --max-body-size is refused by the front end, on generation and
    tokenizer routes alike; every replica stays in rotation and serves the next one."""
    body = {"model": _model(front_end.url), "prompt": "w2 " * 40_000}
    answer = httpx.post(f"{front_end.url}{path}", json=body, headers=AUTH, timeout=WAIT_S)
    assert answer.status_code == 413, answer.text
    assert "the limit is 65536" in answer.json()["error"]["message"]
    assert all(r["healthy"] for r in _replicas(front_end).values())
    assert _complete(front_end.url, model=_model(front_end.url)).status_code == 200


def test_a_trickled_body_is_a_408(front_end: Server) -> None:
    """A body that does not arrive within --timeout-body is refused by the front end."""
    host, port = front_end.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        head = (
            f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        sock.sendall(head.encode())
        answer = sock.recv(4096).decode()  # waits for the front end's answer
    assert answer.startswith("HTTP/1.1 408"), answer


def test_a_forged_host_is_refused_by_the_front_end(front_end: Server) -> None:
    """--allowed-hosts applies at the front end: a DNS-rebinding page's Host is a 400."""
    answer = httpx.get(
        f"{front_end.url}/v1/models", headers={**AUTH, "Host": "evil.example"}, timeout=WAIT_S
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_host"


def test_the_replicas_require_the_key_and_health_hides_them(front_end: Server) -> None:
    """Each replica requires the key, which is in no process listing; the front end's
    /health names its replicas only to a request with the key."""
    replicas = _replicas(front_end)
    for replica in replicas.values():
        url = str(replica["url"])
        assert httpx.get(f"{url}/v1/models", timeout=WAIT_S).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=AUTH, timeout=WAIT_S).status_code == 200
        with open(f"/proc/{replica['pid']}/cmdline", "rb") as cmdline:
            assert KEY.encode() not in cmdline.read()
    assert httpx.get(f"{front_end.url}/v1/models", timeout=WAIT_S).status_code == 401
    health = httpx.get(f"{front_end.url}/health", timeout=WAIT_S)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_a_stopped_replica_releases_its_stream(front_end: Server) -> None:
    """A replica SIGSTOPped mid-stream: the stream ends with an error event once no byte
    came for --step-timeout, and the client is free."""
    body = {"model": _model(front_end.url), "prompt": LONG_PROMPT, "max_tokens": 1900,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{front_end.url}/v1/completions", json=body, headers=AUTH, timeout=WAIT_S
    ) as stream:
        replica = _replicas(front_end)[stream.headers["x-hybridkv-replica"]]
        lines = (line for line in stream.iter_lines() if line.startswith("data: "))
        assert '"text"' in next(lines)
        os.kill(int(replica["pid"]), signal.SIGSTOP)
        try:
            rest = list(lines)
        finally:
            os.kill(int(replica["pid"]), signal.SIGCONT)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert "failed while streaming" in error["message"]
