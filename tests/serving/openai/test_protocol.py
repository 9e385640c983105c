"""Request parsing and checking: OpenAI bodies in, checked values or 4xx errors out."""

from __future__ import annotations

import pytest

from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.json_text import parse_json
from hybridkv.serving.openai.protocol import parse_chat, parse_completion


def completion(**fields: object) -> dict[str, object]:
    return {"model": "m", "prompt": "hello", **fields}


def test_completion_defaults_to_sixteen_tokens() -> None:
    """A completion without max_tokens gets OpenAI's default of 16."""
    assert parse_completion(completion()).max_tokens == 16


def test_chat_without_max_tokens_uses_the_context_left() -> None:
    """A chat request without max_tokens may run to the end of the context."""
    request = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert request.sampling_params(10, 100, None).max_tokens == 90


def test_max_completion_tokens_takes_precedence() -> None:
    """The newer max_completion_tokens field wins over max_tokens."""
    request = parse_completion(completion(max_tokens=5, max_completion_tokens=7))
    assert request.max_tokens == 7


@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_max_tokens_is_refused(value: int) -> None:
    """max_tokens <= 0 is a 400 naming the field."""
    with pytest.raises(APIError, match="'max_tokens' must be >= 1") as info:
        parse_completion(completion(max_tokens=value))
    assert (info.value.status, info.value.param) == (400, "max_tokens")


def test_max_tokens_beyond_the_context_is_refused() -> None:
    """Prompt plus max_tokens over the context is a 400 saying how many fit."""
    request = parse_completion(completion(max_tokens=50))
    with pytest.raises(APIError, match="at most 20 fit") as info:
        request.sampling_params(80, 100, None)
    assert info.value.code == "context_length_exceeded"


def test_prompt_filling_the_context_is_refused() -> None:
    """A prompt that leaves no room to generate is a 400."""
    with pytest.raises(APIError, match="the prompt has 100 tokens"):
        parse_completion(completion()).sampling_params(100, 100, None)


def test_malformed_json_is_refused() -> None:
    """A body that is not JSON is a 400."""
    with pytest.raises(APIError, match="not valid JSON"):
        parse_json(b"{not json")


def test_a_json_array_body_is_refused() -> None:
    """A body must be a JSON object."""
    with pytest.raises(APIError, match="must be a JSON object"):
        parse_json(b"[1, 2]")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("max_tokens", 2.5),
        ("stream", "yes"),
        ("n", 0),
        ("n", 129),
        ("stop", [""]),
        ("echo", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", 1.5),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", "2"),
    ],
)
def test_bad_field_values_name_the_field(field: str, value: object) -> None:
    """A wrong type or out-of-range value is a 400 whose param names the field."""
    with pytest.raises(APIError) as info:
        parse_completion(completion(**{field: value}))
    assert info.value.param == field


def test_logprobs_reach_the_sampling_params() -> None:
    """A completion's logprobs become the engine's count of top tokens per position."""
    params = parse_completion(completion(logprobs=3)).sampling_params(5, 100, None)
    assert (params.logprobs, params.prompt_logprobs) == (3, None)


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    """Echo with logprobs needs the prompt's logprobs too, at the larger of the two counts."""
    request = parse_completion(completion(logprobs=3, echo=True, prompt_logprobs=1))
    assert request.sampling_params(5, 100, None).prompt_logprobs == 3


def test_streamed_prompt_logprobs_are_refused() -> None:
    """vLLM's prompt_logprobs are refused with stream=true, as vLLM does."""
    with pytest.raises(APIError, match="not available with stream") as info:
        parse_completion(completion(prompt_logprobs=1, stream=True))
    assert info.value.param == "prompt_logprobs"


def chat(**fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_logprobs_without_top_logprobs_lists_none() -> None:
    """Chat logprobs=true alone asks for each token's logprob and no top tokens."""
    assert parse_chat(chat(logprobs=True)).logprobs == 0


def test_chat_top_logprobs_need_logprobs() -> None:
    """Chat top_logprobs > 0 without logprobs=true is a 400 naming top_logprobs."""
    with pytest.raises(APIError, match="needs 'logprobs' set to true") as info:
        parse_chat(chat(top_logprobs=2))
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", 1), ("top_logprobs", 21), ("top_logprobs", -1), ("echo", True)],
)
def test_bad_chat_logprob_fields_name_the_field(field: str, value: object) -> None:
    """A chat logprob field of the wrong type or range is a 400 naming it."""
    with pytest.raises(APIError) as info:
        parse_chat(chat(**{"logprobs": True, field: value}))
    assert (info.value.status, info.value.param) == (400, field)


def test_token_id_prompts_are_accepted() -> None:
    """A prompt may be a list of token ids (or a batch of one)."""
    assert parse_completion(completion(prompt=[[5, 6, 7]])).prompt == (5, 6, 7)


def test_batched_prompts_are_refused() -> None:
    """Several prompts in one request are refused with a hint."""
    with pytest.raises(APIError, match="one request per prompt"):
        parse_completion(completion(prompt=["a", "b"]))


def test_chat_text_parts_are_joined() -> None:
    """Chat content given as text parts becomes one string."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = parse_chat({"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert request.messages == ({"role": "user", "content": "ab"},)


def test_stop_string_becomes_a_tuple() -> None:
    """A single stop string is accepted as well as a list."""
    assert parse_completion(completion(stop="###")).stop == ("###",)


def test_error_body_is_openai_shaped() -> None:
    """Errors render as {"error": {message, type, param, code}}."""
    body = APIError("nope", param="x", code="c").body()
    assert body == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "x", "code": "c"}
    }


def test_unknown_fields_are_ignored_and_listed_as_vllm_does() -> None:
    """Fields no reader knows, at the top, in stream_options and in messages, are listed by
    their full names; the request is what it would be without them."""
    request = parse_completion(
        completion(
            stream=True,
            stream_options={"include_usage": True, "colour": 1},
            service_tier="auto",
            prompt_cache_key="k",
        )
    )
    assert request.ignored_fields == ("prompt_cache_key", "service_tier", "stream_options.colour")
    assert request.include_usage and request.stream
    chat = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "x", "refusal": None}]}
    )
    assert chat.ignored_fields == ("messages[0].refusal",)
    assert parse_completion(completion()).ignored_fields == ()


def test_unknown_field_is_refused_by_name_when_strict() -> None:
    """strict: a field no reader knows is refused as unrecognized, naming it."""
    with pytest.raises(APIError, match="unrecognized request argument") as info:
        parse_completion(completion(temprature=0.2), strict=True)
    assert info.value.param == "temprature"


def test_unknown_nested_field_is_refused_with_its_path_when_strict() -> None:
    """strict: unknown fields inside stream_options and messages, by their full name."""
    with pytest.raises(APIError) as info:
        parse_completion(
            completion(stream=True, stream_options={"include_usgae": True}), strict=True
        )
    assert info.value.param == "stream_options.include_usgae"
    with pytest.raises(APIError) as info:
        parse_chat(
            {"model": "m", "messages": [{"role": "user", "content": "x", "colour": 1}]},
            strict=True,
        )
    assert info.value.param == "messages[0].colour"


def test_a_known_field_that_would_change_the_output_stays_refused() -> None:
    """Leniency is for fields nobody knows: one this server knows and does not build is a
    400 naming it, strict or not."""
    with pytest.raises(APIError, match="'use_beam_search' is not supported"):
        parse_completion(completion(use_beam_search=True))


def test_continuous_usage_stats_follows_include_usage() -> None:
    on = {"include_usage": True, "continuous_usage_stats": True}
    assert parse_completion(completion(stream=True, stream_options=on)).continuous_usage
    alone = {"continuous_usage_stats": True}
    assert not parse_completion(completion(stream=True, stream_options=alone)).continuous_usage


def test_logit_bias_is_clamped_as_vllm_does() -> None:
    """Biases beyond +-100 are clamped; keys are token ids as strings."""
    request = parse_completion(completion(logit_bias={"5": 250, "7": -300.5, "9": 1}))
    assert request.sampling.logit_bias == ((5, 100.0), (7, -100.0), (9, 1.0))


@pytest.mark.parametrize("bias", [{"w5": 1}, {"5": "high"}, [5, 1]])
def test_malformed_logit_bias_is_refused(bias: object) -> None:
    """Keys that are not token ids, or values that are not numbers, are a 400."""
    with pytest.raises(APIError) as info:
        parse_completion(completion(logit_bias=bias))
    assert info.value.param == "logit_bias"


def test_copies_get_their_own_seeds() -> None:
    """Choice i of a seeded request samples with seed + i."""
    request = parse_completion(completion(seed=10, n=3))
    assert [request.sampling_params(2, 100, None, copy=i).seed for i in range(3)] == [10, 11, 12]


def test_best_of_asks_the_engine_for_logprobs() -> None:
    """Ranking best_of copies needs the sampled tokens' logprobs, asked or not."""
    request = parse_completion(completion(n=1, best_of=2))
    assert request.sampling_params(2, 100, None).logprobs == 0
    assert request.logprobs is None


@pytest.mark.parametrize(
    ("fields", "kind", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "string"}},
                }
            },
            "json_schema",
            '{"type": "string"}',
        ),
        ({"guided_json": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
        ({"guided_regex": "a+"}, "regex", "a+"),
        ({"guided_choice": ["x", "y"]}, "choice", '["x", "y"]'),
        ({"guided_grammar": "start: 'a'"}, "grammar", "start: 'a'"),
        ({"structured_outputs": {"choice": ["x"]}}, "choice", '["x"]'),
        ({"structured_outputs": {"json_object": True}}, "json_schema", '{"type": "object"}'),
    ],
)
def test_structured_output_fields_become_one_constraint(
    fields: dict[str, object], kind: str, spec: str
) -> None:
    """Every spelling of a constraint becomes one StructuredOutput."""
    structured = parse_completion(completion(**fields)).sampling.structured_output
    assert structured is not None and (structured.kind, structured.spec) == (kind, spec)


def test_text_response_format_asks_for_nothing() -> None:
    """response_format text is the default: no constraint."""
    assert (
        parse_completion(completion(response_format={"type": "text"})).sampling.structured_output
        is None
    )


def test_template_kwargs_cannot_replace_the_messages() -> None:
    """chat_template_kwargs may add variables, not override messages."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError):
        parse_chat({**body, "chat_template_kwargs": {"messages": []}})
    parsed = parse_chat({**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert parsed.template_kwargs == {"enable_thinking": False}
