"""Fairness and large answers through the live server: priorities only where the
scheduling policy takes them, one request's choices never holding every running slot,
large bodies built and encoded off the event loop, and a cap on a response's size.

Nothing here sleeps or races a timer: the tests wait on events that the executor, the
engine core or the encoder set.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from hybridkv.scheduler import FakeExecutor, StepBatch, StepResult
from hybridkv.serving.http.app import ServerOptions
from hybridkv.serving.openai import response_bodies as responses_module

MODEL = "fake-model"
#: 200 prompt tokens: with echo and 20 logprobs, 4,284 logprob entries (off the loop).
LONG_PROMPT = " ".join(f"w{2 + i % 60}" for i in range(200))
WAIT_S = 30  # how long an event may take to come before the test fails


def post(server: Any, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=WAIT_S)


def in_thread(function: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``function`` in a started thread; its result lands in the returned list."""
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(function()))
    thread.start()
    return thread, results


# -- priorities ----------------------------------------------------------------------------


@pytest.mark.parametrize("priority", [-100, 1, -(10**99)])
def test_fcfs_refuses_a_priority_naming_the_field_and_the_flag(server: Any, priority: int) -> None:
    """By default (FCFS) a priority other than 0 is a 400 naming 'priority' and the flag
    that would honour it; nothing is queued. Priority 0 is served."""
    response = post(server, {"prompt": "w2", "max_tokens": 1, "priority": priority})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "priority"
    assert "--scheduling-policy priority" in error["message"]
    assert len(error["message"]) < 300
    assert server.stats().num_waiting == 0
    ok = post(server, {"prompt": "w2", "max_tokens": 1, "priority": 0})
    assert ok.status_code == 200


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, 10**99])
def test_priority_scheduling_refuses_priorities_out_of_range(
    make_server: Any, priority: int
) -> None:
    """With --scheduling-policy priority a priority outside the signed 64-bit range is a
    400 naming the field; one inside it is served."""
    server = make_server(scheduling_policy="priority")
    response = post(server, {"prompt": "w2", "max_tokens": 1, "priority": priority})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "priority" and "signed 64-bit" in error["message"]
    for ok in (-(2**63), -5, 2**63 - 1):
        assert post(server, {"prompt": "w2", "max_tokens": 1, "priority": ok}).status_code == 200


# -- one request's copies ------------------------------------------------------------------


class GateExecutor(FakeExecutor):
    """The fake, recording each batch's request ids; its first step waits to be released."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[str]] = []
        self.first_step = threading.Event()
        self.release = threading.Event()

    def execute(self, batch: StepBatch) -> StepResult:
        self.batches.append([r.request_id for r in batch.requests])
        if not self.first_step.is_set():
            self.first_step.set()
            self.release.wait(WAIT_S)
        return super().execute(batch)


@pytest.fixture
def gated(make_server: Any) -> Iterator[Any]:
    server = make_server(executor_class=GateExecutor, max_num_seqs=4, max_running_share=0.5)
    yield server
    server.executor.release.set()


def test_one_request_with_many_choices_cannot_take_every_slot(gated: Any) -> None:
    """n=4 on 4 slots with a share of 0.5 runs 2 choices at once; a request sent after it
    is admitted and finishes while the other 2 choices still wait, and then they run."""
    executor: GateExecutor = gated.executor
    queued = threading.Event()
    core = gated.engine.core
    add_request = core.add_request

    def add_and_signal(*args: Any, **kwargs: Any) -> Any:
        request = add_request(*args, **kwargs)
        if request.params.parent_id is None:
            queued.set()  # the fresh request is in the waiting queue
        return request

    gated.portal.call(setattr, core, "add_request", add_and_signal)
    body = {"prompt": "w2 w3", "max_tokens": 30, "ignore_eos": True}
    many, many_result = in_thread(lambda: post(gated, {**body, "n": 4}))
    try:
        assert executor.first_step.wait(WAIT_S)
        first = executor.batches[0]
        assert len(first) == 2 and all(rid.endswith(("-0", "-1")) for rid in first)
        fresh, fresh_result = in_thread(lambda: post(gated, {**body, "max_tokens": 2}))
        assert queued.wait(WAIT_S)
    finally:
        executor.release.set()
    fresh.join(WAIT_S)
    many.join(WAIT_S)
    assert fresh_result[0].status_code == 200
    assert fresh_result[0].json()["usage"]["completion_tokens"] == 2
    assert many_result[0].status_code == 200
    assert len(many_result[0].json()["choices"]) == 4
    parent = first[0].rsplit("-", 1)[0]
    steps_of = {
        rid: [i for i, batch in enumerate(executor.batches) if rid in batch]
        for rid in {rid for batch in executor.batches for rid in batch}
    }
    (fresh_id,) = [rid for rid in steps_of if not rid.startswith(parent)]
    later = [steps_of[f"{parent}-{i}"][0] for i in (2, 3)]
    assert max(steps_of[fresh_id]) < min(later)  # done before the waiting choices began


# -- large answers -------------------------------------------------------------------------


@pytest.fixture
def blocking_encoder(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Wraps the service's encoder: a call off the loop's thread signals ``entered`` and
    waits for ``release``; every call's thread is recorded."""
    state: dict[str, Any] = {
        "entered": threading.Event(),
        "release": threading.Event(),
        "threads": [],
    }
    encode = responses_module.encode_json

    def wrapped(value: object, max_bytes: int) -> bytes:
        state["threads"].append(threading.get_ident())
        if threading.get_ident() != state.get("loop"):
            state["entered"].set()
            state["release"].wait(WAIT_S)
        return encode(value, max_bytes)

    monkeypatch.setattr(responses_module, "encode_json", wrapped)
    yield state
    state["release"].set()


def test_a_large_body_is_encoded_off_the_loop(server: Any, blocking_encoder: Any) -> None:
    """echo + logprobs=20 over a 200-token prompt: the body is built and encoded in a
    worker thread, and /health answers while that encoder is held; the body is whole."""
    blocking_encoder["loop"] = server.portal.call(threading.get_ident)
    body = {"prompt": LONG_PROMPT, "max_tokens": 3, "echo": True, "logprobs": 20}
    worker, result = in_thread(lambda: post(server, {**body, "ignore_eos": True}))
    try:
        assert blocking_encoder["entered"].wait(WAIT_S)
        health = httpx.get(f"{server.url}/health", timeout=WAIT_S)
        assert health.status_code == 200  # the loop answers while the body is encoded
        assert worker.is_alive() and not result
    finally:
        blocking_encoder["release"].set()
    worker.join(WAIT_S)
    response = result[0]
    assert response.status_code == 200
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 203 and len(logprobs["top_logprobs"]) == 203
    assert blocking_encoder["loop"] not in blocking_encoder["threads"]


def test_a_small_body_is_encoded_on_the_loop(server: Any, blocking_encoder: Any) -> None:
    """A body without logprobs takes no thread hop: its encoder runs on the loop."""
    blocking_encoder["loop"] = server.portal.call(threading.get_ident)
    response = post(server, {"prompt": "w2", "max_tokens": 2, "logprobs": 1})
    assert response.status_code == 200
    assert blocking_encoder["threads"] == [blocking_encoder["loop"]]


def test_a_large_stream_event_is_encoded_off_the_loop(server: Any, blocking_encoder: Any) -> None:
    """Streamed with echo, the event carrying the prompt's logprobs is built and encoded
    in a worker thread; the stream is complete."""
    blocking_encoder["loop"] = server.portal.call(threading.get_ident)
    blocking_encoder["release"].set()  # record only
    body = {"prompt": LONG_PROMPT, "max_tokens": 2, "echo": True, "logprobs": 20}
    response = post(server, {**body, "ignore_eos": True, "stream": True})
    assert response.status_code == 200
    events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 202
    assert any(t != blocking_encoder["loop"] for t in blocking_encoder["threads"])


def test_a_response_over_the_limit_is_a_400_naming_it(make_server: Any) -> None:
    """Past --max-response-size the answer is a 400 naming the limit and the flag, whole
    or streamed (an error event); a smaller answer under the same limit is served."""
    server = make_server(options=ServerOptions(max_response_bytes=8192))
    body = {"prompt": LONG_PROMPT, "max_tokens": 2, "echo": True, "logprobs": 20}
    response = post(server, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "response_too_large"
    assert "8192 bytes" in error["message"] and "--max-response-size" in error["message"]
    streamed = post(server, {**body, "stream": True})
    events = [line[6:] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "response_too_large"
    assert events[-1] == "[DONE]"
    assert post(server, {"prompt": "w2", "max_tokens": 2}).status_code == 200


# -- the flags -----------------------------------------------------------------------------


@pytest.mark.usefixtures("command_isolation")  # the command configures logging: undone
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-running-share", "0"], "--max-running-share must be in (0, 1], got 0.0"),
        (["--max-running-share", "nan"], "--max-running-share must be in (0, 1]"),
        (["--max-response-size", "0"], "--max-response-size must be at least 1 byte"),
    ],
)
def test_serve_refuses_bad_fairness_flags_before_loading(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """A bad value is a one-line error and exit status 2, before any model loads."""
    from hybridkv.serving.cli.main import main

    assert main(["serve", "no-such-model", "--port", "0", *flags]) == 2
    assert message in capsys.readouterr().err


def test_scheduling_flags_make_the_engine_config_fields() -> None:
    """--scheduling-policy and --max-running-share become EngineConfig fields."""
    import argparse

    from hybridkv.serving.cli.flags.engine import add_scheduling_arguments, scheduling_options

    parser = argparse.ArgumentParser()
    add_scheduling_arguments(parser)
    assert scheduling_options(parser.parse_args([])) == {
        "scheduling_policy": "fcfs",
        "max_running_share": 0.5,
    }
    args = parser.parse_args(["--scheduling-policy", "priority", "--max-running-share", "1"])
    assert scheduling_options(args) == {"scheduling_policy": "priority", "max_running_share": 1.0}
