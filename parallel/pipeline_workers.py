"""The worker processes of a pipeline as rank 0 sees them: started, watched, reaped.

:func:`launch` starts a pipeline from rank 0::

    spawn workers (or meet torchrun's)    load stage 0 here, meanwhile
    wait for hello/<rank>                 init the process group, create the channels
    wait for ready/<rank>                 every stage has loaded; the same pool everywhere

Rank 0 waits for the workers' store keys (``parallel/pipeline_launch.py``) while it
watches its children, so a worker that cannot import, connect or load is reported at
once with its own error. Under torchrun the workers are not rank 0's children: it can
neither watch nor kill them, and torchrun ends them when rank 0's process ends.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch.distributed's stubs do not re-export TCPStore (no submodule of it does either).
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from hybridkv.errors.events import get_logger
from hybridkv.memory.layout import PoolSpec
from hybridkv.models.errors import ParallelConfigError
from hybridkv.parallel.context_group import open_context_group
from hybridkv.parallel.errors import PipelineError
from hybridkv.parallel.pipeline_launch import (
    KEY,
    Rendezvous,
    StageSettings,
    TorchrunEnv,
    init_distributed,
    open_channels,
    read_failure,
    read_ready,
    spawned_worker,
)
from hybridkv.parallel.pipeline_stage import StageExecutor
from hybridkv.parallel.pipeline_wire import PipelineChannels
from hybridkv.parallel.rank_layout import ParallelConfig
from hybridkv.parallel.tensor_group import open_tensor_group

log = get_logger(__name__)

#: How long ``join`` lets a stopped worker exit before killing it.
EXIT_GRACE_S = 10.0


class WorkerSet:
    """Ranks 1..N-1 of a pipeline, and the store they meet at.

    Attributes:
        store: The ``torch.distributed`` TCP store (rank 0 hosts it when it spawned).
        processes: The spawned worker processes, by rank - 1; none under torchrun.
    """

    def __init__(
        self, store: TCPStore, processes: Sequence[BaseProcess], layout: ParallelConfig
    ) -> None:
        self.store = store
        self.processes = tuple(processes)
        self.layout = layout
        self.world_size = layout.world_size

    @classmethod
    def spawn(cls, settings: StageSettings, timeout: timedelta) -> WorkerSet:
        """Host a store on a free loopback port and spawn a process per worker rank."""
        store = TCPStore(
            "127.0.0.1", 0, settings.world_size, is_master=True, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip
        rendezvous = Rendezvous("127.0.0.1", store.port)
        context = mp.get_context("spawn")
        processes = [
            context.Process(
                target=spawned_worker,
                args=(rank, rendezvous, settings),
                name=f"hybridkv-stage-{rank}",
                daemon=True,
            )
            for rank in range(1, settings.world_size)
        ]
        for process in processes:
            process.start()
        log.info("pipeline_workers_spawned", pids=[p.pid for p in processes])
        return cls(store, processes, settings.layout)

    @classmethod
    def join_torchrun(
        cls, rendezvous: Rendezvous, settings: StageSettings, timeout: timedelta
    ) -> WorkerSet:
        """Meet the workers torchrun started, at its store."""
        store = rendezvous.connect(0, settings.world_size, timeout)
        return cls(store, [], settings.layout)

    def wait_until_joined(self, deadline: float) -> None:
        """Wait for every worker's hello key (it connected and joins the group)."""
        self._wait_for("hello", deadline)

    def wait_until_loaded(self, pool: PoolSpec, deadline: float) -> None:
        """Wait for every worker's ready key; raise a worker's load error.

        Raises:
            PipelineError: a worker failed to load, exited, planned another pool, or
                did not answer by ``deadline`` (``time.monotonic()``).
        """
        self._wait_for("ready", deadline)
        for rank in range(1, self.world_size):
            pid, error, theirs = read_ready(self.store, rank)
            if error is not None:
                who = self.layout.describe(rank)
                raise PipelineError(f"{who} (pid {pid}) failed to load: {error}")
            if theirs != pool:
                raise PipelineError(
                    f"{self.layout.describe(rank)} planned the pool {theirs!r}, rank 0 "
                    f"planned {pool!r}"
                )

    def exits(self) -> str | None:
        """The workers that have exited, described; None while all run.

        All are named: when one dies, its neighbours may fail on the lost connection
        before rank 0 looks, and the first to go is not always the first rank.
        """
        exited = [
            self.describe_exit(rank, process)
            for rank, process in enumerate(self.processes, start=1)
            if process.exitcode is not None
        ]
        return "; ".join(exited) or None

    def exits_within(self, seconds: float) -> str | None:
        """:meth:`exits`, waiting up to ``seconds`` for an exited worker to be reaped."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            exited = self.exits()
            if exited is not None:
                return exited
            time.sleep(0.02)
        return None

    def describe_exit(self, rank: int, process: BaseProcess) -> str:
        """``pipeline stage 1 (pid 42) exited with code 1: <its error>`` (``rank 1 (tensor
        rank 1) ...`` beside context or tensor ranks)."""
        code = process.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        error = read_failure(self.store, rank)
        who = f"{self.layout.describe(rank)} (pid {process.pid}) {how}"
        return who + (f": {error}" if error else "")

    def kill(self) -> None:
        """Kill every worker still running (a broken pipeline cannot be stopped in order)."""
        for process in self.processes:
            if process.exitcode is None:
                process.kill()

    def join(self, timeout_s: float = EXIT_GRACE_S) -> None:
        """Wait for the workers to exit; kill those that have not by then.

        Under torchrun, waits (as long) for the workers' stats keys, set as they stop.
        """
        deadline = time.monotonic() + timeout_s
        if not self.processes:
            keys = [f"{KEY}/stats/{rank}" for rank in range(1, self.world_size)]
            while not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.02)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()
        for process in self.processes:
            process.join()

    def _wait_for(self, what: str, deadline: float) -> None:
        keys = [f"{KEY}/{what}/{rank}" for rank in range(1, self.world_size)]
        while not self.store.check(keys):
            exited = self.exits()
            if exited is not None:
                raise PipelineError(f"{exited} before it {_STEPS[what][0]}")
            if time.monotonic() > deadline:
                done = sum(self.store.check([k]) for k in keys)
                raise PipelineError(
                    f"{len(keys) - done} of the pipeline's {len(keys)} workers did not "
                    f"{_STEPS[what][1]} in time"
                )
            time.sleep(0.02)


#: Per key, what a worker that sets it has done, and what one that does not failed to do.
_STEPS = {
    "hello": ("joined the pipeline", "join the pipeline"),
    "ready": ("loaded its layers", "load their layers"),
}


#: Seconds the workers have to join and load their layers.
STARTUP_TIMEOUT_S = 600.0


def launch(settings: StageSettings) -> tuple[StageExecutor, PipelineChannels, WorkerSet]:
    """From rank 0: start the workers, load stage 0, join them all; stop them all on error.

    Raises:
        ParallelConfigError: fewer than 2 stages, fewer GPUs than stages, rank 0 not
            this process under torchrun, or ``torch.distributed`` already initialised.
        PipelineError: a worker could not start or load (its error is named).
    """
    launched = TorchrunEnv.read()
    _check_launch(settings, spawns=launched is None)
    timeout = timedelta(seconds=2 * settings.step_timeout_s)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    if launched is None:
        workers, local_rank = WorkerSet.spawn(settings, timeout), 0
    else:
        launched.check(settings.layout)
        if launched.rank != 0:
            raise ParallelConfigError(f"rank {launched.rank} runs a worker stage, not the engine")
        local_rank = launched.local_rank
        workers = WorkerSet.join_torchrun(launched.rendezvous, settings, timeout)
    try:
        # While the workers start; a tensor rank's share waits for its group.
        alone = settings.tensor_parallel_size == 1
        loaded = settings.load(0, local_rank, None) if alone else None
        workers.wait_until_joined(deadline)
        init_distributed(workers.store, 0, settings.world_size, settings.device_type, timeout)
        channels = open_channels(settings, 0, local_rank)
        context = open_context_group(settings.layout, 0)
        tensor = open_tensor_group(settings.layout, 0)
        if loaded is None:
            loaded = settings.load(0, local_rank, tensor)
        stage0 = settings.shard(loaded, context)
        workers.wait_until_loaded(stage0.pool, deadline)
    except BaseException:
        workers.kill()
        workers.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    pids = [p.pid for p in workers.processes]
    log.info("pipeline_started", world_size=settings.world_size, pool=repr(stage0.pool), pids=pids)
    return stage0, channels, workers


def _check_launch(settings: StageSettings, *, spawns: bool) -> None:
    """Refuse settings no launch can run, before any process starts."""
    num_ranks = settings.world_size
    if num_ranks < 2:
        raise ParallelConfigError(
            f"a pipeline needs at least 2 stages, context or tensor ranks, got {num_ranks}; "
            "use ModelExecutor"
        )
    if dist.is_initialized():
        raise ParallelConfigError(
            "torch.distributed is already initialised in this process; a pipeline owns "
            "its process group (close the other pipeline first)"
        )
    visible = torch.cuda.device_count() if settings.device_type == "cuda" else num_ranks
    if spawns and visible < num_ranks:
        raise ParallelConfigError(
            f"{num_ranks} pipeline ranks on CUDA need a GPU each, {visible} are visible"
        )
