"""Workloads for the demo and the benchmark, and the runner that drives them through an engine.

The demo workload is what a support chatbot sees: every request starts with the same
system prompt (so the prefix cache serves it after the first), most ask a short question,
some paste a long document (longer than a 512-token sliding window), and they arrive
over time, each one streamed. The synthetic one has fixed lengths and random tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import anyio
import attrs
from tokenizers import Tokenizer

from hybridkv.scheduler import Engine, EngineStats, SamplingParams
from hybridkv.serving.cli.workload.text import DOCUMENT_PARAGRAPHS, QUESTIONS, SYSTEM_PROMPT


@attrs.frozen(kw_only=True)
class WorkloadRequest:
    """One request of a workload, with when it arrives (seconds after the start)."""

    request_id: str
    kind: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_s: float


@attrs.define(kw_only=True)
class RequestRecord:
    """What happened to one request."""

    request_id: str
    kind: str
    num_prompt_tokens: int
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    output_token_ids: list[int] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class PagesSample:
    """The pages each KV group held at one point of a run."""

    step: int  # engine steps run so far (EngineStats.num_steps)
    elapsed_s: float  # since the run started
    blocks_per_group: tuple[int, ...]


@attrs.frozen(kw_only=True)
class WorkloadResult:
    """A finished run: per-request records, wall time, the pool at its fullest, and the
    pages per group over the run (:class:`PagesSample`, at most one per engine step)."""

    records: tuple[RequestRecord, ...]
    elapsed_s: float
    peak_blocks_per_group: tuple[int, ...]
    num_preemptions: int
    prefix_hit_rate: float
    pages: tuple[PagesSample, ...] = ()


def demo_workload(
    tokenizer: Tokenizer,
    *,
    num_requests: int = 24,
    long_every: int = 4,
    rate_per_s: float = 4.0,
    max_tokens: int = 32,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Requests sharing :data:`SYSTEM_PROMPT`; every ``long_every``-th pastes a long document.

    Arrivals are a Poisson process of ``rate_per_s``; sampling is greedy.
    """
    rng = random.Random(seed)
    out, clock = [], 0.0
    for i in range(num_requests):
        if long_every and i % long_every == long_every - 1:
            paragraphs = rng.sample(DOCUMENT_PARAGRAPHS, k=len(DOCUMENT_PARAGRAPHS))
            report = "\n\n".join(paragraphs)
            turn = f"Here is my trip report.\n\n{report}\n\nCan you summarise it?"
            prompt, kind = f"{SYSTEM_PROMPT}\n\nCustomer: {turn}\nAgent: In short,", "long"
        else:
            question = rng.choice(QUESTIONS)
            prompt, kind = f"{SYSTEM_PROMPT}\n\nCustomer: {question}\nAgent:", "short"
        out.append(
            WorkloadRequest(
                request_id=f"demo-{i}",
                kind=kind,
                prompt_token_ids=tuple(tokenizer.encode(prompt).ids),
                params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                arrival_s=clock,
            )
        )
        clock += rng.expovariate(rate_per_s)
    return out


def synthetic_workload(
    *,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    shared_prefix_len: int = 0,
    vocab_size: int,
    rate_per_s: float | None = None,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Random-token prompts of fixed length (an optional shared prefix), fixed output length.

    ``rate_per_s=None`` sends every request at once.
    """
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    low = min(256, vocab_size // 2)
    prefix = [rng.randrange(low, vocab_size) for _ in range(shared_prefix_len)]
    out, clock = [], 0.0
    for i in range(num_requests):
        tail = [rng.randrange(low, vocab_size) for _ in range(prompt_len - len(prefix))]
        out.append(
            WorkloadRequest(
                request_id=f"bench-{i}",
                kind="synthetic",
                prompt_token_ids=tuple(prefix + tail),
                params=SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True),
                arrival_s=clock,
            )
        )
        if rate_per_s is not None:
            clock += rng.expovariate(rate_per_s)
    return out


async def run_workload(
    engine: Engine,
    requests: Sequence[WorkloadRequest],
    *,
    on_tokens: Callable[[RequestRecord, int], None] | None = None,
    on_finish: Callable[[RequestRecord], None] | None = None,
) -> WorkloadResult:
    """Send each request at its arrival time, stream it, and record what happened.

    ``on_tokens`` is called with each output's record and new token count, ``on_finish``
    once per request (both on the event loop's thread; keep them quick).

    The pages per group are read from ``engine.stats()`` where each output arrives (as the
    peak always was) and kept once per engine step: the first output of a step adds a
    :class:`PagesSample`; the run's start adds one, and its end one where the pages moved
    since. A step whose outputs reach no consumer (a prefill chunk that samples nothing)
    shows in the next sample.
    """
    records = [
        RequestRecord(
            request_id=r.request_id, kind=r.kind, num_prompt_tokens=len(r.prompt_token_ids)
        )
        for r in requests
    ]
    num_groups = len(engine.config.policies)
    peak = [0] * num_groups
    first = engine.stats()
    before = first.num_preemptions
    start = time.monotonic()
    pages = [
        PagesSample(
            step=first.num_steps, elapsed_s=0.0, blocks_per_group=first.blocks_used_per_group
        )
    ]

    def sample(stats: EngineStats, *, last: bool = False) -> None:
        held = stats.blocks_used_per_group
        if stats.num_steps != pages[-1].step or (last and held != pages[-1].blocks_per_group):
            pages.append(
                PagesSample(
                    step=stats.num_steps,
                    elapsed_s=time.monotonic() - start,
                    blocks_per_group=held,
                )
            )

    async def one(request: WorkloadRequest, record: RequestRecord) -> None:
        await anyio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
        sent = time.monotonic()
        stream = engine.generate(
            request.prompt_token_ids, request.params, request_id=request.request_id
        )
        async with stream:
            async for out in stream:
                if record.ttft_s is None and out.new_token_ids:
                    record.ttft_s = time.monotonic() - sent
                record.output_token_ids.extend(out.new_token_ids)
                record.num_output_tokens = out.num_output_tokens
                record.num_cached_tokens = out.num_cached_tokens
                stats = engine.stats()
                used = stats.blocks_used_per_group
                peak[:] = [max(p, u) for p, u in zip(peak, used, strict=True)]
                sample(stats)
                if on_tokens is not None:
                    on_tokens(record, len(out.new_token_ids))
        record.latency_s = time.monotonic() - sent
        if on_finish is not None:
            on_finish(record)

    async with anyio.create_task_group() as tg:
        for request, record in zip(requests, records, strict=True):
            tg.start_soon(one, request, record)
    stats = engine.stats()
    sample(stats, last=True)
    return WorkloadResult(
        records=tuple(records),
        elapsed_s=time.monotonic() - start,
        peak_blocks_per_group=tuple(peak),
        num_preemptions=stats.num_preemptions - before,
        prefix_hit_rate=stats.prefix_hit_rate,
        pages=tuple(pages),
    )
