"""Real signals to real server processes: ``serve -dp`` leaves no replica behind however
it is stopped, restarts a dead one when asked, and ``serve -tp`` stops promptly after a
worker was killed. Every wait is on a process's exit or a line it prints."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import WAIT_S, Server, gone_within, is_free

#: Every process must be gone this long after SIGTERM (the issue's bound is 10 s; the
#: rest is slack for a machine whose cores are all busy).
STOP_S = 30.0
SMALL = ["--threads", "1", "--kv-memory", "4MiB", "--block-size", "4"]
LONG_PROMPT = " ".join(f"w{2 + k % 60}" for k in range(24))

pytestmark = pytest.mark.slow


@pytest.fixture
def start_server(tiny_checkpoint: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def start(*flags: str) -> Server:
        servers.append(Server(["serve", str(tiny_checkpoint), "--port", "0", *SMALL, *flags]))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _replicas(server: Server) -> dict[str, dict[str, Any]]:
    return httpx.get(f"{server.url}/health", timeout=WAIT_S).json()["replicas"]  # type: ignore[no-any-return]


def _open_stream(url: str) -> tuple[Any, Any, Iterator[str]]:
    """A long streamed completion, its first event read: (client, response, lines)."""
    client = httpx.Client(timeout=WAIT_S)
    model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 1900, "ignore_eos": True,
            "stream": True}  # fmt: skip
    response = client.send(client.build_request("POST", f"{url}/v1/completions", json=body),
                           stream=True)  # fmt: skip
    lines = (line for line in response.iter_lines() if line.startswith("data: "))
    assert '"text"' in next(lines)
    return client, response, lines


def _last_error(lines: Iterator[str]) -> str:
    """The message of the error event that ends a stream (before its ``[DONE]``)."""
    rest = list(lines)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    return str(json.loads(rest[-2].removeprefix("data: "))["error"]["message"])


def test_sigterm_stops_the_front_end_and_every_replica(start_server: Any) -> None:
    """SIGTERM to ``serve -dp 2`` with streams in flight: each stream ends with the
    shutdown's error event, and the front end, both replicas and their ports are gone."""
    server = start_server("-dp", "2")
    replicas = _replicas(server)
    streams = [_open_stream(server.url) for _ in range(2)]
    server.process.send_signal(signal.SIGTERM)
    for client, response, lines in streams:
        assert _last_error(lines) == "the server is shutting down"
        response.close()
        client.close()
    assert server.process.wait(STOP_S) == 0
    for replica in replicas.values():
        assert gone_within(int(replica["pid"]), STOP_S)
        assert is_free(str(replica["url"]))


def test_a_killed_replica_leaves_the_other_to_be_stopped(start_server: Any) -> None:
    """SIGKILL one replica: it is out of rotation; SIGTERM to the front end then stops
    the other replica too."""
    server = start_server("-dp", "2", "--log-level", "info")
    replicas = _replicas(server)
    os.kill(int(replicas["0"]["pid"]), signal.SIGKILL)
    server.wait_for_line("replica_down")
    health = _replicas(server)
    assert health["0"]["healthy"] is False and "exited" in health["0"]["reason"]
    assert health["1"]["healthy"] is True
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(STOP_S) == 0
    assert gone_within(int(replicas["1"]["pid"]), STOP_S)


def test_replicas_end_with_a_killed_front_end(start_server: Any) -> None:
    """SIGKILL to the front end: each replica sees its parent gone and stops."""
    server = start_server("-dp", "2")
    replicas = _replicas(server)
    server.process.kill()
    server.process.wait(WAIT_S)
    for replica in replicas.values():
        assert gone_within(int(replica["pid"]), STOP_S)
        assert is_free(str(replica["url"]))


def test_a_dead_replica_is_restarted_when_asked(start_server: Any) -> None:
    """With ``--restart-replicas`` a killed replica is started again and back in
    rotation, under a new pid."""
    server = start_server("-dp", "2", "--restart-replicas", "--log-level", "info")
    first_pid = int(_replicas(server)["1"]["pid"])
    mark = len(server.lines)
    os.kill(first_pid, signal.SIGKILL)
    server.wait_for_line("replica_restarted", after=mark)
    server.wait_for_line("replica_up", after=mark)
    health = _replicas(server)["1"]
    assert health["healthy"] is True and health["pid"] != first_pid
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(STOP_S) == 0
    assert gone_within(int(health["pid"]), STOP_S)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_tensor_server_whose_worker_died_stops_promptly(start_server: Any, stop: Any) -> None:
    """``serve -tp 2`` with rank 1 SIGKILLed mid-stream: the stream ends with an error
    event, and the server then exits on SIGTERM or SIGINT without waiting on the dead
    rank, leaving no process."""
    server = start_server("-tp", "2", "--log-level", "info")
    started = server.wait_for_line("pipeline_started")
    worker = int(started.split("pids=[")[1].split("]")[0])
    client, response, lines = _open_stream(server.url)
    os.kill(worker, signal.SIGKILL)
    assert "rank 1" in _last_error(lines)
    response.close()
    client.close()
    server.process.send_signal(stop)
    assert server.process.wait(STOP_S) == 0
