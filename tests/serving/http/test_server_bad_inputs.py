"""Hostile and malformed requests are 4xx with an OpenAI error body, counted in the
metrics, and the server keeps serving; none is a 500."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from hybridkv.serving.openai.chat_template import ChatTemplate

MODEL = "fake-model"
JSON = {"Content-Type": "application/json"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w2"}], "max_tokens": 2}


def post_raw(server: Any, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=raw, headers=JSON, timeout=30)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"model": "fake-model", "prompt": "w2", "temperature": NaN}', "NaN"),
        (b'{"model": "fake-model", "prompt": "w2", "top_p": Infinity}', "Infinity"),
        (b'{"model": "fake-model", "prompt": "w2 \\ud800"}', "surrogate"),
        (b'{"model": "fake-model", "prompt": "w2", "seed": ' + b"7" * 5000 + b"}", "digits"),
        (b'{"model": "fake-model", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeper"),
    ],
)
def test_malformed_numbers_text_and_nesting_are_bad_requests(
    server: Any, raw: bytes, match: str
) -> None:
    """NaN, infinity, a lone surrogate, a 5000-digit integer, 100k brackets: all 400."""
    response = post_raw(server, "/v1/completions", raw)
    assert response.status_code == 400
    assert match in response.json()["error"]["message"]


def test_lone_surrogate_in_a_message_is_a_bad_request(server: Any) -> None:
    """A chat message holding a lone surrogate is a 400."""
    raw = b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\udc00"}]}'
    assert post_raw(server, "/v1/chat/completions", raw).status_code == 400


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 5.0), ("top_p", -1.0), ("presence_penalty", 3.0)],
)
def test_out_of_range_sampling_values_name_the_field(client: Any, field: str, value: float) -> None:
    """Out-of-range numbers are a 400 naming the field (the official client)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="w2", extra_body={field: value})
    assert info.value.body["param"] == field  # type: ignore[index]


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{% include 'other.jinja' %}", "may not include"),
        ("{% import 'macros' as m %}{{ m.x() }}", "may not include"),
        ("{{ messages[0].content + 1 }}", "template failed"),
        ("{{ raise_exception('no users') }}", "no users"),
        ("{% for m in messages %}{{ m.content | center(10**9) }}{% endfor %}", "at most"),
    ],
)
def test_every_template_error_is_a_bad_request(make_server: Any, source: str, match: str) -> None:
    """A template that includes, fails, refuses or blows up answers 400, not 500."""
    server = make_server(chat_template=ChatTemplate(source, is_builtin=False))
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 400, response.text
    assert match in response.json()["error"]["message"]


def test_a_slow_template_is_stopped_at_its_deadline(make_server: Any) -> None:
    """A template looping for minutes is refused once its time limit has passed."""
    from hybridkv.serving.http.app import ServerOptions

    # A billion iterations with empty bodies: only the range's own checks see them.
    loop = "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
    loop += "{% endfor %}{% endfor %}{% endfor %}"
    server = make_server(
        chat_template=ChatTemplate(loop, is_builtin=False),
        options=ServerOptions(template_timeout_s=0.3),
    )
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 400
    assert "ran longer than 0.3 s" in response.json()["error"]["message"]


#: Fields vLLM users' clients send that this server does not know.
VLLM_TOLERATED = {
    "service_tier": "auto",
    "reasoning_effort": "low",
    "verbosity": "low",
    "prompt_cache_key": "session-1",
    "safety_identifier": "user-1",
    "temprature": 0.5,  # a misspelling is named in the warning
}


def test_fields_this_server_does_not_know_are_ignored_with_one_warning(make_server: Any) -> None:
    """As vLLM: the request is served, and one warning per request names every field it
    ignored; guidellm's stream options stream the usage in every chunk."""
    from structlog.testing import capture_logs

    server = make_server()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    with capture_logs() as logs:
        done = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "w2 w3"}],
            max_tokens=3,
            extra_body=VLLM_TOLERATED,
        )
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt="w2",
                max_tokens=4,
                stream=True,
                stream_options=continuous,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True},
            )
        )
    assert done.choices[0].message.content is not None
    warnings = [e for e in logs if e["event"] == "request_fields_ignored"]
    assert [w["fields"] for w in warnings] == [sorted(VLLM_TOLERATED)]
    assert [w["log_level"] for w in warnings] == ["warning"]
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks and all(c.usage is not None for c in text_chunks)
    counts = [c.usage.completion_tokens for c in text_chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_strict_fields_refuse_an_unknown_field_by_name(make_server: Any) -> None:
    """ServerOptions(strict_fields=True) (``--strict-fields``): a 400 naming the field."""
    from hybridkv.serving.http.app import ServerOptions

    server = make_server(options=ServerOptions(strict_fields=True))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temprature") as info:
        client.completions.create(model=MODEL, prompt="w2", extra_body={"temprature": 0.5})
    assert info.value.body["param"] == "temprature"  # type: ignore[index]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", "the end"),
        ("use_beam_search", True),
        ("allowed_token_ids", [2, 3]),
        ("bad_words", ["w5"]),
        ("guided_whitespace_pattern", " "),
        ("guided_decoding_backend", "xgrammar"),
        ("spaces_between_special_tokens", False),
        ("logits_processors", ["x"]),
    ],
)
def test_unsupported_fields_are_refused_by_name(server: Any, field: str, value: object) -> None:
    """A known field this server does not implement is a 400 naming it."""
    body = {"model": MODEL, "prompt": "w2", field: value}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, field)
    assert "not supported" in error["message"]


@pytest.mark.parametrize(
    ("field", "value"), [("tools", [{"type": "function"}]), ("chat_template", "{{ x }}")]
)
def test_unsupported_chat_fields_are_refused_by_name(
    server: Any, field: str, value: object
) -> None:
    """Malformed tools and request-supplied templates are refused on chat, naming the field."""
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={**CHAT, field: value}, timeout=30
    )
    assert (response.status_code, response.json()["error"]["param"]) == (400, field)


def test_refusals_are_counted_and_nothing_is_a_server_error(server: Any) -> None:
    """After a run of bad inputs, /metrics counts them as 4xx, none as 500."""
    post_raw(server, "/v1/completions", b'{"model": "fake-model", "prompt": "w2", "n": NaN}')
    post_raw(server, "/v1/completions", b'{"model": "fake-model", "prompt": "\\ud801"}')
    httpx.post(f"{server.url}/v1/completions", content=b"{}", timeout=30)  # no Content-Type
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "w2"}, timeout=30
    )
    assert ok.status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'hybridkv_http_requests_total{endpoint="completions",status="400"} 2.0' in metrics
    assert 'hybridkv_http_requests_total{endpoint="completions",status="415"} 1.0' in metrics
    assert 'status="500"' not in metrics
    server.wait_until_free()
