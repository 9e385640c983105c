"""Speculative method mtp: the checkpoint's own MTP layer proposes, exactly.

Each family whose checkpoints ship an MTP layer gets one, under the names its real
checkpoints use (``tests/mtp_reference.py``). Its proposals must be those of
transformers' MTP layer (``MtpModel``; DeepSeek V4's, which transformers does not build,
those of the same layer over the whole sequence at once) through chunked prefill, prefix
hits and decodes;
the tokens served with it must be transformers' greedy ones through mixed batches,
preemption and an abort, for k = 1, 2, 3; and prefix caching must not change: vLLM
#43559's probe (A, B, A) answers alike with MTP on and off, and a multi-turn chat hits as
many tokens with MTP as without.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from model_fixtures import Driver, ReferenceModelProposer, run_in_turn
from mtp_reference import MTP_FAMILIES, MtpCheckpoint

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.offload import HostTier, OffloadConfig
from hybridkv.scheduler import Engine, EngineConfig, SamplingParams
from hybridkv.scheduler.batch import StepBatch, StepResult
from hybridkv.scheduler.speculation import SpeculativeConfig
from hybridkv.testing.tiny_mtp import save_agreeing_mtp

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def mtp_models(
    tiny_models: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, MtpCheckpoint]:
    return {
        name: MtpCheckpoint.make(tiny_models[name].path, tmp_path_factory.mktemp("mtp") / name)
        for name in MTP_FAMILIES
    }


def _executor(path: Path, k: int, **options: Any) -> ModelExecutor:
    options.setdefault("kv_cache_bytes", 1 << 20)
    options.setdefault("block_size", 4)
    return ModelExecutor.from_pretrained(path, LoadOptions(mtp_proposals=k, **options))


@pytest.mark.parametrize("name", MTP_FAMILIES)
def test_proposals_are_transformers_mtp_layer(
    name: str, mtp_models: dict[str, MtpCheckpoint], prompt_of: Callable[[int, int], list[int]]
) -> None:
    """After every step, each request's 3 proposals are those of transformers' MTP layer
    run on the whole sequence: through prefill chunks of 7 (the MTP layer reads the
    next chunk's first token), a second request resuming from the first's cached blocks
    (its MTP keys among them), and decodes."""
    model = mtp_models[name]
    executor = _executor(model.path, 3)
    driver = Driver(executor)
    proposed: list[tuple[str, int, tuple[int, ...]]] = []
    execute = executor._execute

    def record(batch: StepBatch) -> StepResult:
        result = execute(batch)
        assert result.proposals is not None
        for item, row in zip(batch.requests, result.proposals, strict=True):
            if row:
                proposed.append((item.request_id, item.start_position + item.num_tokens, row))
        return result

    executor._execute = record  # type: ignore[method-assign]
    shared = prompt_of(30, 11)
    driver.add("a", shared + prompt_of(6, 12))
    driver.run(4, chunk=7)
    second = driver.add("b", shared + prompt_of(5, 13))
    driver.run(6, chunk=7)
    executor.close()
    assert second.hit_tokens >= 28
    assert len(proposed) == 12  # one after each token sampled
    for rid, length, row in proposed:
        tokens = driver.active[rid].all_token_ids[: length + 1]
        assert list(row) == model.proposals(tokens, 3), (rid, length)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", MTP_FAMILIES)
async def test_proposals_stay_transformers_through_verification(
    name: str,
    mtp_models: dict[str, MtpCheckpoint],
    tiny_models: Any,
    prompt_of: Callable[[int, int], list[int]],
) -> None:
    """Steps that verify 4 proposed tokens (transformers' greedy ones, a third of them
    wrong) keep some and reject the rest, requests are preempted and recomputed: after
    every step the MTP layer's 2 proposals are still those of transformers' MTP layer over
    the tokens kept (its keys written for them alone, rejected rows never read)."""
    model = mtp_models[name]
    path = model.path
    executor = _executor(path, 2, kv_cache_bytes=_pool_bytes(path, name))
    seen: list[tuple[int, int, tuple[int, ...]]] = []
    execute = executor._execute

    def record(batch: StepBatch) -> StepResult:
        result = execute(batch)
        assert result.proposals is not None
        accepted = result.num_accepted or (0,) * len(batch.requests)
        for item, row, num in zip(batch.requests, result.proposals, accepted, strict=True):
            kept = 1 + num if item.num_draft_tokens else item.num_tokens
            if row:
                seen.append((int(item.request_id), item.start_position + kept + 1, row))
        return result

    executor._execute = record  # type: ignore[method-assign]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    config = EngineConfig.for_executor(
        executor, max_model_len=64, max_num_batched_tokens=16, max_prefill_chunk=8,
        speculative_config=spec,
    )  # fmt: skip
    prompts = _prompts(prompt_of)
    proposer = ReferenceModelProposer(tiny_models[name].reference, 256, miss=0.3, seed=7)
    outputs, stats, _ = await _serve(executor, config, prompts, proposer=proposer)
    executor.close()
    accepted = stats.spec_decode.num_accepted_tokens
    assert 0 < accepted < stats.spec_decode.num_draft_tokens and stats.num_preemptions > 0
    assert len(seen) > 24
    for index, length, row in seen[:: len(seen) // 24 + 1]:  # two dozen, spread out
        tokens = [*prompts[index], *outputs[index]][:length]
        assert list(row) == model.proposals(tokens, 2), (index, length)


async def _serve(
    executor: ModelExecutor,
    config: EngineConfig,
    prompts: Sequence[list[int]],
    *,
    abort: int | None = None,
    offload: OffloadConfig | None = None,
    proposer: Any = None,
) -> tuple[dict[int, list[int]], Any, list[int]]:
    """Every prompt through one Engine at once, greedy, ``NUM_TOKENS`` each (request
    ``abort`` left after 2); each one's tokens, the stats, each one's cached tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    cached: list[int] = [0] * len(prompts)

    async def one(engine: Engine, i: int) -> None:
        async with engine.generate(prompts[i], params, request_id=str(i)) as stream:
            async for out in stream:
                outputs[i] = list(out.token_ids)
                cached[i] = out.num_cached_tokens
                if i == abort and len(outputs[i]) >= 2:
                    return  # leaving the stream aborts the request

    with anyio.fail_after(120):
        async with Engine(config, executor, offload=offload, proposer=proposer) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, engine, i)
            # An aborted request's pages return when its last step does.
            await engine.wait_until(lambda s: not any(s.blocks_used_per_group))
            engine.core.kv.check_integrity()
            stats = engine.stats()
    return outputs, stats, cached


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", MTP_FAMILIES)
async def test_greedy_tokens_are_transformers_with_mtp(
    name: str,
    k: int,
    mtp_models: dict[str, MtpCheckpoint],
    tiny_models: Any,
    prompt_of: Callable[[int, int], list[int]],
) -> None:
    """Four requests at once over a pool too small for them (preemption), chunks of 8, a
    shared prefix (hits), one aborted after two tokens: every other one's tokens are
    transformers' greedy ones, proposals were verified and some kept, and the pool is
    whole again at the end."""
    path = mtp_models[name].path
    executor = _executor(path, k, kv_cache_bytes=_pool_bytes(path, name))
    config = EngineConfig.for_executor(
        executor,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_prefill_chunk=8,
        speculative_config=SpeculativeConfig(
            method="mtp", num_speculative_tokens=k, adaptive=False
        ),
    )
    prompts = _prompts(prompt_of)
    outputs, stats, _ = await _serve(executor, config, prompts, abort=3)
    assert outputs[3] and len(outputs[3]) < NUM_TOKENS
    executor.close()
    reference = tiny_models[name]
    for i, prompt in enumerate(prompts[:3]):
        expected = reference.reference_logits(prompt + outputs[i][:-1])[len(prompt) - 1 :]
        assert outputs[i] == expected.argmax(-1).tolist(), i
    spec = stats.spec_decode
    assert spec is not None and spec.num_draft_tokens > 0
    assert stats.prefix_hit_rate > 0
    assert stats.num_preemptions > 0


def _prompts(prompt_of: Callable[[int, int], list[int]]) -> list[list[int]]:
    """Four prompts, two sharing a prefix: too many for the pools of ``POOL_PAGES``."""
    shared = prompt_of(12, 1)
    return [shared + prompt_of(5, 2), shared + prompt_of(9, 3), prompt_of(17, 4), prompt_of(9, 5)]


#: Pages of 4 tokens per group of each pool: the four requests do not fit at once.
POOL_PAGES = {"qwen3_next": 36, "qwen3_5": 36, "deepseek_v3": 14, "mimo_v2_flash": 24}
POOL_PAGES |= {"bailing_hybrid": 96, "deepseek_v32": 20, "deepseek_v4": 64}


def _pool_bytes(path: Path, name: str) -> int:
    """Bytes of a pool of ``POOL_PAGES[name]`` pages of 4 tokens (the MTP layer's
    memory planned in)."""
    probe = _executor(path, 1, kv_cache_bytes=1 << 20)
    page_bytes = (1 << 20) // probe.pool.num_blocks
    probe.close()
    return page_bytes * POOL_PAGES[name]


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Qwen3.5-shaped hybrid whose MTP layer mostly proposes what it emits
    (``save_agreeing_mtp``), and its transformers reference."""
    from model_fixtures import TinyModel

    folder = save_agreeing_mtp(tmp_path_factory.mktemp("agreeing"), seed=5)
    return TinyModel.load("agreeing", folder)


def _mtp_config(executor: ModelExecutor, k: int, **fields: Any) -> EngineConfig:
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=k, adaptive=False)
    fields.setdefault("max_model_len", 128)
    return EngineConfig.for_executor(executor, speculative_config=spec, **fields)


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [1, 3])
async def test_accepted_mtp_proposals_change_no_token(
    k: int, agreeing: Any, prompt_of: Callable[[int, int], list[int]]
) -> None:
    """Proposals the model mostly keeps (whole runs of k, then its own token), its
    DeltaNet states resuming from the last kept one, over a pool that preempts: every
    token is transformers' greedy one, and a step emits more than one a request."""
    executor = _executor(agreeing.path, k, kv_cache_bytes=_pages_bytes(agreeing.path, 30))
    config = _mtp_config(executor, k, max_num_batched_tokens=16, max_prefill_chunk=8)
    prompts = _prompts(prompt_of)
    outputs, stats, _ = await _serve(executor, config, prompts)
    executor.close()
    for i, prompt in enumerate(prompts):
        expected = agreeing.reference_logits(prompt + outputs[i][:-1])[len(prompt) - 1 :]
        assert outputs[i] == expected.argmax(-1).tolist(), i
    spec = stats.spec_decode
    assert spec.num_accepted_tokens > 0.7 * spec.num_draft_tokens
    assert all(spec.accepted_per_position) and stats.num_preemptions > 0


def _pages_bytes(path: Path, pages: int, block_size: int = 4) -> int:
    """Bytes of a pool of ``pages`` pages of ``block_size`` tokens (MTP memory in)."""
    probe = _executor(path, 1, kv_cache_bytes=1 << 20, block_size=block_size)
    page_bytes = (1 << 20) // probe.pool.num_blocks
    probe.close()
    return page_bytes * pages


async def _in_turn(
    path: Path,
    prompts: Sequence[list[int]],
    *,
    k: int,
    prefix_caching: bool = True,
    pages: int = 400,
    block_size: int = 16,
    offload: OffloadConfig | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Each prompt through one Engine in turn (MTP proposing ``k``, or no speculation
    for 0), greedy; each one's tokens and its cached prompt tokens."""
    kv_bytes = _pages_bytes(path, pages, block_size)
    executor = _executor(path, k, kv_cache_bytes=kv_bytes, block_size=block_size)
    fields: dict[str, Any] = {"max_model_len": 256, "enable_prefix_caching": prefix_caching}
    if k:
        config = _mtp_config(executor, k, **fields)
    else:
        config = EngineConfig.for_executor(executor, **fields)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs, cached, _ = await run_in_turn(executor, config, prompts, params, offload)
    return outputs, cached


@pytest.mark.asyncio
@pytest.mark.parametrize("setting", ["roomy", "evicting", "host tier"])
async def test_vllm_43559_probe_a_b_a_answers_alike(
    setting: str, agreeing: Any, prompt_of: Callable[[int, int], list[int]]
) -> None:
    """vLLM #43559: requests A, B, A again sharing a prompt prefix, MTP on and prefix
    caching on: A's two answers are the same, and the answer with both off. In a roomy
    pool A's repeat hits its blocks; in one B's blocks evict them from (the repeat
    recomputes); with a host tier they are saved there and loaded back, the DeltaNet
    layers' states among them."""
    shared = prompt_of(40, 21)
    a, b = shared + prompt_of(9, 22), shared + prompt_of(11, 23)
    baseline, _ = await _in_turn(agreeing.path, [a], k=0, prefix_caching=False)
    offload = None
    pages = {"roomy": 400, "evicting": 8, "host tier": 8}[setting]
    if setting == "host tier":
        offload = OffloadConfig(tiers=[HostTier(64 << 20)], save_interval=16)
    outputs, cached = await _in_turn(agreeing.path, [a, b, a], k=3, pages=pages, offload=offload)
    assert outputs[0] == outputs[2] == baseline[0]
    if setting == "roomy":
        assert cached[2] == 48  # A's repeat hits its every whole block
    if setting == "evicting":
        assert cached[2] < 48  # B took some of A's pages
    if setting == "host tier":
        assert offload is not None and offload.stats.hit_tokens["host"] >= 16


@pytest.mark.asyncio
async def test_mtp_hits_as_many_prefix_tokens_as_no_speculation(
    agreeing: Any, prompt_of: Callable[[int, int], list[int]]
) -> None:
    """A chat of four turns, each prompt the whole conversation so far and a new user
    message, on Qwen3.5-shaped states at block 16: each turn hits exactly as many cached
    tokens with MTP proposing 3 as without speculation (no block given up at the states'
    checkpoints), and answers alike."""
    turns = [prompt_of(13 + 7 * t, 30 + t) for t in range(4)]
    results = {}
    for k in (0, 3):
        results[k] = await _chat(agreeing.path, turns, k)
    assert results[3] == results[0]
    assert results[0][1] == [0, 16, 48, 80]  # each turn's history, to its last whole block


async def _chat(
    path: Path, turns: Sequence[list[int]], k: int
) -> tuple[list[list[int]], list[int]]:
    """The chat of ``turns`` through one Engine: each prompt the conversation so far and
    the next user message; each turn's answer and cached prompt tokens."""
    executor = _executor(path, k, kv_cache_bytes=_pages_bytes(path, 200, 16), block_size=16)
    fields: dict[str, Any] = {"max_model_len": 256}
    config = (
        _mtp_config(executor, k, **fields) if k else EngineConfig.for_executor(executor, **fields)
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    history: list[int] = []
    answers, hits = [], []
    try:
        with anyio.fail_after(120):
            async with Engine(config, executor) as engine:
                for message in turns:
                    prompt = [*history, *message]
                    async with engine.generate(prompt, params) as stream:
                        async for out in stream:
                            answer, hit = list(out.token_ids), out.num_cached_tokens
                    answers.append(answer)
                    hits.append(hit)
                    history = [*prompt, *answer]
    finally:
        executor.close()
    return answers, hits


#: Chi-square quantiles at p = 0.001 by degrees of freedom.
CHI2_AT_0_001 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}
CHI2_AT_0_001 |= {10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


@pytest.mark.asyncio
async def test_sampled_tokens_keep_the_models_distribution_with_mtp(
    agreeing: Any, prompt_of: Callable[[int, int], list[int]]
) -> None:
    """Temperature 1.5, top-k 4, top-p 0.95, each request seeded: over 800 requests the
    pair of their first two tokens (the second from a step verifying the MTP layer's
    proposal, kept or replaced by the rejection rule) follows the model's own
    distribution, computed from transformers' logits (chi-square, p = 0.001, cells
    expecting fewer than 5 pooled)."""
    import torch

    from hybridkv.executor.draw import filter_logits

    num = 800
    prompt = prompt_of(20, 40)
    executor = _executor(agreeing.path, 1, kv_cache_bytes=8 << 20)
    config = _mtp_config(executor, 1, max_num_seqs=256, max_num_batched_tokens=1024)
    counts: dict[tuple[int, int], int] = {}

    async def one(engine: Engine, seed: int) -> None:
        params = SamplingParams(temperature=1.5, top_k=4, top_p=0.95, seed=seed, max_tokens=3)
        async with engine.generate(prompt, params) as stream:
            async for out in stream:
                tokens = list(out.token_ids)
        pair = (tokens[0], tokens[1])
        counts[pair] = counts.get(pair, 0) + 1

    with anyio.fail_after(300):
        async with Engine(config, executor) as engine:
            async with anyio.create_task_group() as tg:
                for seed in range(num):
                    tg.start_soon(one, engine, seed)
            spec = engine.stats().spec_decode
    executor.close()
    assert spec.num_drafts > num // 2 and spec.num_accepted_tokens > 0
    params = SamplingParams(temperature=1.5, top_k=4, top_p=0.95)

    def dist(tokens: list[int]) -> torch.Tensor:
        row = agreeing.reference_logits(tokens)[-1]
        return filter_logits(row, params).softmax(-1).double()

    first = dist(prompt)
    expected = {
        (a, b): float(first[a] * p)
        for a in first.nonzero().flatten().tolist()
        for b, p in enumerate(dist([*prompt, a]).tolist())
        if p > 0
    }
    assert set(counts) <= set(expected), "a pair the model never samples was drawn"
    cells = sorted(expected, key=lambda c: expected[c])
    pooled, observed, rest = [], [], (0.0, 0)
    for cell in cells:
        want, got = expected[cell] * num, counts.get(cell, 0)
        if want < 5:
            rest = (rest[0] + want, rest[1] + got)
        else:
            pooled.append(want)
            observed.append(got)
    if rest[0]:
        pooled.append(rest[0])
        observed.append(rest[1])
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, pooled, strict=True))
    assert chi2 < CHI2_AT_0_001[len(pooled) - 1], (chi2, len(pooled))
