"""Bad requests get a 4xx (or 503) with an OpenAI error body, and the server goes on."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest

from hybridkv.scheduler import FakeExecutor, StepBatch, StepResult
from hybridkv.serving.http.app import ServerOptions

MODEL = "fake-model"


def post(server: Any, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(f"{server.url}{path}", json=body, timeout=10)
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=10)


def test_unknown_model_is_not_found(client: Any) -> None:
    """Naming a model the server does not serve is a 404 with code model_not_found."""
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="w2", max_tokens=2)
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_non_positive_max_tokens_is_a_bad_request(client: Any, max_tokens: int) -> None:
    """max_tokens <= 0 is a 400."""
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="w2", max_tokens=max_tokens)


def test_max_tokens_beyond_the_context_is_a_bad_request(client: Any) -> None:
    """max_tokens that cannot fit after the prompt is a 400."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="w2 w3", max_tokens=1000)
    assert info.value.code == "context_length_exceeded"


def test_prompt_over_the_limit_is_a_bad_request(client: Any) -> None:
    """A prompt as long as the context is a 400."""
    prompt = " ".join(["w5"] * 300)
    with pytest.raises(openai.BadRequestError, match="context is 256 tokens"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1
        )


def test_malformed_json_is_a_bad_request(server: Any) -> None:
    """A body that is not JSON gets a 400 with an error body."""
    response = post(server, "/v1/completions", b'{"model": "fake-model", "prompt": ')
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_missing_prompt_is_a_bad_request(server: Any) -> None:
    """A completion without a prompt names the missing field."""
    response = post(server, "/v1/completions", {"model": MODEL})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "prompt")


def test_oversized_body_is_refused(make_server: Any) -> None:
    """A body over the limit is a 413, whatever it holds."""
    server = make_server(options=ServerOptions(max_body_bytes=1024))
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "w2 " * 1000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_unknown_path_is_an_error_body(server: Any) -> None:
    """An unknown path is a 404 with an OpenAI-style body."""
    response = httpx.get(f"{server.url}/v1/engines", timeout=10)
    assert response.status_code == 404
    assert "error" in response.json()


def test_wrong_method_is_refused(server: Any) -> None:
    """GET on a POST route is a 405."""
    assert httpx.get(f"{server.url}/v1/completions", timeout=10).status_code == 405


class GatedExecutor(FakeExecutor):
    """The fake, whose steps wait until the test opens the gate (a step in flight that
    never finishes on its own: the running request stays running however slow the test)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stepping = threading.Event()
        self.gate = threading.Event()

    def execute(self, batch: StepBatch) -> StepResult:
        self.stepping.set()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super().execute(batch)


def test_full_queue_is_service_unavailable(make_server: Any) -> None:
    """Beyond max_waiting queued requests, the server answers 503 and keeps the others."""
    server = make_server(executor_class=GatedExecutor, max_num_seqs=1, max_waiting=1)
    body = {"model": MODEL, "prompt": "w2 w3", "max_tokens": 4, "stream": True}
    try:
        with (
            httpx.Client(base_url=server.url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as running,
        ):
            assert running.status_code == 200
            assert server.executor.stepping.wait(timeout=60)  # the first request runs
            with http.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200  # queued behind it
                refused = http.post("/v1/completions", json=body)
    finally:
        server.executor.gate.set()
    assert refused.status_code == 503
    assert "max_waiting=1" in refused.json()["error"]["message"]


def test_server_keeps_serving_after_bad_requests(client: Any, server: Any) -> None:
    """After a run of bad requests, a good one still succeeds and no page is held."""
    post(server, "/v1/completions", b"not json")
    post(server, "/v1/completions", {"model": MODEL, "prompt": "w2", "max_tokens": 0})
    post(server, "/v1/chat/completions", {"model": MODEL, "messages": "hi"})
    out = client.completions.create(model=MODEL, prompt="w2 w3", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    server.wait_until_free()


class FailingExecutor(FakeExecutor):
    """Fails every step that runs a position past 8: long requests fail, short ones pass."""

    def execute(self, batch: StepBatch) -> StepResult:
        if any(r.start_position + r.num_tokens > 8 for r in batch.requests):
            raise RuntimeError("the model crashed")
        return super().execute(batch)


def test_failed_generation_is_a_server_error(make_server: Any) -> None:
    """A request whose step fails gets a 500 error body; a short one then succeeds."""
    server = make_server(executor_class=FailingExecutor)
    body = {"model": MODEL, "prompt": "w2 w3", "max_tokens": 20, "ignore_eos": True}
    failed = post(server, "/v1/completions", body)
    assert (failed.status_code, failed.json()["error"]["type"]) == (500, "server_error")
    ok = post(server, "/v1/completions", {**body, "max_tokens": 3})
    assert ok.json()["usage"]["completion_tokens"] == 3


def test_failed_stream_ends_with_an_error_event(make_server: Any) -> None:
    """A streamed request whose step fails ends with an error event the client raises."""
    server = make_server(executor_class=FailingExecutor)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        stream = client.completions.create(
            model=MODEL, prompt="w2 w3", max_tokens=20, stream=True, extra_body={"ignore_eos": True}
        )
        with pytest.raises(openai.APIError, match="the model crashed"):
            list(stream)
