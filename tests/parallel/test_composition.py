"""Issue 27's matrix: every pair and triple of tensor, pipeline and context ranks, host and
Redis offload tiers, prefix caching, several steps in flight, a Mamba2 hybrid and a user's
policy either runs on tiny models with one process's tokens (and logits within 1e-5), or
is refused at start, before any worker process starts, by an error naming both parts.

The table is two lists: the refused pairs (a combination holding one is refused; why,
where and what the error says) and the runs (``OFFLOAD_RUNS``, ``RANK_RUNS``), each one
covering every pair and triple of its features, all on at once. The first test holds
them against every pair and triple, so a new feature must be classified; the last starts
each refused pair and triple where it is refused. The runs of four and eight processes
are slow.
"""

from __future__ import annotations

import enum
import itertools
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import pytest
import torch
from policy_samples import SinkWindow

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.offload import HostTier, OffloadConfig, RedisTier, TierSpec
from hybridkv.models.errors import ParallelConfigError
from hybridkv.parallel.pipeline_executor import PipelineExecutor
from hybridkv.policies import FullAttention, MambaLike
from hybridkv.scheduler import ConfigError, Engine, EngineConfig, SamplingParams
from hybridkv.scheduler.fake import FakeExecutor
from hybridkv.scheduler.fake_pipelined import PipelinedFakeExecutor


class Feature(enum.StrEnum):
    """One part of a composition."""

    TP = "tensor ranks"
    PP = "pipeline stages"
    CP = "context ranks"
    HOST = "host offload"
    REDIS = "Redis offload"
    PREFIX = "prefix caching"
    IN_FLIGHT = "several steps in flight"
    MAMBA = "Mamba2 hybrid"
    POLICY = "user policy"


F = Feature
RANKS = frozenset({F.TP, F.PP, F.CP})
TIERS = frozenset({F.HOST, F.REDIS})


@attrs.frozen
class Refusal:
    """Why a pair cannot run, where it is refused, and what the error says of each part.

    ``where``: ``load`` (``PipelineExecutor.from_pretrained``, before it spawns) or ``engine``
    (``Engine(...)``: only it sees both the executor's steps in flight and the tiers).
    """

    reason: str
    where: str
    names: tuple[str, str]


REFUSED: dict[frozenset[Feature], Refusal] = {
    frozenset({F.CP, F.MAMBA}): Refusal(
        "a state layer's recurrence runs a request's tokens in order; context ranks split them",
        "load",
        ("context parallelism", "is a state layer"),
    ),
    frozenset({F.CP, F.POLICY}): Refusal(
        "the ring attends each shard to one window of keys; sinks + window are two spans",
        "load",
        ("context parallelism", "keeps SinkWindow("),
    ),
    **{
        frozenset({F.IN_FLIGHT, tier}): Refusal(
            "the connector loads and saves pages around one step at a time",
            "engine",
            ("KV offload", "one step in flight"),
        )
        for tier in TIERS
    },
}


@attrs.frozen(kw_only=True)
class Run:
    """A run on a tiny model with every feature of ``features`` on at once."""

    features: frozenset[Feature]
    model: str
    tp: int = 1
    pp: int = 1
    cp: int = 1


#: Offload runs one step at a time, in one process or over ranks (each moving its share).
OFFLOAD_RUNS = {
    "one process": Run(
        features=frozenset({F.HOST, F.REDIS, F.PREFIX, F.MAMBA, F.POLICY}), model="bamba"
    ),
    "tp-hybrid": Run(
        features=frozenset({F.TP, F.HOST, F.REDIS, F.PREFIX, F.MAMBA, F.POLICY}),
        model="bamba",
        tp=2,
    ),
    "tp-pp-hybrid": Run(
        features=frozenset({F.TP, F.PP, F.HOST, F.REDIS, F.PREFIX, F.MAMBA, F.POLICY}),
        model="bamba",
        tp=2,
        pp=2,
    ),
    "tp-pp-cp": Run(
        features=frozenset({F.TP, F.PP, F.CP, F.HOST, F.REDIS, F.PREFIX}),
        model="gemma3",
        tp=2,
        pp=2,
        cp=2,
    ),
}
#: The rank runs go through the Engine, two steps in flight.
RANK_RUNS = {
    "tp": Run(features=frozenset({F.TP, F.IN_FLIGHT, F.PREFIX, F.POLICY}), model="llama", tp=2),
    "tp-pp-hybrid": Run(
        features=frozenset({F.TP, F.PP, F.IN_FLIGHT, F.PREFIX, F.MAMBA, F.POLICY}),
        model="bamba",
        tp=2,
        pp=2,
    ),
    "tp-pp-cp": Run(
        features=frozenset({F.TP, F.PP, F.CP, F.IN_FLIGHT, F.PREFIX}),
        model="gemma3",
        tp=2,
        pp=2,
        cp=2,
    ),
}
RUNS = (*OFFLOAD_RUNS.values(), *RANK_RUNS.values())
#: The runs of more than two processes.
SLOW_RUNS = frozenset({"tp-pp-hybrid", "tp-pp-cp"})


def classify(parts: frozenset[Feature]) -> Refusal | Run | None:
    """The refusal of a refused pair among ``parts``, else a run covering them, else None."""
    for pair, refusal in REFUSED.items():
        if pair <= parts:
            return refusal
    return next((run for run in RUNS if parts <= run.features), None)


def where_refused(parts: frozenset[Feature]) -> str:
    """Where a refused combination is stopped: tiers beside steps in flight by the engine,
    layers context ranks cannot split at load."""
    return "engine" if parts & TIERS and F.IN_FLIGHT in parts else "load"


COMBINATIONS = [frozenset(c) for size in (2, 3) for c in itertools.combinations(Feature, size)]
REFUSED_COMBINATIONS = [c for c in COMBINATIONS if isinstance(classify(c), Refusal)]


def test_every_pair_and_triple_is_run_or_refused() -> None:
    """Each pair and triple is refused by a pair among it or covered by a run; no run
    holds a refused pair; each refused pair is stopped where it says."""
    for parts in COMBINATIONS:
        assert classify(parts) is not None, f"neither run nor refused: {sorted(parts)}"
    for run in RUNS:
        assert not [pair for pair in REFUSED if pair <= run.features], run
    for pair, refusal in REFUSED.items():
        assert len(pair) == 2 and where_refused(pair) == refusal.where, pair


# -- supported: one process's tokens ----------------------------------------------------

KV_BYTES = 1 << 20
#: Sinks + window, as long as the tiny models' sliding window: prompts lose their middle.
POLICY = SinkWindow(sinks=4, window=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

#: Tokens, and logits at each sampled step, per request id.
Outputs = tuple[dict[str, list[int]], dict[str, torch.Tensor]]


def _load_options(parts: frozenset[Feature], kv_cache_bytes: int = KV_BYTES) -> LoadOptions:
    policies = {"full_attention": POLICY} if F.POLICY in parts else {}
    return LoadOptions(
        kv_cache_bytes=kv_cache_bytes, block_size=4, num_threads=1, policies=policies
    )


def _record_logits(executor: Any) -> dict[str, list[torch.Tensor]]:
    """Every sampled row the executor computes from now on, by request id."""
    rows: dict[str, list[torch.Tensor]] = {}
    executor.logits_hook = lambda rid, row: rows.setdefault(rid, []).append(row.clone())
    return rows


async def _serve_waves(
    executor: Any, waves: Sequence[Sequence[Sequence[int]]]
) -> tuple[Outputs, dict[str, int]]:
    """Each wave's prompts at once through one Engine, a wave after the last has ended (so
    it can hit what the last cached); the outputs, and each request's cached tokens."""
    rows = _record_logits(executor)
    config = EngineConfig.for_executor(
        executor, max_model_len=64, max_num_batched_tokens=16, max_prefill_chunk=8
    )
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    async def consume(engine: Engine, request_id: str, prompt: Sequence[int]) -> None:
        async with engine.generate(prompt, GREEDY, request_id=request_id) as stream:
            async for output in stream:
                tokens[request_id] = list(output.token_ids)
                cached[request_id] = output.num_cached_tokens

    with anyio.fail_after(120):
        async with Engine(config, executor) as engine:
            for w, prompts in enumerate(waves):
                async with anyio.create_task_group() as tg:
                    for i, prompt in enumerate(prompts):
                        tg.start_soon(consume, engine, f"{w}.{i}", prompt)
    return (tokens, {rid: torch.stack(r) for rid, r in rows.items()}), cached


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUNS else n for n in RANK_RUNS]
)
async def test_ranks_with_two_steps_in_flight_give_one_process_s_outputs(
    name, tiny_models, prompt_of, check_same_outputs
) -> None:
    """Each rank run through the Engine, two steps in flight, prefills in chunks of 8, a
    second wave hitting the first's 26-token prefix: one process's tokens and logits."""
    run = RANK_RUNS[name]
    path, options = tiny_models[run.model].path, _load_options(run.features)
    shared = prompt_of(26, 4)
    waves = [
        [shared + prompt_of(5, 5), prompt_of(18, 7)],
        [shared + prompt_of(6, 6), shared + prompt_of(9, 8), prompt_of(11, 9)],
    ]
    one = ModelExecutor.from_pretrained(path, options)
    try:
        expected, _ = await _serve_waves(one, waves)
    finally:
        one.close()
    with PipelineExecutor.from_pretrained(
        path, options, pipeline_parallel_size=run.pp, tensor_parallel_size=run.tp,
        context_parallel_size=run.cp, max_steps_in_flight=2, step_timeout_s=60.0,
    ) as executor:  # fmt: skip
        assert executor.world_size == run.tp * run.pp * run.cp
        got, cached = await _serve_waves(executor, waves)
        assert executor.peak_steps_in_flight == 2
    check_same_outputs(got, expected)
    assert cached["1.0"] >= 24 and cached["1.1"] >= 24  # the shared prefix was hit
    assert not multiprocessing.active_children()


#: About 40 pages of 4 tokens per group: three other prompts flush a 72-token document.
OFFLOAD_POOL = 40 * 2 * 1024


def _count_reads(tier: Any) -> list[int]:
    """A one-item list counting the blocks ``tier`` returns from now on."""
    found = [0]
    real_get = tier.get

    def get(keys: Sequence[bytes]) -> list[Any]:
        values = real_get(keys)
        found[0] += sum(value is not None for value in values)
        return values

    tier.get = get
    return found


async def _serve_in_turn(
    executor: ModelExecutor | PipelineExecutor,
    prompts: Sequence[Sequence[int]],
    offload: OffloadConfig | None,
    after_first: Callable[[], None],
) -> Outputs:
    """Each prompt alone, in turn, through one Engine with ``offload``'s tiers, its saves
    finished before the next; ``after_first`` runs once the first prompt's are."""
    rows = _record_logits(executor)
    config = EngineConfig.for_executor(executor, max_model_len=128, max_prefill_chunk=32)
    tokens: dict[str, list[int]] = {}
    with anyio.fail_after(120):
        async with Engine(config, executor, offload=offload) as engine:
            for i, prompt in enumerate(prompts):
                async with engine.generate(prompt, GREEDY, request_id=str(i)) as stream:
                    async for output in stream:
                        tokens[str(i)] = list(output.token_ids)
                _wait_saved(executor)
                if i == 0:
                    after_first()
    return tokens, {rid: torch.stack(r) for rid, r in rows.items()}


def _wait_saved(executor: ModelExecutor | PipelineExecutor) -> None:
    """Wait until the saves this process queued are written (a pipeline's: rank 0's; the
    other ranks write theirs meanwhile, and a block one of them lacks is recomputed)."""
    if isinstance(executor, PipelineExecutor):
        ranks = executor._runner.transfers
        worker = None if ranks is None else ranks.worker
    else:
        worker = executor.transfers
    if worker is not None:
        assert worker.wait_saved()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUNS else n for n in OFFLOAD_RUNS]
)
async def test_host_and_redis_tiers_serve_a_hybrid_with_a_user_policy(
    name, tiny_models, prompt_of, redis_server, check_same_outputs
) -> None:
    """Both tiers, in one process or with every rank moving its share: a document flushed
    from the pool loads for its repeat, the blocks rank 0's host tier lost (its oldest
    half, as under LRU pressure) from Redis, the rest from host memory; the tokens and
    logits are one process's recomputing it without tiers. On Bamba the sink + window
    policy keeps its attention layer."""
    run = OFFLOAD_RUNS[name]
    path = tiny_models[run.model].path
    ranks = run.tp * run.pp * run.cp
    document = prompt_of(72, 5)
    prompts = [[*document, 7, 8], *(prompt_of(60, 100 + k) for k in range(3)), [*document, 9]]

    async def serve(offload: OffloadConfig | None, after_first: Callable[[], None]) -> Outputs:
        executor: ModelExecutor | PipelineExecutor
        if offload is None or ranks == 1:
            options = _load_options(run.features, OFFLOAD_POOL)
            executor = ModelExecutor.from_pretrained(path, options)
        else:
            # As many tokens as one process: a tensor rank's page holds its heads, a context
            # rank's its tokens (a stage plans the pages of every layer: bytes per stage).
            options = _load_options(run.features, OFFLOAD_POOL // (run.tp * run.cp))
            executor = PipelineExecutor.from_pretrained(
                path, options, pipeline_parallel_size=run.pp, tensor_parallel_size=run.tp,
                context_parallel_size=run.cp, max_steps_in_flight=1, step_timeout_s=60.0,
            )  # fmt: skip
        try:
            return await _serve_in_turn(executor, prompts, offload, after_first)
        finally:
            executor.close()

    expected = await serve(None, lambda: None)
    specs = [TierSpec("host", capacity_bytes=64 << 20), TierSpec("redis", url=redis_server.url)]
    offload = OffloadConfig.from_specs(specs, save_interval=16)
    host, redis = offload.tiers
    host_reads, redis_reads = _count_reads(host), _count_reads(redis)

    def forget_oldest_half() -> None:
        assert isinstance(host, HostTier)
        keys = host.held_keys()
        host.delete(keys[: len(keys) // 2])

    got = await serve(offload, forget_oldest_half)
    check_same_outputs(got, expected)
    assert sum(offload.stats.hit_tokens.values()) >= 64
    assert host_reads[0] and redis_reads[0]
    assert not multiprocessing.active_children()


# -- refused: at start, before any worker process, naming both parts ---------------------

#: ``--kv-offload`` values; the Redis tier connects lazily, so none is reached.
_TIER_FLAGS = {F.HOST: "host:1MiB", F.REDIS: "redis://127.0.0.1:6379/0"}


def _model(parts: frozenset[Feature]) -> str:
    return "bamba" if F.MAMBA in parts else "llama"


def _start_load(parts: frozenset[Feature], models: Any, capsys: Any) -> str:
    """``PipelineExecutor.from_pretrained`` with every part: it must refuse. Its error."""
    with pytest.raises(ParallelConfigError) as info:
        PipelineExecutor.from_pretrained(
            models[_model(parts)].path, _load_options(parts),
            pipeline_parallel_size=2 if F.PP in parts else 1,
            tensor_parallel_size=2 if F.TP in parts else 1,
            context_parallel_size=2 if F.CP in parts else 1,
            max_steps_in_flight=2 if F.IN_FLIGHT in parts else None,
        )  # fmt: skip
    return str(info.value)


def _start_engine(parts: frozenset[Feature], models: Any, capsys: Any) -> str:
    """An Engine over an executor keeping two steps in flight (a fake: the refusal needs no
    model, and no process then exists at all), given the tiers: it must refuse."""
    tiers = [HostTier(1 << 20)] if F.HOST in parts else []
    tiers += [RedisTier(_TIER_FLAGS[F.REDIS])] if F.REDIS in parts else []
    policies = [POLICY if F.POLICY in parts else FullAttention()]
    policies += [MambaLike()] if F.MAMBA in parts else []
    config = EngineConfig(
        policies=policies, num_blocks=32, block_size=4, max_model_len=32,
        enable_prefix_caching=True,
    )  # fmt: skip
    with (
        PipelinedFakeExecutor(FakeExecutor.for_config(config), num_stages=2) as executor,
        pytest.raises(ConfigError) as info,
    ):
        Engine(config, executor, offload=OffloadConfig(tiers=tiers))
    return str(info.value)


def _name(parts: frozenset[Feature]) -> str:
    return "-".join(p.name.lower() for p in Feature if p in parts)


_STARTS = {"load": _start_load, "engine": _start_engine}


@pytest.mark.parametrize("parts", REFUSED_COMBINATIONS, ids=_name)
def test_every_refused_pair_and_triple_is_refused_at_start(parts, tiny_models, capsys) -> None:
    """Started with all its parts where it is refused, a refused pair or triple fails
    before any worker process starts, and the error names both parts of a refused pair
    among them (on the command line, ``-pp`` stands for steps in flight)."""
    where = where_refused(parts)
    error = _STARTS[where](parts, tiny_models, capsys)
    named = [r.names for pair, r in REFUSED.items() if pair <= parts and r.where == where]
    assert any(all(name in error for name in names) for names in named), error
    assert not multiprocessing.active_children()
