"""The sampler: greedy, filters, and per-request seeds that survive batching and recompute."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from tokenizers import Tokenizer

from hybridkv.executor.grammars import GrammarError
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.sampler import Sampler, StructuredOutputUnavailableError, filter_logits
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.params import InvalidRequestError, SamplingParams, StructuredOutput
from hybridkv.testing import byte_tokenizer


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 50, generator=torch.Generator().manual_seed(seed))


def step_request(
    params: SamplingParams, output_index: int = 0, tokens: Sequence[int] = (), rid: str = "r"
) -> StepRequest:
    """A sampled batch entry whose last ``output_index`` of ``tokens`` are outputs."""
    return StepRequest(
        request_id=rid,
        token_ids=list(tokens[-1:]) or [0],
        start_position=max(len(tokens) - 1, 0),
        block_tables=[],
        sample=True,
        params=params,
        output_index=output_index,
        all_token_ids=tokens,
    )


def draw(
    sampler: Sampler,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
) -> list[int]:
    """The sampler on rows of requests that have no tokens to read."""
    rows = [step_request(p, i) for p, i in zip(params, output_indices, strict=True)]
    return sampler.sample(logits, rows)


def test_greedy_is_the_argmax():
    """Temperature 0 picks the largest logit of each row."""
    logits = _logits(3)
    greedy = SamplingParams(temperature=0.0)
    assert draw(Sampler(seed=0), logits, [greedy] * 3, [0, 0, 0]) == logits.argmax(-1).tolist()


def test_same_seed_gives_same_tokens_whatever_the_batch():
    """A seeded request draws the same tokens alone or between other requests."""
    logits = _logits(1)[0]
    seeded = SamplingParams(seed=1234)
    other = SamplingParams(seed=None)
    alone = [draw(Sampler(seed=1), logits[None], [seeded], [i])[0] for i in range(20)]
    batch = torch.stack([logits.flip(0), logits, logits * 2])
    mixed = [draw(Sampler(seed=2), batch, [other, seeded, other], [5, i, 9])[1] for i in range(20)]
    assert alone == mixed


def test_different_seeds_give_different_tokens():
    """Two seeds over 20 draws from a flat distribution do not produce one sequence."""
    logits = torch.zeros(1, 50)
    draws = {
        seed: [draw(Sampler(), logits, [SamplingParams(seed=seed)], [i])[0] for i in range(20)]
        for seed in (1, 2)
    }
    assert draws[1] != draws[2]


def test_unseeded_requests_follow_the_sampler_seed():
    """Requests without a seed share a generator seeded by the sampler's own seed."""
    logits = torch.zeros(1, 50)
    params = [SamplingParams()]
    first, second = Sampler(seed=7), Sampler(seed=7)
    assert [draw(first, logits, params, [0])[0] for _ in range(10)] == [
        draw(second, logits, params, [0])[0] for _ in range(10)
    ]


def test_top_k_keeps_only_the_k_largest():
    """With top_k=3 only the three largest logits can ever be drawn."""
    logits = _logits(1, 3)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    params = SamplingParams(top_k=3, temperature=5.0, seed=0)
    drawn = {draw(Sampler(), logits, [params], [i])[0] for i in range(200)}
    assert drawn <= allowed
    assert len(drawn) > 1


def test_top_p_keeps_the_smallest_nucleus():
    """Probabilities 0.5, 0.3, 0.2 with top_p=0.7 keep the first two tokens only."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    kept = filter_logits(logits, SamplingParams(top_p=0.7))
    assert torch.isfinite(kept).tolist() == [True, True, False]


def test_top_p_always_keeps_the_top_token():
    """A top_p below the largest probability still leaves one token."""
    logits = torch.tensor([0.6, 0.4]).log()
    kept = filter_logits(logits, SamplingParams(top_p=0.1))
    assert torch.isfinite(kept).tolist() == [True, False]


def test_min_tokens_withholds_eos():
    """Under min_tokens the end-of-sequence token is never picked, even when it is the argmax."""
    logits = torch.zeros(1, 10)
    logits[0, 2] = 100.0
    sampler = Sampler(eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5)
    assert draw(sampler, logits, [params], [2])[0] != 2
    assert draw(sampler, logits, [params], [3])[0] == 2


def test_tiny_temperature_samples_the_top_token():
    """A temperature small enough to overflow float32 logits still draws the argmax."""
    logits = _logits(2)
    tiny = SamplingParams(temperature=1e-40, seed=7)
    assert draw(Sampler(seed=0), logits, [tiny] * 2, [0, 0]) == logits.argmax(-1).tolist()


# -- penalties, logit bias, min-p: against plain-Python references ---------------------


def reference_logits(
    logits: list[float], tokens: list[int], num_outputs: int, params: SamplingParams
) -> list[float]:
    """vLLM's logit bias, then repetition, frequency and presence penalties, per element."""
    out = list(logits)
    for token_id, bias in params.logit_bias:
        out[token_id] += bias
    prompt, outputs = tokens[: len(tokens) - num_outputs], tokens[len(tokens) - num_outputs :]
    for t in range(len(out)):
        if t in prompt or t in outputs:
            p = params.repetition_penalty
            out[t] = out[t] / p if out[t] > 0 else out[t] * p
        count = outputs.count(t)
        out[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


PENALISED = SamplingParams(
    temperature=0.0,
    presence_penalty=0.7,
    frequency_penalty=0.4,
    repetition_penalty=1.6,
    logit_bias={3: 2.5, 7: -4.0, 11: 0.5},
)


def test_penalties_and_bias_match_the_reference():
    """Processed logits equal the per-element reference for random rows and histories."""
    from hybridkv.executor.penalties import process_logits

    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        logits = torch.randn(30, generator=gen) * 3
        tokens = torch.randint(0, 30, (12,), generator=gen).tolist()
        num_outputs = trial % 8
        request = step_request(PENALISED, num_outputs, tokens)
        got = process_logits(logits, request, eos_token_ids=())
        expected = reference_logits(logits.tolist(), tokens, num_outputs, PENALISED)
        assert torch.allclose(got, torch.tensor(expected), atol=1e-5)


def test_greedy_penalised_token_is_the_reference_argmax():
    """A greedy request with penalties samples the argmax of the reference logits."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        logits = torch.randn(1, 30, generator=gen)
        tokens = torch.randint(0, 30, (10,), generator=gen).tolist()
        expected = reference_logits(logits[0].tolist(), tokens, 6, PENALISED)
        (token,) = Sampler().sample(logits, [step_request(PENALISED, 6, tokens)])
        assert token == max(range(30), key=expected.__getitem__)


def test_presence_penalty_ignores_the_prompt():
    """Presence and frequency penalties count output tokens only; the prompt is free."""
    logits = torch.zeros(1, 10)
    logits[0, 4] = 1.0
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    in_prompt = step_request(params, 1, [4, 4, 4, 2])
    in_output = step_request(params, 1, [2, 2, 2, 4])
    assert Sampler().sample(logits, [in_prompt]) == [4]
    assert Sampler().sample(logits, [in_output]) != [4]


def test_repetition_penalty_reads_the_prompt():
    """The repetition penalty lowers a positive logit seen in the prompt alone."""
    logits = torch.tensor([[0.0, 2.0, 1.5]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler().sample(logits, [step_request(params, 0, [1, 0])]) == [2]


def test_logit_bias_forces_and_bans_tokens():
    """A bias of +100 makes a token the greedy pick; -100 keeps the argmax from it."""
    logits = _logits(1, 5)
    top = int(logits.argmax())
    forced = SamplingParams(temperature=0.0, logit_bias={(top + 1) % 50: 100.0})
    banned = SamplingParams(temperature=0.0, logit_bias={top: -100.0})
    assert Sampler().sample(logits, [step_request(forced)]) == [(top + 1) % 50]
    assert Sampler().sample(logits, [step_request(banned)]) != [top]


def test_logit_bias_outside_the_vocabulary_is_skipped():
    """A bias on a token id past the logits never fails the step."""
    logits = _logits(1, 6)
    params = SamplingParams(temperature=0.0, logit_bias={10_000: 5.0})
    assert Sampler().sample(logits, [step_request(params)]) == [int(logits.argmax())]


def test_min_p_keeps_what_vllm_keeps():
    """min_p after temperature keeps the tokens with p >= min_p * max p (vLLM's rule)."""
    logits = _logits(1, 7)[0]
    params = SamplingParams(temperature=0.7, min_p=0.2)
    probs = (logits / 0.7).softmax(-1)
    expected = probs >= 0.2 * probs.max()
    assert torch.equal(torch.isfinite(filter_logits(logits, params)), expected)


def test_min_p_bounds_what_is_drawn():
    """Draws with min_p come only from the tokens it keeps."""
    logits = _logits(1, 8)
    params = SamplingParams(temperature=1.5, min_p=0.3, seed=1)
    kept = set(torch.isfinite(filter_logits(logits[0], params)).nonzero().flatten().tolist())
    drawn = {draw(Sampler(), logits, [params], [i])[0] for i in range(100)}
    assert drawn <= kept


def test_plain_rows_sample_as_before_beside_processed_ones():
    """A request without penalties gets the same token whether or not its neighbours use them."""
    logits = _logits(3, 9)
    plain = SamplingParams(temperature=0.0)
    alone = Sampler().sample(logits[:1], [step_request(plain)])
    rows = [step_request(plain), step_request(PENALISED, 2, [1, 2]), step_request(plain)]
    mixed = Sampler().sample(logits, rows)
    assert mixed[0] == alone[0]


def test_bad_penalties_are_invalid_requests():
    """Bad penalty values are InvalidRequestError naming the field."""
    for field, value in [
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
    ]:
        with pytest.raises(InvalidRequestError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={1: 200.0})


# -- structured output -----------------------------------------------------------------


EOS = 256
VOCAB = 260  # wider than the tokenizer, as model vocabularies often are


def generate(
    sampler: Sampler, params: SamplingParams, tokenizer: Tokenizer, *, seed: int = 0
) -> list[int]:
    """Sample from random logits until EOS or max_tokens, as the engine would."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [65]  # a one-token prompt
    for i in range(params.max_tokens):
        logits = torch.randn(1, VOCAB, generator=gen) * 4
        (token,) = sampler.sample(logits, [step_request(params, i, tokens)], tokenizer=tokenizer)
        tokens.append(token)
        if token == EOS:
            break
    return tokens[1:]


def text_of(tokenizer: Tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t != EOS])


@pytest.mark.parametrize(
    ("kind", "spec", "check"),
    [
        ("regex", "[0-9]{3}-[a-z]{2,6}", r"[0-9]{3}-[a-z]{2,6}"),
        ("choice", '["north", "south", "east"]', "north|south|east"),
        ("grammar", 'start: "yes" | "no" | "maybe"', "yes|no|maybe"),
    ],
)
def test_structured_output_follows_the_constraint(kind: str, spec: str, check: str):
    """Random logits masked by the grammar produce text the constraint accepts, then EOS."""
    import re

    tokenizer = byte_tokenizer()
    params = SamplingParams(
        max_tokens=40, temperature=1.0, structured_output=StructuredOutput(kind, spec)
    )
    sampler = Sampler(eos_token_ids=[EOS], seed=0)
    for seed in range(3):
        tokens = generate(sampler, params, tokenizer, seed=seed)
        assert re.fullmatch(check, text_of(tokenizer, tokens)), tokens
        assert tokens[-1] == EOS


def test_json_schema_output_parses_and_validates():
    """A JSON schema gives JSON with the required keys and types."""
    import json

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    spec = StructuredOutput("json_schema", json.dumps(schema))
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_output=spec)
    tokenizer = byte_tokenizer()
    tokens = generate(Sampler(eos_token_ids=[EOS]), params, tokenizer)
    value = json.loads(text_of(tokenizer, tokens))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_grammar_matcher_is_rebuilt_from_the_tokens():
    """A request recomputed (a new token list) or evicted gets the same masks as before."""
    tokenizer = byte_tokenizer()
    spec = StructuredOutput("regex", "a[bc]{4}d")
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_output=spec)
    sampler = Sampler(eos_token_ids=[EOS])
    sampler.enable_structured_output(tokenizer, VOCAB)
    assert sampler.grammars is not None
    tokens = [65, *tokenizer.encode("abcb").ids]
    first = sampler.grammars.logit_mask(step_request(params, 4, tokens))
    again = sampler.grammars.logit_mask(step_request(params, 4, list(tokens)))  # a new list
    fresh = Sampler(eos_token_ids=[EOS])
    fresh.enable_structured_output(tokenizer, VOCAB)
    assert fresh.grammars is not None
    cold = fresh.grammars.logit_mask(step_request(params, 4, tokens))
    allowed = {tokenizer.decode([t]) for t in (first == 0).nonzero().flatten().tolist()}
    assert torch.equal(first, again) and torch.equal(first, cold) and allowed == {"b", "c"}


def test_grammar_wins_over_min_tokens():
    """When the grammar allows only EOS and min_tokens bans it, EOS is still sampled."""
    tokenizer = byte_tokenizer()
    spec = StructuredOutput("choice", '["ok"]')
    params = SamplingParams(max_tokens=8, min_tokens=5, temperature=0.0, structured_output=spec)
    tokens = generate(Sampler(eos_token_ids=[EOS]), params, tokenizer)
    assert text_of(tokenizer, tokens) == "ok" and tokens[-1] == EOS


def test_a_grammar_compiled_ahead_is_refused_there_and_served_from_the_cache():
    """``compile_grammar`` (what a server calls before queueing) refuses what llguidance
    refuses, and a grammar it compiled constrains the steps that follow."""
    tokenizer = byte_tokenizer()
    sampler = Sampler(eos_token_ids=[EOS])
    with pytest.raises(GrammarError, match="the grammar does not compile"):
        sampler.compile_grammar(StructuredOutput("grammar", "start: nowhere"), tokenizer, VOCAB)
    spec = StructuredOutput("choice", '["north", "south"]')
    sampler.compile_grammar(spec, tokenizer, VOCAB)
    params = SamplingParams(max_tokens=8, temperature=1.0, structured_output=spec)
    tokens = generate(sampler, params, tokenizer)
    assert text_of(tokenizer, tokens) in ("north", "south")


def test_structured_output_needs_a_tokenizer():
    """Without a tokenizer a structured request fails with a clear error."""
    params = SamplingParams(structured_output=StructuredOutput("regex", "a+"))
    with pytest.raises(StructuredOutputUnavailableError, match="tokenizer"):
        Sampler().sample(torch.zeros(1, VOCAB), [step_request(params)])


@pytest.mark.asyncio
async def test_engine_penalises_a_real_model_like_the_reference(tiny_models, prompt_of):
    """Through the engine and a tiny model, with preemption, every greedy token with
    penalties and bias is the argmax of the reference applied to the model's raw logits."""
    import anyio

    from hybridkv.executor.model_executor import ModelExecutor
    from hybridkv.scheduler import Engine, EngineConfig

    raw: dict[str, list[torch.Tensor]] = {}
    executor = ModelExecutor.from_pretrained(
        tiny_models["llama"].path,
        LoadOptions(kv_cache_bytes=30 * 2 * 1024, block_size=4),
        logits_hook=lambda rid, row: raw.setdefault(rid, []).append(row.float().clone()),
    )
    config = EngineConfig.for_executor(executor, max_model_len=64, max_num_batched_tokens=16)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={5: 3.0},
    )
    prompts = {f"r{n}": prompt_of(n, 70 + n) for n in (11, 17, 23)}
    outputs: dict[str, list[int]] = {}

    async def consume(engine: Engine, rid: str) -> None:
        async for output in engine.generate(prompts[rid], params, request_id=rid):
            outputs[rid] = list(output.token_ids)

    with anyio.fail_after(120):
        async with Engine(config, executor) as engine:
            async with anyio.create_task_group() as tg:
                for rid in prompts:
                    tg.start_soon(consume, engine, rid)
            assert engine.stats().num_preemptions > 0
    executor.close()
    for rid, output in outputs.items():
        history = prompts[rid] + output
        for i, (row, token) in enumerate(zip(raw[rid], output, strict=True)):
            tokens = history[: len(prompts[rid]) + i]
            expected = reference_logits(row.tolist(), tokens, i, params)
            assert token == max(range(len(expected)), key=expected.__getitem__)
