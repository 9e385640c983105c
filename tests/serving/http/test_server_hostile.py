"""Probes of one hostile client at a time, from outside, each a regression bar: the
request is refused with a 4xx naming the problem, the process lives, nothing is queued,
and the next request on another connection is served."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from grammar_samples import chained_gbnf, chained_lark

from hybridkv.executor.grammar_bounds import GrammarLimits
from hybridkv.serving.http.app import ServerOptions

MODEL = "fake-model"
PROMPT = "The sea is"


def post(server: Any, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def assert_still_serving(server: Any) -> None:
    """/health answers, and a plain and a constrained request on new connections are served."""
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert post(server).status_code == 200
    choice = post(server, guided_choice=["north", "south"], max_tokens=8)
    assert choice.status_code == 200
    assert choice.json()["choices"][0]["text"] in ("north", "south")


@pytest.fixture
def sampling(make_sampling_server: Any) -> Any:
    return make_sampling_server()


@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        ({"guided_grammar": chained_lark(3000)}, "guided_grammar", "3002 rule definitions"),
        ({"guided_grammar": chained_gbnf(10_000)}, "guided_grammar", "bytes; the limit is"),
        (
            {"guided_choice": [f"word{i}" for i in range(100_000)]},
            "guided_choice",
            "100000 entries; the limit is 1000",
        ),
        (
            {"guided_choice": [f"w{i}" for i in range(2000)]},
            "guided_choice",
            "2000 entries; the limit is 1000",
        ),
        (
            {"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(2000))},
            "guided_grammar",
            "rule 'start' has 2000 alternatives; the limit is 1000",
        ),
        (
            {"structured_outputs": {"regex": "(" * 200 + "a" + ")" * 200}},
            "structured_outputs.regex",
            "200 nested groups",
        ),
        ({"guided_grammar": "garbage"}, "guided_grammar", "the grammar defines no rule"),
        ({"guided_grammar": "x ::"}, "guided_grammar", "the grammar defines no rule"),
    ],
)
def test_grammars_over_a_bound_are_refused_before_llguidance(
    sampling: Any, fields: dict[str, Any], param: str, match: str
) -> None:
    """A grammar that would crash llguidance, or stall every request while it compiles,
    is a 400 naming the field and the limit; nothing was queued."""
    response = post(sampling, **fields)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and match in error["message"]
    assert sampling.executor.num_steps == 0
    assert_still_serving(sampling)


def test_a_grammar_that_crashes_llguidance_costs_the_checker_not_the_server(
    make_sampling_server: Any,
) -> None:
    """With the bounds lifted, the grammar that overflows llguidance's stack reaches it: in
    the checker's child process, so the answer is a 400, and the server serves on."""
    lifted = GrammarLimits(
        max_grammar_bytes=1 << 24, max_rules=1 << 20, max_reference_depth=1 << 20
    )
    server = make_sampling_server(options=ServerOptions(grammar_limits=lifted))
    response = post(server, guided_grammar=chained_lark(3000))
    assert response.status_code == 400
    assert "crashed the grammar compiler" in response.json()["error"]["message"]
    assert server.executor.num_steps == 0
    assert_still_serving(server)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": "[" * 1500 + "]" * 1500}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "deep", "schema": '{"a":' * 1500 + "1" + "}" * 1500},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"guided_json": '{"type": "integer", "maximum": ' + "9" * 5000 + "}"}, "guided_json"),
    ],
)
def test_json_inside_a_string_has_the_bodys_limits(
    sampling: Any, fields: dict[str, Any], param: str
) -> None:
    """A schema sent as a string nested 1,500 deep, or holding a 5,000-digit number, is
    refused as the same body would be: a 400 naming the field (it was a 500)."""
    response = post(sampling, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert_still_serving(sampling)


@pytest.mark.parametrize("key", ["²", "1" * 5000, "-1", " 7", "٣"])
def test_logit_bias_keys_are_ascii_token_ids(server: Any, key: str) -> None:
    """Keys that ``str.isdigit`` takes and ``int()`` refuses (superscripts, 5,000 digits,
    other scripts' digits) are a 400 naming ``logit_bias``, as are signs and spaces."""
    response = post(server, logit_bias={key: 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and "token ids" in error["message"]
    assert len(error["message"]) < 300  # a 5,000-digit key is shown cut


def test_a_refused_grammar_is_never_a_request_that_samples_only_eos(sampling: Any) -> None:
    """llguidance's refusal at compile time is a 400 before queueing (the server compiles
    ahead of the steps), not an empty 200."""
    response = post(sampling, guided_grammar="start: nowhere")
    assert response.status_code == 400
    assert "does not compile" in response.json()["error"]["message"]
    assert sampling.executor.num_steps == 0
    assert json.loads(post(sampling, guided_json={"type": "integer"}).json()["choices"][0]["text"])
