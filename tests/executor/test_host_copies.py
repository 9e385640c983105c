"""The step loop reads back from the device only the sampled ids (and logprobs asked for).

Each test runs real steps of a tiny model under :class:`HostCopyGuard`, which counts, on
the CPU, every read of a tensor that would live on the device; the one a step may make
goes through ``hybridkv.executor.host_copy`` (``executor/host_copy.py`` says why).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from hybridkv.executor.sampler import Sampler
from hybridkv.executor.speculative import verify_rows
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.params import SamplingParams
from hybridkv.testing.host_copies import HostCopyError, HostCopyGuard

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def guarded(driver):
    """A guard over the driver's executor, whose steps then run on this thread."""
    driver.executor.close()
    return HostCopyGuard.for_executor(driver.executor)


def with_history(driver):
    """Steps whose requests carry their tokens so far, as the engine's do (penalties read
    them; the driver leaves them out)."""
    execute = driver.executor.execute

    def run(batch):
        tokens = {rid: list(seq.all_token_ids) for rid, seq in driver.active.items()}
        requests = [attrs.evolve(r, all_token_ids=tokens[r.request_id]) for r in batch.requests]
        return execute(attrs.evolve(batch, requests=tuple(requests)))

    driver.executor.execute = run


def run_steps(driver, guard, num_steps, chunk):
    """``num_steps`` steps under ``guard``; how many of them sampled a token."""
    sampled = 0
    with guard:
        for _ in range(num_steps):
            before = sum(len(s.output) for s in driver.active.values())
            driver.step(chunk)
            sampled += sum(len(s.output) for s in driver.active.values()) > before
    return sampled


@pytest.mark.parametrize("name", ["llama", "gemma3", "bamba", "granite_moe"])
def test_mixed_steps_read_back_only_the_sampled_ids(make_driver, prompt_of, name):
    """Chunked prefills beside decodes: one copy per step that samples, no other."""
    driver = make_driver(name)
    driver.add("long", prompt_of(23, 1))
    driver.add("short", prompt_of(3, 2))
    driver.add("mid", prompt_of(9, 3))
    guard = guarded(driver)
    sampled = run_steps(driver, guard, 8, chunk=5)
    assert sampled == 8
    guard.check(to_host_list=sampled)


def test_sampler_paths_read_back_only_the_sampled_ids(make_driver, prompt_of):
    """Greedy, greedy with penalties and bias, seeded, top-k/top-p and min_tokens rows in
    one batch: still one copy per step."""
    driver = make_driver("llama")
    with_history(driver)
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "logit_bias": {7: 2.0}}
    driver.add("greedy", prompt_of(6, 1))
    driver.add("penalised", prompt_of(7, 2), attrs.evolve(GREEDY, **penalties))
    driver.add("seeded", prompt_of(5, 3), SamplingParams(temperature=0.8, seed=7))
    driver.add("nucleus", prompt_of(4, 4), SamplingParams(temperature=1.2, top_k=20, top_p=0.9))
    driver.add("min_tokens", prompt_of(4, 5), SamplingParams(temperature=0.7, min_tokens=3))
    guard = guarded(driver)
    sampled = run_steps(driver, guard, 5, chunk=4)
    guard.check(to_host_list=sampled)


def test_logprobs_are_read_back_once_per_step(make_driver, prompt_of):
    """Logprobs a request asks for come back through the one helper, once per step."""
    driver = make_driver("gemma3")
    driver.add("plain", prompt_of(5, 1))
    driver.add("asks", prompt_of(9, 2), attrs.evolve(GREEDY, logprobs=3))
    guard = guarded(driver)
    sampled = run_steps(driver, guard, 6, chunk=4)
    asked = len(driver.active["asks"].output)
    guard.check(to_host_list=sampled, to_host_rows=asked)


@pytest.mark.parametrize(
    ("params", "helper"),
    [(GREEDY, "to_host_list"), (SamplingParams(temperature=0.8, seed=3), "to_host_tensor")],
)
def test_verification_reads_back_once_per_request(params, helper):
    """Verifying proposals reads back the argmaxes (greedy) or the distributions the
    rejection rule runs on (sampled), once, and nothing else."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    request = StepRequest(
        request_id="r",
        token_ids=[5, 6, 7],
        start_position=4,
        block_tables=[[1, 2]],
        sample=True,
        params=attrs.evolve(params, repetition_penalty=1.2),
        output_index=1,
        all_token_ids=[1, 2, 3, 4, 5, 6, 7],
        num_draft_tokens=2,
    )
    with HostCopyGuard([logits]) as guard:
        verify_rows(Sampler(seed=0), logits, request)
    guard.check(**{helper: 1})


def test_the_guard_catches_a_planted_read(make_driver, prompt_of, monkeypatch):
    """An ``.item()`` of the logits inside the step is caught and named by its line; the
    same on a host tensor is not."""
    driver = make_driver("llama")
    driver.add("a", prompt_of(6, 1))
    model = driver.executor.model
    compute_logits = model.compute_logits

    def planted(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        torch.tensor([1.0, 2.0]).sum().item()
        logits.max().item()  # the planted read
        return logits

    monkeypatch.setattr(model, "compute_logits", planted)
    guard = guarded(driver)
    run_steps(driver, guard, 2, chunk=None)
    line = planted.__code__.co_firstlineno + 3
    assert [c.name for c in guard.unexpected] == ["item", "item"]
    assert all(c.where.endswith(f"test_host_copies.py:{line}") for c in guard.unexpected)
    with pytest.raises(HostCopyError, match=rf"test_host_copies.py:{line}: item \(x2\)"):
        guard.check(to_host_list=2)


def test_the_guard_tells_the_host_from_the_device():
    """Moving a host tensor to the device taints it; reading one back by ``.to("cpu")``,
    ``copy_`` into a host tensor or ``bool`` counts; host arithmetic does not."""
    weight = torch.ones(3)
    with HostCopyGuard([weight]) as guard:
        host = torch.arange(3.0)
        moved = host.to(torch.device("cpu"))
        (weight + moved).to("cpu")
        torch.zeros(3).copy_(weight)
        bool((weight > 0).any())
        int(host.sum())
    assert guard.is_tainted(moved) and not guard.is_tainted(host)
    assert [c.name for c in guard.unexpected] == ["to", "copy_", "__bool__"]
