"""The engine's side of a pipeline: rank 0 runs stage 0 and drives the other stages.

::

    engine loop ─submit(batch)─▶ check ─▶ torch thread: broadcast batch, stage 0, send hidden
        ▲                                                      │
        │ futures, in order                                    ▼
    collector thread ◀── result ── last stage ◀── ... ◀── stage 1      (worker processes)
    monitor thread: a worker gone, or no step finished in step_timeout_s -> broken

``submit`` returns at once; up to ``max_steps_in_flight`` steps (one per stage by
default) move through the stages together. Every stage runs its steps in submission
order, so each layer sees them in that order, as the engine requires.

Failures. A batch that does not fit the layout fails its own step before it is sent
(:func:`~hybridkv.executor.batch_checks.check_batch`). Anything else (a worker that dies or
raises, no step finishing for ``step_timeout_s``) breaks the pipeline: every step in
flight fails with :class:`ExecutorBrokenError` naming the cause, which stops the engine,
and the workers are killed. ``close`` stops healthy workers in order and reaps them all.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist

from hybridkv.errors.events import get_logger
from hybridkv.executor.batch_checks import check_batch
from hybridkv.executor.errors import BatchError
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import LogitsHook
from hybridkv.executor.speculative import kept_tokens
from hybridkv.memory.layout import LayerSpec, LayoutPlan, PoolSpec
from hybridkv.memory.offload import KeySpace, OffloadConfig
from hybridkv.models.config import ModelConfig
from hybridkv.parallel.pipeline_launch import StageSettings, read_stats
from hybridkv.parallel.pipeline_stage import FromStage0, StageExecutor, StageRunner, StageStats
from hybridkv.parallel.pipeline_wire import PipelineChannels, StepMessage
from hybridkv.parallel.pipeline_workers import WorkerSet, launch
from hybridkv.parallel.rank_offload import (
    LoadGather,
    OffloadSetup,
    RankTransfers,
    model_of,
    plan_offload,
)
from hybridkv.scheduler.batch import ExecutorBrokenError, StepBatch, StepResult

log = get_logger(__name__)


class PipelineExecutor:
    """A model split into contiguous stages, one process each (a ``PipelinedExecutor``).

    Build it with :meth:`from_pretrained`; close it (or use ``with``) to stop the workers.
    It reports what :class:`ModelExecutor` does (``pool``, ``plan``, ``specs``, ``config``,
    ``tokenizer``, ``eos_token_ids``, ``max_model_len``, ``vocab_size``), from stage 0.

    Attributes:
        num_stages: Pipeline stages.
        world_size: Processes: stages times context ranks.
        max_steps_in_flight: Steps the engine may have submitted and unfinished.
        step_timeout_s: With steps in flight, the longest wait for one to finish.
        logits_hook: Called, on the collector thread, with each sampled request's logits
            (the last stage then returns them with each step: a debugging aid).
        stage_stats: After :meth:`close`, what each stage did (for benchmarks).
        peak_steps_in_flight: The most steps submitted and unfinished at once.
    """

    def __init__(
        self,
        stage0: StageExecutor,
        channels: PipelineChannels,
        workers: WorkerSet,
        *,
        step_timeout_s: float,
        max_steps_in_flight: int,
        logits_hook: LogitsHook | None = None,
    ) -> None:
        self.stage0 = stage0
        self.num_stages = channels.num_stages
        self.world_size = workers.world_size
        self.max_steps_in_flight = max_steps_in_flight
        self.step_timeout_s = step_timeout_s
        self.logits_hook = logits_hook
        self.stage_stats: tuple[StageStats, ...] = ()
        self.peak_steps_in_flight = 0
        self._channels = channels
        self._workers = workers
        self._runner = StageRunner(stage0, channels)
        self._lock = threading.Lock()
        self._in_flight: deque[Future[StepResult]] = deque()  # submitted, oldest first
        self._last_progress = time.monotonic()
        self._error: ExecutorBrokenError | None = None
        self._is_closed = False
        # Steps sent, oldest first, with their batch and whether its stages await a verdict.
        self._results: queue.SimpleQueue[tuple[Future[StepResult], StepBatch, bool] | None] = (
            queue.SimpleQueue()
        )
        self._verdicts: list[tuple[int, tuple[int, ...]]] = []  # for the next message
        self._holds_states = any(g.policy.keeps_state for g in stage0.plan.groups)
        # With KV offload: the tiers for the next message, and the loads in progress.
        self._offload: OffloadSetup | None = None
        self._loads = LoadGather(workers.world_size)
        self._stopping = threading.Event()
        self._collector = threading.Thread(
            target=self._collect, name="hybridkv-pipeline-results", daemon=True
        )
        self._monitor = threading.Thread(
            target=self._watch, name="hybridkv-pipeline-monitor", daemon=True
        )
        self._collector.start()
        self._monitor.start()

    #: It verifies proposed tokens (speculative decoding): the last stage does, and the
    #: stages holding Mamba2 layers write the kept tokens' states when the next message
    #: brings the verdict (``pipeline_stage.py``).
    verifies_proposals = True

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        options: LoadOptions,
        *,
        pipeline_parallel_size: int,
        logits_hook: LogitsHook | None = None,
        step_timeout_s: float = 120.0,
        max_steps_in_flight: int | None = None,
        context_parallel_size: int = 1,
        kv_interleave: int = 1,
        tensor_parallel_size: int = 1,
    ) -> PipelineExecutor:
        """Start the stages of a checkpoint: this process runs stage 0, workers the rest.

        Workers are spawned here, or, under torchrun, are the other ranks (which run
        :func:`~hybridkv.parallel.pipeline_launch.run_worker`). Each stage loads only its
        layers and lays out ``options.kv_cache_bytes`` for their pages; ``options`` and
        ``logits_hook`` are as for :meth:`ModelExecutor.from_pretrained` (``num_threads``
        is per stage, and defaults, on the CPU, to the cores divided among the ranks).

        With ``context_parallel_size`` cp > 1 each stage is cp processes sharing every
        request's tokens and pages (``parallel/context_executor.py``); ``kv_interleave``
        tokens (1 or ``block_size``) go to a rank at a time. The engine then sees blocks
        of ``block_size * cp`` tokens, as many as one rank has pages.

        With ``tensor_parallel_size`` tp > 1 each stage (or context rank) is tp processes,
        each holding its share of every layer's heads, MLP width and vocabulary
        (``parallel/tensor_shards.py``) and the same page ids; ``kv_cache_bytes`` is per
        process, so a page holds the KV heads of one rank.

        Raises:
            ParallelConfigError: fewer than one stage, more stages than layers, fewer
                GPUs than ranks, a model the tensor ranks cannot share (int4 groups they
                would cut included), layers the context ranks cannot take, or
                ``torch.distributed`` already initialised here.
            PipelineError: a worker could not start or load (its error is named).
            CheckpointError, ModelConfigError, PolicyError: as ModelExecutor.
        """
        settings = StageSettings.create(
            path,
            options,
            pipeline_parallel_size=pipeline_parallel_size,
            step_timeout_s=step_timeout_s,
            context_parallel_size=context_parallel_size,
            kv_interleave=kv_interleave,
            tensor_parallel_size=tensor_parallel_size,
        )
        stage0, channels, workers = launch(settings)
        return cls(
            stage0,
            channels,
            workers,
            step_timeout_s=step_timeout_s,
            max_steps_in_flight=max_steps_in_flight or pipeline_parallel_size,
            logits_hook=logits_hook,
        )

    def attach_offload(self, config: OffloadConfig) -> KeySpace:
        """Move pages to and from offload tiers: every rank its share, under keys naming
        it (``parallel/rank_offload.py``); rank 0's key space, for the engine's connector.

        Raises:
            OffloadConfigError: tiers not built from specs, or only host tiers while a KV
                group has no layer on stage 0.
        """
        keys, setup = plan_offload(config, self.stage0, self._channels.layout)
        self._runner.transfers = RankTransfers(model_of(self.stage0), config, setup.fingerprints[0])
        self._offload = setup
        return keys

    # -- what the engine reads: stage 0's -------------------------------------------------

    #: The block pool every stage laid out (the same page count per group).
    pool = FromStage0[PoolSpec]()
    #: The layout planned for all stages.
    plan = FromStage0[LayoutPlan]()
    #: Every layer's spec, as its group keeps it.
    specs = FromStage0[tuple[LayerSpec, ...]]()
    #: The model's config.
    config = FromStage0[ModelConfig]()
    #: The checkpoint's tokenizer, or None.
    tokenizer = FromStage0[Any]()
    #: End-of-sequence tokens.
    eos_token_ids = FromStage0[tuple[int, ...]]()
    #: Longest sequence a request may reach.
    max_model_len = FromStage0[int]()
    #: Rows of the LM head.
    vocab_size = FromStage0[int]()

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """The process ids of stages 1.. that this process spawned (none under torchrun)."""
        return tuple(p.pid for p in self._workers.processes if p.pid is not None)

    # -- steps ----------------------------------------------------------------------------

    def submit(self, batch: StepBatch) -> Future[StepResult]:
        """Send a step into the pipeline without waiting; its future holds the result."""
        future: Future[StepResult] = Future()
        if self._error is not None or self._is_closed:
            future.set_exception(self._error or ExecutorBrokenError("the pipeline is closed"))
            return future
        try:
            check_batch(batch, self.plan, self.max_model_len)
        except BatchError as exc:  # this step fails alone; nothing was sent
            future.set_exception(exc)
            return future
        if not batch.requests and batch.transfers is None:
            future.set_result(StepResult(token_ids=()))
            return future
        if batch.transfers is not None:
            self._loads.expect(batch.transfers)
        with self._lock:
            verdicts, self._verdicts = tuple(self._verdicts), []
            message = StepMessage(batch, self.logits_hook is not None, verdicts, self._offload)
            self._offload = None  # every rank starts its tiers with this message
            if not self._in_flight:
                self._last_progress = time.monotonic()
            self._in_flight.append(future)
            self.peak_steps_in_flight = max(self.peak_steps_in_flight, len(self._in_flight))
        drafted = self._holds_states and any(r.num_draft_tokens for r in batch.requests)
        self._results.put((future, batch, drafted))
        self.stage0.torch_thread.submit(self._first_stage, message).add_done_callback(
            self._check_first_stage
        )
        return future

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step and wait for it."""
        return self.submit(batch).result()

    def _first_stage(self, message: StepMessage) -> None:
        """On the torch thread: send the batch to every stage, run stage 0, pass it on."""
        if self._error is None:
            self._channels.broadcast_step(message)
            self._runner.run_step(message)

    def _check_first_stage(self, done: Future[None]) -> None:
        error = done.exception()
        if error is not None:
            # A worker that died breaks rank 0's own collectives first (tensor ranks
            # all-reduce every layer): name the worker, not the lost connection.
            self._break(self._workers.exits_within(1.0) or f"pipeline stage 0 failed: {error!r}")

    def _collect(self) -> None:
        """Receive results in order and complete the futures, until told to stop. A
        verification step's verdict (the tokens each request kept) is queued for the
        next message before its future completes, so every step that may read the kept
        states is sent after the stages have learnt which to write."""
        number = -1
        while (item := self._results.get()) is not None:
            future, batch, drafted = item
            number += 1
            try:
                result, logits = self._receive(batch)
            except Exception as exc:  # a stage lost, or broken already (receive abandoned)
                if self._error is None:  # a worker that exited closes our connections first
                    lost = f"lost the connection to a stage: {exc}"
                    self._break(self._workers.exits_within(1.0) or lost)
                return
            if logits and self.logits_hook is not None:
                for request_id, row in logits:
                    self.logits_hook(request_id, row)
            with self._lock:
                if self._error is not None:
                    return  # the future was failed with the others
                assert self._in_flight[0] is future
                self._in_flight.popleft()
                self._last_progress = time.monotonic()
                if drafted:
                    self._verdicts.append((number, kept_tokens(batch, result)))
            future.set_result(result)

    def _receive(
        self, batch: StepBatch
    ) -> tuple[StepResult, Sequence[tuple[str, torch.Tensor]] | None]:
        """A step's result and logits from the last stage (a step of transfers alone has
        none), with the loads every rank has reported by then."""
        received = (
            self._channels.recv_result() if batch.requests else (StepResult(token_ids=()), None)
        )
        result, logits = cast(tuple[StepResult, Sequence[tuple[str, torch.Tensor]]], received)
        if batch.transfers is not None:
            loads = self._loads.combine(self._channels.recv_reports())
            result = attrs.evolve(result, kv_loads=loads) if loads else result
        return result, logits

    def _watch(self) -> None:
        """Break the pipeline when a worker is gone or no step finishes in time."""
        while not self._stopping.wait(0.05):
            exited = self._workers.exits()
            if exited is not None:
                self._break(exited)
                return
            with self._lock:
                num = len(self._in_flight)
                waited = time.monotonic() - self._last_progress
            if num and waited > self.step_timeout_s:
                self._break(
                    f"no step finished in {waited:.1f} s (step_timeout_s="
                    f"{self.step_timeout_s}) with {num} in flight: a stage hangs"
                )
                return

    def _break(self, reason: str) -> None:
        """Fail every step in flight, refuse later ones, kill the workers (once)."""
        with self._lock:
            if self._error is not None:
                return
            self._error = ExecutorBrokenError(f"the pipeline broke: {reason}")
            failed = list(self._in_flight)
            self._in_flight.clear()
        log.error("pipeline_broken", reason=reason, num_steps_failed=len(failed))
        self._workers.kill()  # also ends our own receives from them
        self._channels.abandon()  # and those from rank 0 itself
        for future in failed:
            future.set_exception(self._error)

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers after the steps in flight (or kill them if broken); idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self._stopping.set()
        self._monitor.join()
        if self._error is None:
            stop = self.stage0.torch_thread.submit(self._channels.broadcast_step, None)
            self._wait_stopped(stop)
        self._results.put(None)
        self._collector.join(timeout=self.step_timeout_s)
        self._workers.join(self.step_timeout_s if self._error is None else 0.0)
        if self._error is None:
            # Every worker received what was sent to it before it stopped.
            self.stage0.torch_thread.run(self._channels.outbox.drain)
            workers = [read_stats(self._workers.store, r) for r in range(1, self.world_size)]
            self.stage_stats = (self._runner.stats(), *(s for s in workers if s is not None))
        if dist.is_initialized():
            dist.destroy_process_group()
        self._runner.close()
        log.info("pipeline_closed", is_broken=self._error is not None)

    def _wait_stopped(self, stop: Future[None]) -> None:
        """Wait for the steps in flight and the stop broadcast; break if it takes too long."""
        deadline = time.monotonic() + self.step_timeout_s
        try:
            stop.result(timeout=self.step_timeout_s)
            while self._in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
        except Exception as exc:
            self._break(f"stopping failed: {exc!r}")
        if self._in_flight:
            self._break(f"steps still in flight after step_timeout_s={self.step_timeout_s}")

    def __enter__(self) -> PipelineExecutor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["PipelineExecutor"]
