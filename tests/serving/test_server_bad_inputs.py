"""Hostile and malformed requests are 4xx with an OpenAI error body, counted in the
metrics, and the server keeps serving; none is a 500."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from hybridkv.serving.chat import ChatTemplate

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
    from hybridkv.serving.app import ServerOptions

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


def test_unknown_fields_are_refused_by_name(client: Any) -> None:
    """A misspelt field is a 400 naming it, never silently ignored."""
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
    """Tools and request-supplied templates are refused on chat, naming the field."""
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
