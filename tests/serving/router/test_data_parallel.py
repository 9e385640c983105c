"""``serve --data-parallel-size``: replicas in real processes behind one front end, the
same answers as one engine, and a replica killed in the middle of the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hybridkv.parallel.kv_events_config import KVEventsConfig
from hybridkv.serving.cli.data_parallel import kv_events_of, replica_command_line
from hybridkv.serving.cli.main import build_parser
from hybridkv.serving.router.front_end import REPLICA_HEADER
from hybridkv.serving.router.replicas import reachable

RUN_CLI = "import sys; from hybridkv.serving.cli.main import main; sys.exit(main(sys.argv[1:]))"
WAIT_S = 120.0  # a bound on each answer on a busy machine, never a pause


def test_a_replica_is_the_same_serve_command_on_its_own_port_and_events() -> None:
    argv = ["serve", "m", "-dp", "2", "--port", "8000", "--host=0.0.0.0", "-tp", "2",
            "--kv-events-config", "{}", "--routing", "round-robin", "--load-interval=0.5",
            "--health-interval", "2", "--restart-replicas", "--kv-memory", "1GiB"]  # fmt: skip
    line = replica_command_line(argv, port=9001, kv_events='{"x": 1}', rank=1)
    assert line == ["serve", "m", "-tp", "2", "--kv-memory", "1GiB", "--host", "127.0.0.1",
                    "--port", "9001", "--kv-events-config", '{"x": 1}',
                    "--data-parallel-rank", "1"]  # fmt: skip


def test_a_users_kv_events_config_is_moved_up_by_the_rank_as_vllm_does() -> None:
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5560"
    )
    moved = config.for_data_parallel_rank(2)
    assert (moved.endpoint, moved.replay_endpoint) == ("tcp://*:5559", "tcp://*:5562")
    ipc = KVEventsConfig(enable_kv_cache_events=True, endpoint="ipc:///tmp/kv")
    assert ipc.for_data_parallel_rank(1).endpoint == "ipc:///tmp/kv_dp1"
    assert config.for_data_parallel_rank(0) is config
    args = build_parser().parse_args(
        ["serve", "-dp", "2", "--kv-events-config", json.dumps({"enable_kv_cache_events": True})]
    )
    assert json.loads(kv_events_of(args, 1))["endpoint"] == "tcp://*:5558"
    args = build_parser().parse_args(["serve", "-dp", "2"])
    assert json.loads(kv_events_of(args, 1))["endpoint"].startswith("tcp://127.0.0.1:")
    assert reachable("tcp://0.0.0.0:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert reachable("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    assert reachable("ipc:///tmp/kv", "10.0.0.7") == "ipc:///tmp/kv"


@pytest.fixture
def data_parallel_server(tiny_checkpoint: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``hybridkv serve -dp 2`` on the tiny checkpoint: its URL and process."""
    process = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, "serve", str(tiny_checkpoint), "-dp", "2",
         "--port", "0", "--threads", "1", "--kv-memory", "4MiB", "--block-size", "4",
         "--log-level", "warning"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert process.stderr is not None
        url, seen = "", []
        for line in process.stderr:  # the line it prints once every replica serves
            seen.append(line)
            if line.startswith("routing at "):
                url = line.split()[2].removesuffix("/v1")
                break
        assert url, "the front end never said it routes:\n" + "".join(seen)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        process.wait(timeout=WAIT_S)
        if process.stderr is not None:
            process.stderr.close()


def _replicas(url: str) -> dict[str, dict[str, object]]:
    return httpx.get(f"{url}/health", timeout=WAIT_S).json()["replicas"]  # type: ignore[no-any-return]


def _complete(url: str, prompt: str, **extra: object) -> httpx.Response:
    model = httpx.get(f"{url}/v1/models", timeout=WAIT_S).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0} | extra
    return httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S)


@pytest.mark.slow
def test_two_replicas_answer_as_one_engine_and_survive_one_being_killed(
    data_parallel_server: tuple[str, subprocess.Popen[str]],
) -> None:
    url, front_end = data_parallel_server
    replicas = _replicas(url)
    assert sorted(replicas) == ["0", "1"] and all(r["healthy"] for r in replicas.values())
    prompts = [" ".join(f"w{2 + (i * 7 + k) % 60}" for k in range(24)) for i in range(4)]
    # Through the front end, as from each replica directly (one engine's answer).
    routed = {p: _complete(url, p) for p in prompts}
    for prompt, answer in routed.items():
        served_by = replicas[answer.headers[REPLICA_HEADER]]
        direct = _complete(str(served_by["url"]), prompt).json()
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    # A follow-up of a prompt goes where its prefix is.
    first = routed[prompts[1]].headers[REPLICA_HEADER]
    follow_up = _complete(url, prompts[1] + " w9 w8 w7")
    assert follow_up.headers[REPLICA_HEADER] == first
    metrics = httpx.get(f"{url}/metrics", timeout=WAIT_S).text
    assert 'vllm:num_requests_running{engine="0"' in metrics  # each replica's, labelled
    assert 'vllm:num_requests_running{engine="1"' in metrics

    # A stream whose replica is killed after its first event ends in an error event.
    model = httpx.get(f"{url}/v1/models", timeout=WAIT_S).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompts[0], "max_tokens": 1900, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=WAIT_S) as stream:
        victim = stream.headers[REPLICA_HEADER]
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(int(str(replicas[victim]["pid"])), signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]
    assert "failed while streaming" in events[-2]
    # Every later request is served by the other replica.
    survivor = "1" if victim == "0" else "0"
    for prompt in prompts:
        answer = _complete(url, prompt)
        assert answer.status_code == 200
        assert answer.headers[REPLICA_HEADER] == survivor
    health = _replicas(url)
    assert health[victim]["healthy"] is False and health[survivor]["healthy"] is True
    # Ctrl-C stops the front end and the surviving replica with it.
    front_end.send_signal(signal.SIGINT)
    assert front_end.wait(timeout=WAIT_S) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(int(str(health[survivor]["pid"])), 0)
