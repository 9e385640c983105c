"""Speculative decoding in the engine, on the fakes: same tokens, fewer steps, pages back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from hybridkv.policies import FullAttention, MambaLike, MemoryPolicy, SlidingWindow
from hybridkv.scheduler import (
    ConfigError,
    Engine,
    EngineConfig,
    FakeExecutor,
    FinishReason,
    PipelinedFakeExecutor,
    RequestOutput,
    SamplingParams,
)
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, reference_tokens
from hybridkv.scheduler.fake_attending import AttendingFakeExecutor
from hybridkv.scheduler.speculation import Proposer, SpeculativeConfig
from hybridkv.testing import ReferenceProposer, SamplingFakeExecutor

VOCAB = 50
# Always propose: these tests count steps and proposals (the adaptive choice has its own).
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)


def make_config(**options: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=8)],
        "num_blocks": 65,
        "block_size": 4,
        "max_model_len": 96,
        "vocab_size": VOCAB,
        "speculative_config": NGRAM,
    }
    settings.update(options)
    return EngineConfig(**settings)


def run(core: EngineCore, fake: FakeExecutor) -> int:
    """Run the core to the end; the steps it took."""
    steps = 0
    while core.has_work:
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
        core.flush()
        steps += 1
        assert steps < 2000, "requests did not finish"
    core.kv.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks
    return steps


def outputs(sink: CollectingSink) -> list[int]:
    return [t for item in sink.items if isinstance(item, RequestOutput) for t in item.new_token_ids]


def serve(
    config: EngineConfig,
    prompts: Sequence[list[int]],
    max_tokens: int,
    *,
    proposer: ReferenceProposer | None,
    fake: FakeExecutor | None = None,
) -> tuple[list[list[int]], int, EngineCore]:
    """Every prompt through one core, all at once; outputs, steps and the core."""
    fake = fake or FakeExecutor.for_config(config)
    core = EngineCore(config, proposer=proposer)
    sinks = [CollectingSink() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        core.add_request(prompt, params, sink, request_id=str(i))
    steps = run(core, fake)
    return [outputs(s) for s in sinks], steps, core


LAYOUTS: dict[str, dict[str, Any]] = {
    "full+window": {},
    "mamba+full, state spans of 3": {
        "policies": [MambaLike(), FullAttention()],
        "num_blocks": 96,
        "state_span": 3,
    },
    "chunked prefill, tiny pool (preemption)": {"num_blocks": 25, "max_prefill_chunk": 5},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_are_the_fakes_with_fewer_steps(layout: str) -> None:
    config = make_config(**LAYOUTS[layout])
    prompts = [[(7 * i + j) % VOCAB for j in range(5 + 3 * i)] for i in range(4)]
    proposer = ReferenceProposer(VOCAB, miss=0.2, seed=3)
    got, steps, core = serve(config, prompts, 40, proposer=proposer)
    assert got == [reference_tokens(p, 40, VOCAB) for p in prompts]
    _, plain_steps, _ = serve(
        make_config(**LAYOUTS[layout], speculative_config=None), prompts, 40, proposer=None
    )
    stats = core.speculator.stats() if core.speculator else None
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert steps < plain_steps


def test_a_prefix_hit_after_speculation_resumes_the_right_state() -> None:
    """A conversation's next turn hits the blocks and state checkpoints its speculated
    reply left; only verified tokens were cached, so its tokens are the fake's."""
    config = make_config(policies=[MambaLike(), FullAttention(), SlidingWindow(window=6)])
    fake = FakeExecutor.for_config(config)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    first, _, _ = serve(config, [prompt], 23, proposer=ReferenceProposer(VOCAB, seed=1), fake=fake)
    turn = [*prompt, *first[0], 8, 8]
    # One core for both turns: the second resumes from what the first cached.
    core = EngineCore(config, proposer=ReferenceProposer(VOCAB, seed=2))
    sinks = [CollectingSink(), CollectingSink()]
    params = SamplingParams(max_tokens=23, ignore_eos=True)
    core.add_request(prompt, params, sinks[0], request_id="a")
    run(core, fake)
    core.add_request(turn, params, sinks[1], request_id="b")
    run(core, fake)
    assert outputs(sinks[0]) == first[0]
    assert outputs(sinks[1]) == reference_tokens(turn, 23, VOCAB)
    last = sinks[1].items[-1]
    assert isinstance(last, RequestOutput) and last.num_cached_tokens >= 28


def test_an_attending_fake_reads_every_live_position_through_the_lookahead() -> None:
    """Each verified position draws from every position its window reads: a lookahead page
    a window released, or a rejected token's K/V read, changes or fails the step."""
    policies: list[MemoryPolicy] = [FullAttention(), SlidingWindow(window=5)]
    config = make_config(policies=policies)
    fake = AttendingFakeExecutor.for_config(config)
    proposer = ReferenceProposer(VOCAB, miss=0.3, seed=5, attends=policies)
    prompts = [[2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2]]
    got, _, _ = serve(config, prompts, 30, proposer=proposer, fake=fake)
    assert got == [fake.reference_tokens(p, 30) for p in prompts]


def test_a_stop_token_inside_the_accepted_run_ends_the_request_there() -> None:
    prompt = [5, 6, 7, 8]
    expected = reference_tokens(prompt, 30, VOCAB)
    stop = expected[6]
    cut = expected.index(stop) + 1
    config = make_config(eos_token_ids=[stop])
    core = EngineCore(config, proposer=ReferenceProposer(VOCAB, miss=0.0, seed=0))
    sink = CollectingSink()
    core.add_request(prompt, SamplingParams(max_tokens=30), sink, request_id="a")
    run(core, FakeExecutor.for_config(config))
    assert outputs(sink) == expected[:cut]
    last = sink.items[-1]
    assert isinstance(last, RequestOutput) and last.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_max_tokens_is_exact(max_tokens: int) -> None:
    config = make_config()
    got, _, _ = serve(config, [[1, 2, 3]], max_tokens, proposer=ReferenceProposer(VOCAB, miss=0.0))
    assert got == [reference_tokens([1, 2, 3], max_tokens, VOCAB)]


def test_logprobs_are_those_without_speculation() -> None:
    config = make_config()
    params = SamplingParams(max_tokens=20, logprobs=2, ignore_eos=True)

    def logprobs(spec: SpeculativeConfig | None) -> list[Any]:
        core = EngineCore(
            make_config(speculative_config=spec), proposer=ReferenceProposer(VOCAB, seed=4)
        )
        sink = CollectingSink()
        core.add_request([4, 4, 2], params, sink, request_id="a")
        run(core, FakeExecutor.for_config(config))
        return [
            lp
            for item in sink.items
            if isinstance(item, RequestOutput)
            for lp in item.logprobs or ()
        ]

    plain, speculated = logprobs(None), logprobs(NGRAM)
    assert len(plain) == 20 and speculated == plain


def test_a_request_that_opts_out_proposes_nothing() -> None:
    config = make_config()
    proposer = ReferenceProposer(VOCAB)
    core = EngineCore(config, proposer=proposer)
    core.add_request(
        [1, 2, 3],
        SamplingParams(max_tokens=12),
        CollectingSink(),
        request_id="a",
        speculative=False,
    )
    run(core, FakeExecutor.for_config(config))
    assert proposer.num_proposed == 0


def test_proposals_that_never_pay_back_off() -> None:
    """All-wrong proposals: the request sits out more and more decode steps."""
    config = make_config()
    proposer = ReferenceProposer(VOCAB, miss=1.0)
    _, _, core = serve(config, [[1, 2, 3]], 80, proposer=proposer)
    stats = core.speculator.stats() if core.speculator else None
    assert stats is not None and stats.num_accepted_tokens == 0
    assert stats.num_drafts <= 8  # backs off 2, 4, 8, ... steps: far fewer than 80


def test_pages_of_rejected_blocks_go_back_to_the_pool() -> None:
    config = make_config(
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=8, adaptive=False
        )
    )
    core = EngineCore(config, proposer=ReferenceProposer(VOCAB, miss=1.0, random_length=False))
    sink = CollectingSink()
    core.add_request([1, 2, 3], SamplingParams(max_tokens=30), sink, request_id="a")
    fake = FakeExecutor.for_config(config)
    plan = core.plan()  # the prompt
    core.apply(plan, fake.execute(plan.batch))
    used = core.kv.num_usable_blocks - core.kv.num_free_blocks
    plan = core.plan()  # the first decode verifies 8 proposed tokens: 3 blocks more
    assert plan.batch.requests[0].num_draft_tokens == 8
    assert core.kv.num_usable_blocks - core.kv.num_free_blocks > used
    core.apply(plan, fake.execute(plan.batch))
    core.kv.check_integrity()
    assert core.kv.num_usable_blocks - core.kv.num_free_blocks == used  # all were rejected


def test_executors_that_cannot_verify_are_refused_at_start() -> None:
    config = make_config(vocab_size=257)
    with pytest.raises(ConfigError, match="does not verify proposed tokens"):
        Engine(config, SamplingFakeExecutor.for_config(config))
    draft = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="small")
    config = make_config(speculative_config=draft)
    with pytest.raises(ConfigError, match="draft_model needs a proposer"):
        Engine(config, FakeExecutor.for_config(config))
    mtp = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    config = make_config(speculative_config=mtp)
    with pytest.raises(ConfigError, match=r"LoadOptions\(mtp_proposals=2\)"):
        Engine(config, FakeExecutor.for_config(config))  # it runs no MTP layer


@pytest.mark.asyncio
async def test_pipeline_stages_in_flight_give_the_same_tokens() -> None:
    config = make_config(policies=[MambaLike(), FullAttention()], num_blocks=96, state_span=3)
    prompts = [[(3 * i + j) % VOCAB for j in range(4 + i)] for i in range(5)]
    got: dict[int, list[int]] = {}
    proposer = ReferenceProposer(VOCAB, miss=0.25, seed=9)
    with PipelinedFakeExecutor(FakeExecutor.for_config(config), num_stages=2) as fake:
        async with Engine(config, fake, proposer=proposer) as engine:

            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=25, ignore_eos=True)
                tokens: list[int] = []
                async for out in engine.generate(prompts[i], params):
                    tokens.extend(out.new_token_ids)
                got[i] = tokens

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(one, i)
            assert engine.stats().num_steps > 0
        assert fake.peak_steps_in_flight == 2
    assert got == {i: reference_tokens(p, 25, VOCAB) for i, p in enumerate(prompts)}


@pytest.mark.parametrize("shared", ["the prompt", "the prompt and the reply"])
def test_speculation_costs_no_cached_block(shared: str) -> None:
    """vLLM #54360: with MTP a whole cache unit of every prompt is lost. Here a request
    that repeats a speculated request's prompt (or continues its reply) hits exactly as
    many tokens as without speculation, in a hybrid pool with state pages."""
    layout = {"policies": [MambaLike(), FullAttention(), SlidingWindow(window=6)]}

    def second_hit(spec: SpeculativeConfig | None) -> int:
        config = make_config(**layout, speculative_config=spec, num_blocks=128)
        core = EngineCore(config, proposer=ReferenceProposer(VOCAB, miss=0.3, seed=8))
        fake = FakeExecutor.for_config(config)
        prompt = [(5 * j + 1) % VOCAB for j in range(37)]
        first = CollectingSink()
        params = SamplingParams(max_tokens=21, ignore_eos=True)
        core.add_request(prompt, params, first, request_id="a")
        run(core, fake)
        turn = prompt if shared == "the prompt" else [*prompt, *outputs(first), 3]
        second = CollectingSink()
        core.add_request(turn, params, second, request_id="b")
        run(core, fake)
        assert outputs(second) == reference_tokens(turn, 21, VOCAB)
        last = second.items[-1]
        assert isinstance(last, RequestOutput)
        return last.num_cached_tokens

    plain = second_hit(None)
    assert plain > 0 and second_hit(NGRAM) == plain


def test_no_proposals_while_more_requests_run_than_disable_by_batch_size() -> None:
    spec = SpeculativeConfig.from_mapping(
        {"num_speculative_tokens": 3, "disable_by_batch_size": 2, "adaptive": False}
    )
    config = make_config(speculative_config=spec)
    proposer = ReferenceProposer(VOCAB, seed=1)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    got, _, _ = serve(config, prompts, 12, proposer=proposer)
    assert got == [reference_tokens(p, 12, VOCAB) for p in prompts]
    assert proposer.num_proposed == 0  # three ran together to the end
    got, _, _ = serve(config, prompts[:2], 12, proposer=proposer)
    assert proposer.num_proposed > 0


class TimedFake(FakeExecutor):
    """The fake on a clock of its own: a step costs 1 + ``per_row`` per proposed token."""

    def __init__(self, config: EngineConfig, per_row: float) -> None:
        super().__init__(config.pool, vocab_size=VOCAB)
        self.now, self.per_row = 0.0, per_row

    def execute(self, batch: Any) -> Any:
        self.now += 1.0 + self.per_row * sum(r.num_draft_tokens for r in batch.requests)
        return super().execute(batch)


def drafts_of(prompts: list[list[int]], per_row: float, proposer: Proposer, n: int) -> int:
    """Proposals verified when ``prompts`` run together to ``n`` tokens each (adaptive,
    ``k`` = 2), each proposed token costing ``per_row`` of a step."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    config = make_config(speculative_config=spec, max_model_len=400, num_blocks=400)
    fake = TimedFake(config, per_row)
    core = EngineCore(config, clock=lambda: fake.now, proposer=proposer)
    sinks = [CollectingSink() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
        core.add_request(
            prompt, SamplingParams(max_tokens=n, ignore_eos=True), sink, request_id=str(i)
        )
    run(core, fake)
    assert [outputs(s) for s in sinks] == [reference_tokens(p, n, VOCAB) for p in prompts]
    assert core.speculator is not None
    return core.speculator.stats().num_drafts


@pytest.mark.parametrize(("per_row", "pays"), [(0.02, True), (1.0, False)])
def test_adaptive_speculation_proposes_where_it_pays(per_row: float, pays: bool) -> None:
    """Proposals that make a step cheaper per token are kept up; ones that make it dearer
    than the tokens they add are tried again only now and then."""
    prompts = [[(3 * i + j) % VOCAB for j in range(4)] for i in range(4)]
    num_drafts = drafts_of(prompts, per_row, ReferenceProposer(VOCAB, miss=0.1), 300)
    # Four decodes a step for some 300 steps without speculation.
    if pays:
        assert num_drafts > 4 * 60
    else:
        assert 0 < num_drafts < 4 * 30


class OneRightProposer:
    """Proposes the fake's continuation for prompts that start with 0, wrong tokens for
    every other prompt."""

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        right = reference_tokens(tokens, k, VOCAB)
        return right if tokens[0] == 0 else tuple((t + 1) % VOCAB for t in right)


def test_one_request_does_not_slow_every_other_one_down() -> None:
    """Two proposed tokens make a step 1.4x as long. Alone, a request whose proposals
    are kept gains more than that and proposes nearly every step; beside three whose
    proposals are all rejected, its gain would still raise the step's tokens per second
    (4 + 1.9 tokens in 1.4 of the time) but slow the three down by 1.4x for nothing, so
    it proposes only when the costs are measured again."""
    prompts = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    alone = drafts_of(prompts[:1], 0.2, OneRightProposer(), 200)
    assert alone > 55  # of some 70 steps of 3 tokens
    together = drafts_of(prompts, 0.2, OneRightProposer(), 200)
    assert together < 30  # of some 200 steps
