"""KV offload over tensor, pipeline and context ranks: every rank moves its own share.

A rank holds its share of every block's pages: a tensor rank its KV heads (and Mamba2
heads), a pipeline stage its layers, a context rank its tokens. So every rank runs a
transfer worker over tiers of its own (a host tier is one process's memory; a Redis tier
is one server all ranks reach), and stores its share under keys naming it::

    hkv:<model>.tp1of2-pp0of1-cp0of1:0.full_attention:-:9b1e...

``<model>`` is rank 0's fingerprint (``executor/offload_pages.py``). The same rank of
another replica of the same layout reads the same keys; a rank of another layout never
does (nothing loads a share cut another way).

::

    rank 0, engine loop   the connector looks up and plans with rank 0's keys (a group
                          stage 0 holds no layer of: the keys of its first stage's)
    rank 0, step k        broadcast with its transfers ─▶ every rank: saves and loads of
                          the groups it holds, keys moved to its share
    every rank            its load reports ─▶ rank 0's collector (``pipeline_wire.py``)
    rank 0, collector     a load is reported to the engine once every rank has reported
                          it, failed in every (group, block) that any rank failed

A block one rank lost (its host tier evicted it, its save queue was full) fails there,
and the engine recomputes it, as when a tier loses a block in one process. Lookups run
on rank 0: a group stage 0 holds no layer of is found in a remote tier only, so a
pipeline with only host tiers is refused when some group lies past stage 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.loader import plan_stages
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.executor.offload_pages import group_kinds, pinned_buffers
from hybridkv.memory.layout import LayoutPlan
from hybridkv.memory.offload.config import OffloadConfig, TierSpec
from hybridkv.memory.offload.errors import OffloadConfigError
from hybridkv.memory.offload.keys import KeySpace, with_fingerprint
from hybridkv.memory.offload.transfers import KVTransfers, LoadReport, LoadTask
from hybridkv.memory.offload.worker import TransferWorker
from hybridkv.parallel.context_executor import ContextParallelExecutor
from hybridkv.parallel.rank_layout import ParallelConfig


@attrs.frozen
class OffloadSetup:
    """What the other ranks build their tiers and keys from (it rides on a step message).

    Attributes:
        specs: The tiers (each rank builds its own).
        save_interval: As the engine's.
        max_pending_saves: As the engine's.
        fingerprints: Per rank, the fingerprint of its share.
    """

    specs: tuple[TierSpec, ...]
    save_interval: int
    max_pending_saves: int
    fingerprints: tuple[str, ...]

    def config(self, executor: ModelExecutor) -> OffloadConfig:
        """This rank's tiers."""
        made = OffloadConfig.from_specs(
            self.specs, allocate=pinned_buffers(executor.device), save_interval=self.save_interval
        )
        return attrs.evolve(made, max_pending_saves=self.max_pending_saves)


def share_name(layout: ParallelConfig, rank: int, kv_interleave: int = 1) -> str:
    """How keys name ``rank``'s share of the pages: its place on every axis."""
    at = layout.coordinates(rank)
    name = (
        f"tp{at['tensor']}of{layout.tensor}-pp{at['pipeline']}of{layout.pipeline}"
        f"-cp{at['context']}of{layout.context}"
    )
    return name if layout.context == 1 else f"{name}i{kv_interleave}"


def group_stages(plan: LayoutPlan) -> list[int]:
    """Per KV group, the first pipeline stage holding one of its layers."""
    first: dict[int, int] = {}
    for index, names in enumerate(plan.stages):
        for name in names:
            first.setdefault(plan.layer_slots[name][0], index)
    return [first[g] for g in range(len(plan.groups))]


def model_of(executor: ModelExecutor | ContextParallelExecutor) -> ModelExecutor:
    """A rank's own model and pages (a context rank's inner executor)."""
    return executor.inner if isinstance(executor, ContextParallelExecutor) else executor


def plan_offload(
    config: OffloadConfig, stage0: ModelExecutor | ContextParallelExecutor, layout: ParallelConfig
) -> tuple[KeySpace, OffloadSetup]:
    """Rank 0's key space (its model's, each group's looked up at the first rank holding
    it) and what the other ranks are sent.

    Raises:
        OffloadConfigError: tiers built by hand (the other ranks cannot build theirs), or
            only host tiers while a group lies past stage 0 (rank 0 cannot look it up).
    """
    if not config.specs:
        raise OffloadConfigError(
            "offload over several ranks needs tiers every rank can build: make the config "
            "with OffloadConfig.from_specs"
        )
    keys = model_of(stage0).key_space()
    interleave = stage0.place.unit if isinstance(stage0, ContextParallelExecutor) else 1
    grid = layout.rank_grid()
    fingerprints = tuple(
        f"{keys.fingerprint}.{share_name(layout, rank, interleave)}"
        for rank in range(layout.world_size)
    )
    stages = group_stages(stage0.plan)
    _check_lookups(stages, keys.group_kinds, config.specs, layout.pipeline)
    holders = [fingerprints[int(grid[0, stage, 0, 0])] for stage in stages]
    setup = OffloadSetup(config.specs, config.save_interval, config.max_pending_saves, fingerprints)
    cut = f"tp={layout.tensor} pp={layout.pipeline} cp={layout.context}"
    cut += f" interleave={interleave}" if layout.context > 1 else ""
    keys = attrs.evolve(keys, fingerprint=fingerprints[0], group_fingerprints=holders, layout=cut)
    return keys, setup


def check_pipeline_tiers(
    path: str | Path, options: LoadOptions, num_stages: int, specs: Sequence[TierSpec]
) -> None:
    """What :func:`plan_offload` refuses of a pipeline's tiers, from the checkpoint's
    config alone: before any worker process starts.

    Raises:
        OffloadConfigError: only host tiers, and a KV group with no layer on stage 0.
    """
    if num_stages < 2 or _reaches_every_stage(specs):
        return  # the rest would read and plan the checkpoint for nothing
    config = options.open_checkpoint(path).config
    layers, plan = plan_stages(config.planned_layers, options, num_stages)
    kinds = group_kinds(layers, plan)
    _check_lookups(group_stages(plan), kinds, specs, num_stages)


def _check_lookups(
    stages: Sequence[int], kinds: Sequence[str], specs: Sequence[TierSpec], num_stages: int
) -> None:
    """Rank 0 looks up every block: a group past stage 0 needs a tier it can reach."""
    if _reaches_every_stage(specs):
        return
    for group, stage in enumerate(stages):
        if stage:
            raise OffloadConfigError(
                f"a host tier with pipeline_parallel_size={num_stages}: KV group {group} "
                f"({kinds[group]}) has no layer on stage 0, whose process looks up every "
                f"block, and stage {stage}'s host memory is its own; add a redis:// tier"
            )


def _reaches_every_stage(specs: Sequence[TierSpec]) -> bool:
    """Whether rank 0 can look up what any stage saved: no tiers at all, or a remote one."""
    return not specs or any(spec.kind != "host" for spec in specs)


class RankTransfers:
    """One rank's transfer worker: its share of each step's saves and loads.

    Args:
        executor: The rank's model and pages.
        config: Its tiers.
        fingerprint: The fingerprint of its share (its keys carry it).
    """

    def __init__(self, executor: ModelExecutor, config: OffloadConfig, fingerprint: str) -> None:
        pages = executor.kv_pages()
        self.groups = pages.groups
        self.fingerprint = fingerprint
        self.worker = TransferWorker(pages, config)

    def run(self, transfers: KVTransfers, *, is_idle: bool) -> tuple[LoadReport, ...]:
        """The step's saves and loads of the groups held, under this share's keys; the
        loads finished by now (every load is reported, one holding no group empty)."""
        held, rekey = self.groups, self._key
        loads = tuple(
            LoadTask(
                task.request_id,
                tuple(attrs.evolve(b, key=rekey(b.key)) for b in task.blocks if b.group in held),
            )
            for task in transfers.loads
        )
        saves = tuple(attrs.evolve(s, key=rekey(s.key)) for s in transfers.saves if s.group in held)
        mine = KVTransfers(loads=loads, saves=saves, num_loading=transfers.num_loading)
        return self.worker.run(mine, is_idle=is_idle)

    def close(self) -> None:
        """Write what is queued, then stop the worker's threads."""
        self.worker.close()

    def _key(self, key: bytes) -> bytes:
        return with_fingerprint(key, self.fingerprint)


@attrs.define
class _Partial:
    task: LoadTask
    failed: set[tuple[int, int]] = attrs.field(factory=set)
    num_bytes: int = 0
    num_reports: int = 0


class LoadGather:
    """Rank 0's view of the loads in progress: each reported once every rank has.

    Args:
        num_ranks: Ranks that report every load.
    """

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._pending: dict[str, _Partial] = {}

    def expect(self, transfers: KVTransfers) -> None:
        """Loads a step starts, as rank 0 planned them (its keys)."""
        for task in transfers.loads:
            self._pending[task.request_id] = _Partial(task)

    def combine(self, reports: Iterable[LoadReport]) -> tuple[LoadReport, ...]:
        """The loads every rank has now reported (``reports``: every rank's of a step),
        failed wherever one rank failed."""
        done = []
        for report in reports:
            partial = self._pending[report.request_id]
            partial.failed.update(report.failed)
            partial.num_bytes += report.num_bytes
            partial.num_reports += 1
            if partial.num_reports == self.num_ranks:
                del self._pending[report.request_id]
                done.append(_combined(partial))
        return tuple(done)


def _combined(partial: _Partial) -> LoadReport:
    blocks = partial.task.blocks
    failed = [b for b in blocks if (b.group, b.block) in partial.failed]
    return LoadReport(
        request_id=partial.task.request_id,
        loaded=tuple(
            (b.group, b.block) for b in blocks if (b.group, b.block) not in partial.failed
        ),
        failed=tuple((b.group, b.block) for b in failed),
        failed_keys=tuple(b.key for b in failed),
        num_bytes=partial.num_bytes,
    )
