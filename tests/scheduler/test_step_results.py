"""Step results: validated before they are applied; logprobs reach the outputs."""

from __future__ import annotations

import math
from typing import Any

import anyio
import attrs
import pytest

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import (
    ConfigError,
    Engine,
    EngineConfig,
    FakeExecutor,
    InvalidRequestError,
    PoolSpec,
    RequestFailedError,
    RequestOutput,
    SamplingParams,
    StepBatch,
    StepResult,
)
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, fake_logprobs, reference_tokens

VOCAB = 50
_SEED = 0x9E3779B97F4A7C15
_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def make_config(**options: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=8)],
        "num_blocks": 65,
        "block_size": 4,
        "max_model_len": 64,
        "vocab_size": VOCAB,
    }
    settings.update(options)
    return EngineConfig(**settings)


def hashes(tokens: list[int]) -> list[int]:
    """The fake's rolling hash after each token (what its logprobs derive from)."""
    out, h = [], _SEED
    for token in tokens:
        h = ((h ^ token) * _PRIME) & _MASK
        out.append(h)
    return out


class Rewriting(FakeExecutor):
    """The fake, with its results passed through a function the test chooses."""

    def __init__(self, config: EngineConfig, rewrite: Any) -> None:
        super().__init__(config.pool, vocab_size=VOCAB)
        self.rewrite = rewrite

    def execute(self, batch: StepBatch) -> StepResult:
        return self.rewrite(batch, super().execute(batch))  # type: ignore[no-any-return]


def _tokens(value: object) -> Any:
    return lambda b, r: StepResult(token_ids=[value] * len(b.requests))


BAD_RESULTS = {
    "out of the vocabulary": _tokens(VOCAB),
    "negative": _tokens(-1),
    "a bool": _tokens(True),
    "a float": _tokens(1.0),
    "a string": _tokens("7"),
    "missing": _tokens(None),
    "too few": lambda b, r: StepResult(token_ids=()),
    "short logprobs": lambda b, r: StepResult(token_ids=r.token_ids, logprobs=()),
    "a list": lambda b, r: list(r.token_ids),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(BAD_RESULTS))
async def test_a_malformed_result_fails_its_step_and_the_engine_serves_on(name: str) -> None:
    """A result the core cannot apply fails that step's requests with a clear error."""
    config = make_config()
    calls = 0

    def rewrite(batch: StepBatch, result: StepResult) -> Any:
        nonlocal calls
        calls += 1
        return BAD_RESULTS[name](batch, result) if calls == 1 else result

    async with Engine(config, Rewriting(config, rewrite)) as engine:
        with anyio.fail_after(10):
            with pytest.raises(RequestFailedError, match="executor"):
                async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2)):
                    pass
            outs = [o async for o in engine.generate([4, 5], SamplingParams(max_tokens=2))]
        engine.core.kv.check_integrity()
    assert [t for o in outs for t in o.new_token_ids] == reference_tokens([4, 5], 2, VOCAB)


def test_a_per_request_error_fails_only_that_request() -> None:
    """An error in one request's result fails it; the others of the step go on."""
    config = make_config()

    def rewrite(batch: StepBatch, result: StepResult) -> StepResult:
        return attrs.evolve(result, errors={"b": InvalidRequestError("bad adapter")})

    core, fake = EngineCore(config), Rewriting(config, rewrite)
    sinks = {name: CollectingSink() for name in "ab"}
    for name, sink in sinks.items():
        core.add_request([1, 2, 3], SamplingParams(max_tokens=2), sink, request_id=name)
    plan = core.plan()
    core.apply(plan, fake.execute(plan.batch))
    core.flush()
    assert isinstance(sinks["a"].items[0], RequestOutput)
    failure = sinks["b"].items[0]
    assert isinstance(failure, RequestFailedError) and "bad adapter" in str(failure)
    assert sinks["b"].is_closed


def test_missing_logprobs_fail_the_request_that_asked() -> None:
    """A request that asked for logprobs and got none fails; its neighbours do not."""
    config = make_config()
    fake = Rewriting(config, lambda b, r: attrs.evolve(r, logprobs=None))
    core = EngineCore(config)
    asks, plain = CollectingSink(), CollectingSink()
    core.add_request([1, 2], SamplingParams(max_tokens=2, logprobs=1), asks, request_id="a")
    core.add_request([1, 2], SamplingParams(max_tokens=2), plain, request_id="b")
    plan = core.plan()
    core.apply(plan, fake.execute(plan.batch))
    core.flush()
    assert isinstance(asks.items[0], RequestFailedError) and "logprobs" in str(asks.items[0])
    assert isinstance(plain.items[0], RequestOutput)


def test_the_engine_refuses_a_config_for_another_pool() -> None:
    """A config whose block size differs from the executor's names both values."""
    config = make_config()
    fake = FakeExecutor(PoolSpec(config.policies, config.num_blocks, 8))
    with pytest.raises(ConfigError, match=r"block_size=4 .* block_size=8"):
        Engine(config, fake)
    other = FakeExecutor(PoolSpec((FullAttention(),), config.num_blocks, 4))
    with pytest.raises(ConfigError, match="policies"):
        Engine(config, other)


def test_for_executor_takes_the_pool_and_the_model_limits() -> None:
    """EngineConfig.for_executor copies the executor's pool; options fill the rest."""
    fake = FakeExecutor(PoolSpec((FullAttention(), SlidingWindow(window=4)), 33, 8))
    config = EngineConfig.for_executor(fake, max_model_len=128)
    assert config.pool == fake.pool
    Engine(config, fake)  # accepted


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_logprob_counts_are_validated(value: object) -> None:
    """logprobs and prompt_logprobs take an int in [0, 20] or None."""
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**{name: value})


def test_sampled_token_logprobs_reach_every_output() -> None:
    """Each output carries its token's log-probability and the top k asked for."""
    config = make_config()
    core, fake = EngineCore(config), FakeExecutor.for_config(config)
    sink = CollectingSink()
    prompt = [3, 1, 4, 1, 5]
    core.add_request(prompt, SamplingParams(max_tokens=5, logprobs=3), sink, request_id="a")
    while core.has_work:
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
    core.flush()
    tokens = reference_tokens(prompt, 5, VOCAB)
    states = hashes(prompt + tokens)[len(prompt) - 1 :]
    got = [lp for out in sink.items for lp in out.logprobs]
    assert got == [fake_logprobs(h, t, 3, VOCAB) for h, t in zip(states, tokens, strict=False)]
    assert all(lp.rank == 1 and lp.logprob == -math.log(2) for lp in got)


def test_prompt_logprobs_cover_every_prompt_token_through_chunks_and_preemption() -> None:
    """Prompt logprobs come whole in the first output, chunked and preempted or not."""
    # Six usable blocks: the urgent rival's growth preempts "a" at its last prompt chunk.
    config = make_config(
        policies=[FullAttention()],
        num_blocks=7,
        max_prefill_chunk=2,
        scheduling_policy="priority",
    )
    core, fake = EngineCore(config), FakeExecutor.for_config(config)
    prompt = [(7 * j + 3) % VOCAB for j in range(13)]
    cached, sink, rival = CollectingSink(), CollectingSink(), CollectingSink()
    # The same prompt ran before: a hit is there to take, and must not be taken.
    core.add_request(prompt, SamplingParams(max_tokens=1), cached, request_id="warm")
    while core.has_work:
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
    params = SamplingParams(max_tokens=3, prompt_logprobs=2)
    core.add_request(prompt, params, sink, request_id="a")
    core.add_request([9] * 4, SamplingParams(max_tokens=20), rival, request_id="b", priority=-1)
    while core.has_work:
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
    core.flush()
    first = sink.items[0]
    assert isinstance(first, RequestOutput) and first.num_cached_tokens == 0
    states = hashes(prompt)
    expected = [None] + [fake_logprobs(states[i - 1], prompt[i], 2, VOCAB) for i in range(1, 13)]
    assert first.prompt_logprobs == tuple(expected)
    assert all(out.prompt_logprobs is None for out in sink.items[1:])
    assert core.num_preemptions > 0
