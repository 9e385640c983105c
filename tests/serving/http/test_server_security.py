"""Access: the API key (Bearer, as vLLM), JSON-only bodies, the Host allow-list."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from hybridkv.serving.http.app import ServerOptions
from hybridkv.serving.http.guard import host_name, is_allowed_host

MODEL = "fake-model"
KEY = "sk-test-0123456789"
BODY = {"model": MODEL, "prompt": "w2", "max_tokens": 2}


@pytest.fixture
def keyed(make_server: Any) -> Any:
    """A server that wants the API key."""
    return make_server(options=ServerOptions(api_key=KEY))


def test_official_client_with_the_key_is_served(keyed: Any) -> None:
    """The openai client sending the key as its api_key gets completions."""
    with openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0) as client:
        assert client.completions.create(**BODY).usage.completion_tokens == 2


def test_wrong_or_missing_key_is_unauthorized(keyed: Any) -> None:
    """Without the key, or with another, the client gets AuthenticationError (401)."""
    with (
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        client.completions.create(**BODY)
    assert info.value.code == "invalid_api_key"
    bare = httpx.post(f"{keyed.url}/v1/completions", json=BODY, timeout=10)
    assert (bare.status_code, bare.headers["www-authenticate"]) == (401, "Bearer")


@pytest.mark.parametrize("path", ["/v1/models", "/tokenize", "/detokenize"])
def test_key_guards_api_paths(keyed: Any, path: str) -> None:
    """The /v1 routes and the tokenizer routes need the key."""
    method = "GET" if path == "/v1/models" else "POST"
    with httpx.Client(timeout=10) as http:
        assert http.request(method, f"{keyed.url}{path}", json={}).status_code == 401


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_monitoring_paths_stay_open(keyed: Any, path: str) -> None:
    """Health, metrics and version answer without the key, as vLLM's do."""
    assert httpx.get(f"{keyed.url}{path}", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("content_type", "content"),
    [
        ("text/plain", b'{"model": "fake-model", "prompt": "w2"}'),
        ("application/x-www-form-urlencoded", b"model=fake-model&prompt=w2"),
        ("multipart/form-data; boundary=x", b"--x--"),
        (None, b'{"model": "fake-model", "prompt": "w2"}'),
    ],
)
def test_only_json_bodies_are_read(server: Any, content_type: str | None, content: bytes) -> None:
    """A form post (what any web page can send cross-origin) is a 415, never generated."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = httpx.post(f"{server.url}/v1/completions", content=content, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (
        415,
        "unsupported_media_type",
    )
    assert server.executor.num_steps == 0


def test_json_with_a_charset_is_read(server: Any) -> None:
    """application/json; charset=utf-8 is JSON."""
    headers = {"Content-Type": "application/json; charset=utf-8"}
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"model": "fake-model", "prompt": "w2"}',
        headers=headers,
    )
    assert response.status_code == 200


def test_host_allow_list_refuses_other_names(make_server: Any) -> None:
    """With allowed hosts set, a request naming another Host (DNS rebinding) is a 400."""
    server = make_server(options=ServerOptions(allowed_hosts=("localhost", "127.0.0.1")))
    evil = httpx.get(f"{server.url}/health", headers={"Host": "evil.example"}, timeout=10)
    assert (evil.status_code, evil.json()["error"]["code"]) == (400, "invalid_host")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # Host 127.0.0.1
    local = httpx.get(f"{server.url}/health", headers={"Host": "localhost:8000"}, timeout=10)
    assert local.status_code == 200


@pytest.mark.parametrize(
    ("header", "name"),
    [("Example.com:8000", "example.com"), ("[::1]:8000", "::1"), ("::1", "::1"), ("a.b", "a.b")],
)
def test_host_names_drop_the_port(header: str, name: str) -> None:
    """Host header parsing handles ports and IPv6 brackets."""
    assert host_name(header) == name


def test_wildcard_hosts_match_subdomains_only() -> None:
    """*.example.com matches api.example.com, not example.com.evil."""
    allowed = ["*.example.com"]
    assert is_allowed_host("api.example.com", allowed)
    assert not is_allowed_host("example.com.evil", allowed)
    assert not is_allowed_host("evilexample.com", allowed)
