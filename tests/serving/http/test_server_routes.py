"""The routes vLLM users expect beside generation: /tokenize, /detokenize, /version,
/v1/models/{model}, and /load for a router."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from hybridkv.serving.openai.chat_template import ChatTemplate

MODEL = "fake-model"


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=10)


def test_tokenize_a_prompt(server: Any, word_tokenizer: Tokenizer) -> None:
    """/tokenize gives vLLM's body: count, max_model_len, tokens, token strings if asked."""
    body = post(
        server, "/tokenize", {"model": MODEL, "prompt": "w2 w3 w4", "return_token_strs": True}
    )
    assert body.json() == {
        "count": 3,
        "max_model_len": 256,
        "tokens": word_tokenizer.encode("w2 w3 w4").ids,
        "token_strs": ["w2", "w3", "w4"],
    }


def test_tokenize_messages_renders_the_template(server: Any, word_tokenizer: Tokenizer) -> None:
    """/tokenize with messages counts the rendered chat prompt, as generation sees it."""
    messages = [{"role": "user", "content": "w5 w6"}]
    text = ChatTemplate.plain().render(messages)
    body = post(server, "/tokenize", {"messages": messages}).json()
    assert body["tokens"] == word_tokenizer.encode(text).ids
    assert body["token_strs"] is None


def test_tokenize_counts_a_prompt_longer_than_the_context(server: Any) -> None:
    """A text longer than the context is counted, not refused."""
    body = post(server, "/tokenize", {"prompt": "w2 " * 1000}).json()
    assert body["count"] == 1000


def test_detokenize_round_trips(server: Any, word_tokenizer: Tokenizer) -> None:
    """/detokenize gives the text of token ids."""
    ids = word_tokenizer.encode("w7 w8 w9").ids
    assert post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {
        "prompt": "w7 w8 w9"
    }


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, 10_000]}, "tokens"),
        ("/detokenize", {"tokens": "w2"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "w2", "extra": 1}, "extra"),
    ],
)
def test_bad_tokenizer_requests_name_the_field(
    server: Any, path: str, body: dict[str, Any], param: str
) -> None:
    """Bad bodies of the tokenizer routes are 400s naming the field."""
    response = post(server, path, body)
    assert (response.status_code, response.json()["error"]["param"]) == (400, param)


def test_tokenize_of_another_model_is_not_found(server: Any) -> None:
    """Naming another model is a 404, as on the generation routes."""
    assert post(server, "/tokenize", {"model": "gpt-9", "prompt": "w2"}).status_code == 404


def test_version(server: Any) -> None:
    """/version gives the package version."""
    from importlib import metadata

    response = httpx.get(f"{server.url}/version", timeout=10)
    assert response.json() == {"version": metadata.version("hybridkv")}


def test_load_reports_the_queues_and_the_prompt_the_free_pages_hold(server: Any) -> None:
    """/load gives what a router weighs: the queues, the free pages, and the longest
    prompt they hold now (the bisection of ``memory/headroom.py`` over this pool)."""
    from hybridkv.memory.headroom import token_headroom

    post(server, "/v1/completions", {"model": MODEL, "prompt": "w2 w3 w4", "max_tokens": 4})
    load = httpx.get(f"{server.url}/load", timeout=10).json()
    stats = server.stats()
    kv = server.engine.core.kv
    assert (load["num_waiting"], load["num_running"]) == (0, 0)
    assert (load["num_free_blocks"], load["num_blocks"]) == (
        stats.num_free_blocks,
        stats.num_blocks,
    )
    assert load["kv_usage"] == 0.0  # the finished request's pages are cached and free
    card = httpx.get(f"{server.url}/v1/models/{MODEL}", timeout=10).json()
    headroom = token_headroom(kv, stats.num_free_blocks, card["max_model_len"])
    assert load["free_tokens"] == headroom > 0


def test_retrieve_the_model(client: Any) -> None:
    """The official client's models.retrieve gets the served model's card."""
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "hybridkv")


def test_retrieve_another_model_is_not_found(client: Any) -> None:
    """Retrieving a model this server does not serve is a NotFoundError."""
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")
