"""Log-probabilities through the real engine equal transformers' log-softmax."""

from __future__ import annotations

import anyio
import pytest
import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.logprobs import prompt_logprobs, token_logprobs
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.scheduler import Engine, EngineConfig, RequestOutput, SamplingParams, TokenLogprobs

TOL = 1e-4


def assert_close(got: TokenLogprobs, reference: torch.Tensor, token_id: int, num_top: int) -> None:
    """``got`` matches the reference log-softmax row for ``token_id`` and its top."""
    assert got.token_id == token_id
    assert abs(got.logprob - float(reference[token_id])) < TOL
    assert got.rank == int((reference >= reference[token_id]).sum())
    values, ids = reference.topk(num_top)
    assert [t for t, _ in got.top] == ids.tolist()
    assert max(abs(v - float(r)) for (_, v), r in zip(got.top, values, strict=True)) < TOL


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3"])
async def test_sampled_and_prompt_logprobs_match_transformers(tiny_models, prompt_of, name):
    """logprobs=5 and prompt_logprobs=3 through chunked prefill match log_softmax."""
    model = tiny_models[name]
    executor = ModelExecutor.from_pretrained(
        model.path, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    config = EngineConfig.for_executor(executor, max_prefill_chunk=8)
    prompt = prompt_of(3, 21)
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    with anyio.fail_after(60):
        async with Engine(config, executor) as engine:
            outputs = [out async for out in engine.generate(prompt, params)]
    executor.close()
    first: RequestOutput = outputs[0]
    tokens = list(outputs[-1].token_ids)
    reference = torch.log_softmax(model.reference_logits(prompt + tokens), dim=-1)
    assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
    assert len(first.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(first.prompt_logprobs[1:], start=1):
        assert entry is not None
        assert_close(entry, reference[i - 1], prompt[i], 3)
    sampled = [lp for out in outputs for lp in out.logprobs or ()]
    assert len(sampled) == len(tokens)
    for j, (entry, token) in enumerate(zip(sampled, tokens, strict=True)):
        assert_close(entry, reference[len(prompt) - 1 + j], token, 5)
        assert entry.rank == 1  # greedy samples the top token


@pytest.mark.asyncio
async def test_logprobs_off_leave_outputs_bare(tiny_models, prompt_of):
    """Without logprobs asked, outputs carry none (and nothing is computed for them)."""
    executor = ModelExecutor.from_pretrained(
        tiny_models["llama"].path, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    config = EngineConfig.for_executor(executor)
    with anyio.fail_after(30):
        async with Engine(config, executor) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=3)
            outputs = [out async for out in engine.generate(prompt_of(1, 9), params)]
    executor.close()
    assert all(out.logprobs is None and out.prompt_logprobs is None for out in outputs)


def test_rank_counts_ties_and_top_is_sorted() -> None:
    """Rank counts tokens at least as likely; top entries come most likely first."""
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0]])
    (entry,) = token_logprobs(logits, [2], [3])
    expected = torch.log_softmax(logits[0], -1)
    assert entry.rank == 2
    assert [t for t, _ in entry.top] in ([1, 2, 0], [2, 1, 0])
    assert entry.logprob == pytest.approx(float(expected[2]))


def test_prompt_logprobs_slice_long_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt logprobs computed a few rows at a time equal those computed at once."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 7, generator=generator)
    head = torch.randn(7, 13, generator=generator)
    targets = [i % 13 for i in range(11)]
    whole = prompt_logprobs(hidden, targets, 2, lambda h: h @ head)
    monkeypatch.setattr("hybridkv.executor.logprobs.PROMPT_LOGITS_ROWS", 4)
    sliced = prompt_logprobs(hidden, targets, 2, lambda h: h @ head)
    assert [(e.token_id, e.rank, [t for t, _ in e.top]) for e in sliced] == [
        (e.token_id, e.rank, [t for t, _ in e.top]) for e in whole
    ]
    assert [e.logprob for e in sliced] == pytest.approx([e.logprob for e in whole], abs=1e-5)
