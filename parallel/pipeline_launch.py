"""Starting the stages of a pipeline: where they meet, what they load, a worker's life.

Rank 0 is the engine's process and runs stage 0 (``parallel/pipeline_executor.py``). With
context parallelism each stage is ``cp`` ranks, with tensor parallelism ``cp x tp``
(``ParallelConfig(pipeline, context, tensor)`` places them; rank 0 is stage 0's rank 0).
The other ranks are workers, started one of two ways:

- **spawned** by rank 0 (``torch.multiprocessing``, spawn): rank 0 hosts a
  ``torch.distributed`` TCP store on a free loopback port and passes its address;
- **under torchrun**: every rank runs the command line, which sends ranks other than 0
  here (``hybridkv.serving.cli.main``); they meet at torchrun's store (``MASTER_ADDR``), one
  rank per stage.

A worker's life, and the store keys rank 0 watches (so that a worker that cannot start
is reported at once, with its error, instead of after a timeout)::

    connect to the store, set hello/<rank>
    init_process_group (gloo on CPU; gloo and NCCL on CUDA), create the channels',
        context and tensor groups
    load its layers, set ready/<rank> = (pid, error or None, pool)
    serve steps until rank 0 broadcasts stop            (failed/<rank> = error, exit 1)
    set stats/<rank>, destroy the process group, exit 0

A spawned worker ignores SIGINT (Ctrl-C reaches the whole process group; rank 0 stops
the workers in order) and exits if its parent process is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import secrets
import signal
import sys
import traceback
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import cast

import attrs
import structlog
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.distributed_c10d import PrefixStore, Store

from hybridkv.errors.events import get_logger
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.layout import PoolSpec
from hybridkv.models.errors import ParallelConfigError
from hybridkv.models.stages import check_stage_cuts
from hybridkv.parallel.context_executor import ContextParallelExecutor, check_context_split
from hybridkv.parallel.context_group import ContextRanks, open_context_group
from hybridkv.parallel.parent_watch import watch_parent
from hybridkv.parallel.pipeline_stage import StageExecutor, StageRunner, StageStats, serve_stage
from hybridkv.parallel.pipeline_wire import PipelineChannels
from hybridkv.parallel.rank_layout import ParallelConfig
from hybridkv.parallel.tensor_group import TensorRanks, open_tensor_group
from hybridkv.parallel.tensor_shards import TensorShard, check_tensor_split

log = get_logger(__name__)

#: Prefix of every store key hybridkv sets (torchrun's store holds its own keys too).
KEY = "hybridkv/pipeline"


@attrs.frozen(kw_only=True)
class StageSettings:
    """What every stage loads: one value, sent to each worker, so all plan the same pool."""

    path: str
    num_stages: int
    hidden_size: int
    options: LoadOptions
    step_timeout_s: float
    log_level: int = logging.NOTSET
    context_parallel_size: int = 1
    kv_interleave: int = 1
    tensor_parallel_size: int = 1

    @classmethod
    def create(
        cls,
        path: str | Path,
        options: LoadOptions,
        *,
        pipeline_parallel_size: int,
        step_timeout_s: float = 120.0,
        context_parallel_size: int = 1,
        kv_interleave: int = 1,
        tensor_parallel_size: int = 1,
    ) -> StageSettings:
        """Settings for a checkpoint, checked: every stage must hold a layer, and the
        tensor ranks must share every layer evenly.

        ``options.num_threads`` defaults, on the CPU, to the cores divided among the
        ranks. The workers log at this process's structlog level, to stderr.

        Raises:
            ParallelConfigError: more stages than layers, or fewer than one; a model
                the tensor ranks cannot share (``check_tensor_split``) or layers the
                context ranks cannot (``check_context_split``).
            CheckpointError, ModelConfigError, PolicyError: a config we cannot run.
        """
        if options.weights == "auto":
            options = attrs.evolve(options, weights="dtype")
        checkpoint = options.open_checkpoint(path)
        config = checkpoint.config
        check_stage_cuts(
            config.layers,
            pipeline_parallel_size,
            embeddings_read_by=config.embeddings_read_by,
        )
        check_tensor_split(checkpoint.config, tensor_parallel_size, options.weights)
        if context_parallel_size > 1:
            check_context_split(
                checkpoint.config.layers, sinks=bool(checkpoint.config.attention_sinks)
            )
        layout = ParallelConfig(
            pipeline=pipeline_parallel_size,
            context=context_parallel_size,
            tensor=tensor_parallel_size,
        )
        if options.num_threads is None and torch.device(options.device).type == "cpu":
            threads = max(1, (os.cpu_count() or 1) // layout.world_size)
            options = attrs.evolve(options, num_threads=threads)
        if options.seed is None:
            # Every tensor rank of the last stage samples (and advances its grammars)
            # from the same gathered logits: with one seed they all draw the same tokens.
            options = attrs.evolve(options, seed=secrets.randbits(63))
        return cls(
            path=str(path),
            num_stages=pipeline_parallel_size,
            hidden_size=checkpoint.config.hidden_size * checkpoint.config.residual_streams,
            options=options,
            step_timeout_s=step_timeout_s,
            log_level=structlog.get_logger().bind().get_effective_level(),
            context_parallel_size=context_parallel_size,
            kv_interleave=kv_interleave,
            tensor_parallel_size=tensor_parallel_size,
        )

    @property
    def device_type(self) -> str:
        """``cpu`` or ``cuda``: the kind of device every stage runs on."""
        return torch.device(self.options.device).type

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the hidden states passed between stages."""
        return self.options.dtype

    @property
    def layout(self) -> ParallelConfig:
        """Where each rank sits: its pipeline stage, context rank and tensor rank."""
        return ParallelConfig(
            pipeline=self.num_stages,
            context=self.context_parallel_size,
            tensor=self.tensor_parallel_size,
        )

    @property
    def world_size(self) -> int:
        """Processes in all: stages times context ranks times tensor ranks."""
        return self.layout.world_size

    def device(self, local_rank: int) -> torch.device:
        """The device of a stage: the CPU, or the GPU of its local rank."""
        if self.device_type == "cuda":
            return torch.device("cuda", local_rank)
        return torch.device(self.device_type)

    def load(self, rank: int, local_rank: int, tensor: TensorRanks | None) -> ModelExecutor:
        """Load rank ``rank``'s stage's layers (its tensor share of them) and lay out
        their pages."""
        return ModelExecutor.from_pretrained(
            self.path,
            attrs.evolve(self.options, device=self.device(local_rank)),
            pipeline_stage=self.layout.coordinates(rank)["pipeline"],
            pipeline_parallel_size=self.num_stages,
            shard=None if tensor is None else TensorShard(tensor),
        )

    def shard(self, executor: ModelExecutor, context: ContextRanks | None) -> StageExecutor:
        """The executor of one context rank (itself without context parallelism)."""
        if context is None:
            return executor
        return ContextParallelExecutor(executor, context, self.kv_interleave)


@attrs.frozen
class Rendezvous:
    """Where the stages meet: a ``torch.distributed`` TCP store.

    Attributes:
        host: The store's address.
        port: Its port.
        is_torchrun: Whether torchrun launched the ranks (its agent may host the store).
    """

    host: str
    port: int
    is_torchrun: bool = False

    def connect(self, rank: int, world_size: int, timeout: timedelta) -> TCPStore:
        """A client of the store (rank 0 hosts it unless torchrun's agent does)."""
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        is_master = rank == 0 and not (self.is_torchrun and agent_hosts)
        return TCPStore(
            self.host, self.port, world_size, is_master=is_master, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip


@attrs.frozen
class TorchrunEnv:
    """What torchrun (or any launcher following ``torch.distributed``'s ``env://``
    contract) tells a process: the store, its rank and local rank, the world size."""

    rendezvous: Rendezvous
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def read(cls, env: Mapping[str, str] = os.environ) -> TorchrunEnv | None:
        """The launcher's variables, or None when this process was not launched so."""
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if not all(name in env for name in names):
            return None
        rendezvous = Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_torchrun=True)
        rank = int(env["RANK"])
        return cls(rendezvous, rank, int(env.get("LOCAL_RANK", rank)), int(env["WORLD_SIZE"]))

    def check(self, layout: ParallelConfig) -> None:
        """Refuse a world that is not one rank per stage and context rank."""
        if self.world_size != layout.world_size:
            raise ParallelConfigError(
                f"the launcher started {self.world_size} processes for "
                f"pipeline_parallel_size={layout.pipeline} x context_parallel_size="
                f"{layout.context} x tensor_parallel_size={layout.tensor}; start one per "
                "stage, context rank and tensor rank"
            )


def init_distributed(
    store: Store, rank: int, world_size: int, device_type: str, timeout: timedelta
) -> None:
    """Join the default process group of the pipeline through ``store``."""
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    prefixed = PrefixStore(f"{KEY}/pg", store)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout
    )


def open_channels(settings: StageSettings, rank: int, local_rank: int) -> PipelineChannels:
    """This rank's end of the pipeline's channels.

    Every rank creates them before it loads its layers: creating a group waits for all
    ranks, and a rank that fails to load must not leave the others waiting there.
    """
    return PipelineChannels(
        rank,
        settings.layout,
        hidden_size=settings.hidden_size,
        dtype=settings.dtype,
        device=settings.device(local_rank),
        step_timeout_s=settings.step_timeout_s,
    )


def run_worker(
    rank: int, rendezvous: Rendezvous, settings: StageSettings, local_rank: int | None = None
) -> int:
    """A worker process: join, load, serve until stopped. Returns the exit status.

    The target of spawned workers (through :func:`spawned_worker`) and of ranks other
    than 0 under torchrun.
    """
    # A worker is a process of ours: it logs as its engine's does, never on its stdout.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(settings.log_level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    timeout = timedelta(seconds=2 * settings.step_timeout_s)
    store = rendezvous.connect(rank, settings.world_size, timeout)
    store.set(f"{KEY}/hello/{rank}", str(os.getpid()))
    init_distributed(store, rank, settings.world_size, settings.device_type, timeout)
    local_rank = rank if local_rank is None else local_rank
    channels = open_channels(settings, rank, local_rank)
    context = open_context_group(settings.layout, rank)
    tensor = open_tensor_group(settings.layout, rank)
    try:
        executor = settings.shard(settings.load(rank, local_rank, tensor), context)
    except Exception as exc:  # reported to rank 0, which raises it at start
        _set_bytes(store, f"{KEY}/ready/{rank}", pickle.dumps((os.getpid(), _describe(exc), None)))
        return 1
    _set_bytes(store, f"{KEY}/ready/{rank}", pickle.dumps((os.getpid(), None, executor.pool)))
    runner = StageRunner(executor, channels)
    try:
        executor.torch_thread.run(serve_stage, runner)
    except Exception as exc:
        traceback.print_exc()
        with contextlib.suppress(Exception):  # the store is gone if rank 0 is
            store.set(f"{KEY}/failed/{rank}", _describe(exc))  # rank 0 names it
        return 1
    _set_bytes(store, f"{KEY}/stats/{rank}", pickle.dumps(runner.stats()))
    dist.destroy_process_group()
    runner.close()
    return 0


def run_torchrun_worker(settings: StageSettings) -> int:
    """Under torchrun, serve this rank's stage until rank 0 stops the pipeline; the exit
    status. Rank 0 builds the engine instead (``PipelineExecutor.from_pretrained``)."""
    launched = TorchrunEnv.read()
    if launched is None:
        raise ParallelConfigError("not launched by torchrun: RANK or MASTER_ADDR is unset")
    launched.check(settings.layout)
    if launched.rank == 0:
        raise ParallelConfigError("rank 0 runs the engine and stage 0, not a worker")
    return run_worker(launched.rank, launched.rendezvous, settings, launched.local_rank)


def spawned_worker(rank: int, rendezvous: Rendezvous, settings: StageSettings) -> None:
    """Entry point of a worker spawned by rank 0: exits with :func:`run_worker`'s status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(os.getppid(), grace_s=None)  # a killed engine leaves no workers
    sys.exit(run_worker(rank, rendezvous, settings))


def read_ready(store: Store, rank: int) -> tuple[int, str | None, PoolSpec | None]:
    """A worker's ready key: its pid, its load error or None, its pool."""
    value = pickle.loads(store.get(f"{KEY}/ready/{rank}"))
    return cast(tuple[int, str | None, PoolSpec | None], value)


def read_stats(store: Store, rank: int) -> StageStats | None:
    """The counters a worker left when it stopped, if it did."""
    key = f"{KEY}/stats/{rank}"
    if not store.check([key]):
        return None
    stats = pickle.loads(store.get(key))
    assert isinstance(stats, StageStats)
    return stats


def read_failure(store: Store, rank: int) -> str | None:
    """The error a worker reported before it exited, if it could."""
    key = f"{KEY}/failed/{rank}"
    return store.get(key).decode() if store.check([key]) else None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _set_bytes(store: Store, key: str, value: bytes) -> None:
    """``store.set`` with a bytes value (the binding takes bytes; its stub says str)."""
    store.set(key, value)  # type: ignore[arg-type]
