"""The workloads of hybrid_cliffs.py (repeats, a shared prefix, chats) and hybridkv's run of
them: EngineCore with the checking fake executor at the plan's pool."""

from __future__ import annotations

import argparse
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from benchmarks.common.layouts import Layout
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor, reference_tokens
from hybridkv.scheduler.speculation import Proposer, SpeculativeConfig

VOCAB = 32000
#: The block size the issue's goals are stated in.
GOAL_BLOCK = 16
REPEAT_LENGTHS = (100, 300, 500, 1000, 3000)
CAPACITY_TOKENS = (4096, 32768)


# -- workloads -----------------------------------------------------------------------------


@attrs.frozen
class Job:
    """One request: its prompt, the tokens the fake model samples after it, the job that
    must end before it is queued, and whether its hit counts in the workload's rate."""

    key: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    after: str | None = None
    counted: bool = True


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _job(key: str, prompt: list[int], num_output: int, **kw: Any) -> Job:
    output = reference_tokens(prompt, num_output, VOCAB)  # what FakeExecutor samples
    return Job(key, tuple(prompt), tuple(output), **kw)


def repeat_jobs(rng: random.Random, num_output: int) -> list[Job]:
    """Each length's prompt, then its repeat, one request at a time."""
    jobs: list[Job] = []
    for length in REPEAT_LENGTHS:
        prompt = random_tokens(rng, length)
        last = jobs[-1].key if jobs else None
        jobs.append(_job(f"{length}.first", prompt, num_output, after=last, counted=False))
        jobs.append(_job(f"{length}.repeat", prompt, num_output, after=jobs[-1].key))
    return jobs


def shared_prefix_jobs(rng: random.Random, args: argparse.Namespace) -> list[Job]:
    """vLLM #45238: requests queued at once, one shared prefix, unique suffixes."""
    prefix = random_tokens(rng, args.prefix_tokens)
    return [
        _job(f"r{i}", prefix + random_tokens(rng, args.suffix_tokens), args.output_tokens)
        for i in range(args.requests)
    ]


def chat_jobs(seed: int, sessions: int | None = None) -> tuple[list[Job], dict[str, Any]]:
    """``multisession.py``'s sessions at its defaults (``sessions`` of them where given),
    each reply the fake model's."""
    import benchmarks.allocator.multisession as multisession
    from benchmarks.allocator.multisession_run import Session

    wargs = multisession.parse_args([] if sessions is None else ["--sessions", str(sessions)])
    rng = random.Random(seed)
    sessions = [Session(i, rng, wargs) for i in range(wargs.sessions)]
    jobs: list[Job] = []
    goal_hit = 0
    for s in sessions:
        for turn in range(wargs.turns):
            prompt = s.prompt(turn)
            s.replies[turn] = reference_tokens(prompt, len(s.replies[turn]), VOCAB)
            key = f"s{s.index}t{turn}"
            after = f"s{s.index}t{turn - 1}" if turn else None
            jobs.append(Job(key, tuple(prompt), tuple(s.replies[turn]), after, turn > 0))
            if turn:  # the whole conversation so far, to its last 16-token boundary
                done = min(s.turn_length(turn - 1), len(prompt) - 1)
                goal_hit += done // GOAL_BLOCK * GOAL_BLOCK
    settings = {
        key: getattr(wargs, key)
        for key in ("sessions", "turns", "system_tokens", "user_tokens", "reply_tokens",
                    "in_flight", "budget")
    }  # fmt: skip
    counted = sum(len(j.prompt) for j in jobs if j.counted)
    settings["goal_hit_rate"] = round(goal_hit / counted, 3)
    return jobs, settings


def job_order(jobs: Sequence[Job]) -> tuple[deque[Job], dict[str, list[Job]]]:
    """The jobs queued at the start, and per job those queued when it ends."""
    children: dict[str, list[Job]] = {}
    for job in jobs:
        if job.after is not None:
            children.setdefault(job.after, []).append(job)
    return deque(j for j in jobs if j.after is None), children


def run_summary(jobs: Sequence[Job], hits: dict[str, int], preemptions: int) -> dict[str, Any]:
    counted = [j for j in jobs if j.counted]
    hit = sum(hits[j.key] for j in counted)
    prompt = sum(len(j.prompt) for j in counted)
    return {
        "hits": {j.key: hits[j.key] for j in counted},
        "requests_hit": sum(hits[j.key] > 0 for j in counted),
        "tokens_hit": hit,
        "hit_rate": round(hit / max(prompt, 1), 3),
        "preemptions": preemptions,
    }


# -- hybridkv: EngineCore with the checking fake ------------------------------------------


def run_ours(
    layout: Layout,
    jobs: Sequence[Job],
    in_flight: int,
    budget: int,
    *,
    speculative: SpeculativeConfig | None = None,
    proposer: Proposer | None = None,
) -> dict[str, Any]:
    """Serve ``jobs`` through the engine core and the fake at ``layout``'s pool (with
    ``speculative``, every decode verifying what ``proposer`` proposes)."""
    fake = FakeExecutor(layout.pool, vocab_size=VOCAB)
    config = EngineConfig.for_executor(
        fake,
        max_model_len=max(len(j.prompt) + len(j.output) for j in jobs) + 1,
        max_num_batched_tokens=budget,
        vocab_size=None,  # the chat's prompt tokens are multisession's, beyond the fake's
        speculative_config=speculative,
    )
    core = EngineCore(config, proposer=proposer)
    waiting, children = job_order(jobs)
    running: dict[str, tuple[Job, CollectingSink]] = {}
    hits: dict[str, int] = {}
    while waiting or running:
        while waiting and len(running) < in_flight:
            job = waiting.popleft()
            sink = CollectingSink()
            params = SamplingParams(max_tokens=len(job.output), ignore_eos=True)
            core.add_request(list(job.prompt), params, sink, request_id=job.key)
            running[job.key] = (job, sink)
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
        core.flush()
        for key, (job, sink) in list(running.items()):
            if not sink.is_closed:
                continue
            del running[key]
            errors = [item for item in sink.items if isinstance(item, Exception)]
            if errors:
                raise errors[0]
            tokens = tuple(t for out in sink.items for t in out.new_token_ids)
            assert tokens == job.output, f"{key}: the fake's tokens differ from its reference"
            hits[key] = sink.items[0].num_cached_tokens
            waiting.extend(children.get(key, ()))
    return {
        **run_summary(jobs, hits, core.stats().num_preemptions),
        "num_blocks": config.num_blocks,
    }
