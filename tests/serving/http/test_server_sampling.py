"""Sampling fields through the server with the official client: structured output,
logit bias, min-p, penalties, seeds, truncation. The executor is the fake with real
logits and the real sampler (conftest's SamplingFakeExecutor) over a byte vocabulary."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

MODEL = "fake-model"
PROMPT = "The sea is"


@pytest.fixture
def sampling(make_sampling_server: Any) -> Any:
    """A server whose tokens come from the real sampler over random logits."""
    return make_sampling_server()


@pytest.fixture
def client(sampling: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{sampling.url}/v1", api_key="-", max_retries=0) as c:
        yield c


def complete(client: openai.OpenAI, **fields: Any) -> str:
    fields.setdefault("max_tokens", 40)
    out = client.completions.create(model=MODEL, prompt=PROMPT, **fields)
    return out.choices[0].text


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


def test_json_schema_response_format_gives_valid_json(client: openai.OpenAI) -> None:
    """response_format json_schema: the content parses and follows the schema."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a city"}],
        max_tokens=80,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )
    value = json.loads(out.choices[0].message.content or "")
    assert set(value) == {"city", "rank"} and isinstance(value["rank"], int)
    assert out.choices[0].finish_reason == "stop"


def test_json_object_response_format_gives_an_object(
    client: openai.OpenAI, byte_tokenizer: Tokenizer
) -> None:
    """response_format json_object: any JSON object, sampled at temperature 1 (a bias
    towards closing quotes and braces keeps it short)."""
    bias = {str(byte_tokenizer.token_to_id(c)): 8 for c in '"}'}
    for seed in range(3):
        text = complete(
            client,
            max_tokens=200,
            seed=seed,
            logit_bias=bias,
            extra_body={"response_format": {"type": "json_object"}},
        )
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"guided_regex": "[0-9]{3}-[a-z]{2,5}"}, r"[0-9]{3}-[a-z]{2,5}"),
        ({"guided_choice": ["north", "south"]}, "north|south"),
        ({"guided_grammar": 'start: "yes" | "no"'}, "yes|no"),
        ({"guided_json": {"type": "integer"}}, r"-?[0-9]+"),
        ({"structured_outputs": {"regex": "a+b"}}, "a+b"),
    ],
)
def test_guided_fields_constrain_the_text(
    client: openai.OpenAI, fields: dict[str, Any], pattern: str
) -> None:
    """vLLM's guided_* and structured_outputs fields constrain the text, seeded draws."""
    for seed in range(3):
        assert re.fullmatch(pattern, complete(client, seed=seed, extra_body=fields))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_bad_constraints_are_refused_by_name(
    sampling: Any, fields: dict[str, Any], param: str
) -> None:
    """A constraint that does not compile, or two at once, is a 400 naming the field."""
    body = {"model": MODEL, "prompt": PROMPT, **fields}
    response = httpx.post(f"{sampling.url}/v1/completions", json=body, timeout=30)
    assert (response.status_code, response.json()["error"]["param"]) == (400, param)
    assert sampling.executor.num_steps == 0


def test_logit_bias_forces_a_token(client: openai.OpenAI, byte_tokenizer: Tokenizer) -> None:
    """A +100 bias on "A" makes a greedy completion all A's."""
    a = byte_tokenizer.token_to_id("A")
    text = complete(client, max_tokens=6, temperature=0.0, logit_bias={str(a): 100})
    assert text == "AAAAAA"


def test_logit_bias_bans_a_token(client: openai.OpenAI, byte_tokenizer: Tokenizer) -> None:
    """A -100 bias keeps the greedy argmax token out of the text."""
    greedy = complete(client, max_tokens=1, temperature=0.0)
    banned = byte_tokenizer.encode(greedy).ids[0]
    text = complete(client, max_tokens=1, temperature=0.0, logit_bias={str(banned): -100})
    assert text != greedy


def test_logit_bias_outside_the_vocabulary_is_refused(client: openai.OpenAI) -> None:
    """A bias on a token id past the vocabulary is a 400 naming logit_bias."""
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, logit_bias={"99999": 5})
    assert info.value.body["param"] == "logit_bias"  # type: ignore[index]


def test_min_p_one_is_greedy(client: openai.OpenAI) -> None:
    """min_p=1 keeps only the most likely token: sampling at temperature 1 is greedy."""
    greedy = complete(client, temperature=0.0)
    assert complete(client, temperature=1.0, seed=5, extra_body={"min_p": 1.0}) == greedy


def test_penalties_change_greedy_text(client: openai.OpenAI) -> None:
    """Presence, frequency and repetition penalties reach the sampler (tests/models checks
    their values against a reference)."""
    plain = complete(client, temperature=0.0, max_tokens=60)
    for fields in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 1.8}},
    ):
        assert complete(client, temperature=0.0, max_tokens=60, **fields) != plain


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    """A seeded request is reproducible; another seed gives other text."""
    first = complete(client, seed=11)
    assert complete(client, seed=11) == first
    assert complete(client, seed=12) != first


def test_seeded_copies_differ(client: openai.OpenAI) -> None:
    """n copies of a seeded request use seeds seed, seed+1, ...: they differ, as vLLM's."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, n=3, seed=4)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3
    assert texts[0] == complete(client, seed=4, max_tokens=20)


def test_truncate_prompt_tokens_keeps_the_end(client: openai.OpenAI) -> None:
    """truncate_prompt_tokens keeps the prompt's last k tokens."""
    out = client.completions.create(
        model=MODEL, prompt="abcdefghij", max_tokens=1, extra_body={"truncate_prompt_tokens": 4}
    )
    assert out.usage.prompt_tokens == 4
    same = client.completions.create(model=MODEL, prompt="ghij", max_tokens=8, temperature=0.0)
    cut = client.completions.create(
        model=MODEL,
        prompt="abcdefghij",
        max_tokens=8,
        temperature=0.0,
        extra_body={"truncate_prompt_tokens": 4},
    )
    assert cut.choices[0].text == same.choices[0].text


def test_truncate_beyond_the_context_is_refused(client: openai.OpenAI) -> None:
    """truncate_prompt_tokens over max_model_len is a 400 naming it."""
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, extra_body={"truncate_prompt_tokens": 10_000})
    assert info.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


#: A schema that says nothing of other properties: closed by default, as vLLM's default
#: backend (xgrammar's strict mode) treats it.
OPEN_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _json_outputs(client: openai.OpenAI, **options: Any) -> list[str]:
    texts = []
    for seed in range(6):
        texts.append(
            complete(
                client,
                max_tokens=60,
                seed=seed,
                temperature=1.0,
                extra_body={"structured_outputs": {"json": OPEN_SCHEMA, **options}},
            )
        )
    return texts


def test_json_output_holds_no_unlisted_property_by_default(client: openai.OpenAI) -> None:
    for text in _json_outputs(client):
        assert set(json.loads(text)) == {"n"}, text


def test_disable_any_whitespace_gives_compact_json(client: openai.OpenAI) -> None:
    texts = _json_outputs(client, disable_any_whitespace=True)
    for text in texts:
        assert set(json.loads(text)) == {"n"} and not re.search(r"\s", text), text


def test_the_server_may_allow_unlisted_properties(make_sampling_server: Any) -> None:
    """ServerOptions(additional_properties=True) (``--structured-outputs-config
    '{"disable_additional_properties": false}'``): the grammar lets other keys in, which
    the random logits then write in some outputs."""
    from hybridkv.serving.http.app import ServerOptions

    server = make_sampling_server(options=ServerOptions(additional_properties=True))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        texts = _json_outputs(c)
    # An open object may run past max_tokens inside a string: read the keys as written.
    keys = [set(re.findall(r'"((?:[^"\\]|\\.)*)"\s*:', t)) for t in texts]
    assert any(k - {"n"} for k in keys), texts
