"""A client that goes away mid-request aborts it, and its pages are freed."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

MODEL = "fake-model"
LONG = {"model": MODEL, "prompt": "w2 w3 w4 w5", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture
def slow_server(make_server: Any) -> Any:
    """A server whose steps take 20 ms, so a 200-token request runs for seconds."""
    return make_server(step_delay_s=0.02)


def test_stream_disconnect_aborts_and_frees_pages(slow_server: Any) -> None:
    """Closing a stream after a few chunks ends the request well before max_tokens."""
    body = {**LONG, "stream": True}
    with (
        httpx.Client(base_url=slow_server.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        for _ in range(3):
            next(lines)
    slow_server.wait_until_free()
    assert slow_server.executor.num_steps < 150


def test_non_streamed_disconnect_aborts_and_frees_pages(slow_server: Any) -> None:
    """A client that times out on a whole response aborts its request."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_server.url}/v1/completions", json=LONG, timeout=0.5)
    slow_server.wait_until_free()
    assert slow_server.executor.num_steps < 150


def test_disconnect_is_counted_as_an_abort(slow_server: Any) -> None:
    """The metrics count a request whose client left as finished with reason abort."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_server.url}/v1/completions", json=LONG, timeout=0.5)
    slow_server.wait_until_free()
    metrics = httpx.get(f"{slow_server.url}/metrics", timeout=10).text
    assert 'hybridkv_requests_finished_total{reason="abort"} 1.0' in metrics


def test_server_serves_after_a_disconnect(slow_server: Any) -> None:
    """A later request completes normally after a client disconnected."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_server.url}/v1/completions", json=LONG, timeout=0.5)
    body = {"model": MODEL, "prompt": "w2", "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{slow_server.url}/v1/completions", json=body, timeout=30)
    assert response.json()["usage"]["completion_tokens"] == 3


def test_a_graceful_shutdown_ends_open_streams_with_an_error_event(slow_server: Any) -> None:
    """When the server begins to stop (SIGTERM, Ctrl-C), a stream in flight ends with
    an error event saying so and ``[DONE]``, not a cut connection; its pages are freed."""
    body = {**LONG, "stream": True}
    with (
        httpx.Client(base_url=slow_server.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = (line for line in stream.iter_lines() if line.startswith("data: "))
        assert '"text"' in next(lines)
        slow_server.begin_shutdown()
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["message"] == "the server is shutting down"
    assert error["type"] == "ServiceUnavailableError"
    slow_server.wait_until_free()
    assert slow_server.executor.num_steps < 150


@pytest.mark.anyio
async def test_the_shutdown_cancels_the_open_streams_and_any_opened_after_it() -> None:
    import anyio

    from hybridkv.serving.http.streaming import Stopping

    stopping = Stopping()
    with anyio.CancelScope() as open_before:
        stopping.register(open_before)
        stopping.set()
        await anyio.sleep_forever()  # cancelled at its first wait
    with anyio.CancelScope() as opened_after:
        stopping.register(opened_after)
        await anyio.sleep_forever()
    assert open_before.cancelled_caught and opened_after.cancelled_caught
    assert stopping.is_set()
