"""One pipeline stage's share of a step, the same in every process.

::

    stage 0 (rank 0)           stage i                       last stage
    prepare(batch)             prepare(batch)                prepare(batch)
    embed, layers [0, a)       recv hidden, layers [a, b)    recv hidden, layers [c, n)
    send hidden ──────────────▶ send hidden ─────────────────▶ logits, sample
                                                             send result to rank 0

``prepare`` (paged metadata from the block tables) runs before the hidden states are
awaited, so it overlaps the previous stage's work. A stage runs its steps one at a time
in the order rank 0 broadcast them, so every layer sees the steps in submission order.
With KV offload, every rank first moves its share of the step's pages and sends rank 0
its load reports (``rank_offload.py``); a step of transfers alone stops there.
"""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar, cast

import attrs
import torch

from hybridkv.executor.model_executor import ModelExecutor, StageInputs
from hybridkv.executor.speculative import write_kept_states
from hybridkv.memory.state_pages import StepStates
from hybridkv.parallel.context_executor import ContextParallelExecutor
from hybridkv.parallel.pipeline_wire import PipelineChannels, StepMessage
from hybridkv.parallel.rank_offload import RankTransfers, model_of
from hybridkv.scheduler.batch import StepBatch

#: What runs a stage's share of a step: the stage's layers, or one context rank of them.
StageExecutor = ModelExecutor | ContextParallelExecutor

T = TypeVar("T")


class FromStage0(Generic[T]):
    """A read-only attribute of a pipeline's stage 0 executor (what the engine reads)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, pipeline: Any, owner: type | None = None) -> T:
        return cast(T, getattr(pipeline.stage0, self.name))


@attrs.frozen(kw_only=True)
class StageStats:
    """What one stage did, for the benchmark: steps, busy and waiting time, bytes sent.

    Attributes:
        stage: The stage index.
        num_steps: Steps it ran.
        busy_s: Seconds spent preparing and computing steps (not waiting for input).
        wait_s: Seconds blocked receiving the previous stage's hidden states.
        span_s: Seconds from the start of its first step to the end of its last.
        control_bytes: Bytes it broadcast (step batches; rank 0 only).
        hidden_bytes: Bytes of hidden states it sent.
        result_bytes: Bytes of results it sent (the last stage).
    """

    stage: int
    num_steps: int
    busy_s: float
    wait_s: float
    span_s: float
    control_bytes: int
    hidden_bytes: int
    result_bytes: int


class StageRunner:
    """Runs a stage's share of each step over its executor and channels."""

    def __init__(self, executor: StageExecutor, channels: PipelineChannels) -> None:
        self.executor = executor
        self.channels = channels
        self._num_steps = 0
        self._busy_s = 0.0
        self._wait_s = 0.0
        self._first_start: float | None = None
        self._last_end = 0.0
        self._logits: list[tuple[str, torch.Tensor]] = []
        # Verification steps whose Mamba2 states wait for their verdict, by step number.
        self._verifying: dict[int, StageInputs] = {}
        # With KV offload: this rank's transfer worker (rank 0 sets its own).
        self.transfers: RankTransfers | None = None

    def run_step(self, message: StepMessage) -> None:
        """Write the kept states of earlier verification steps, then prepare, receive
        (past the first stage), compute, and send on."""
        started = time.perf_counter()
        if self._first_start is None:
            self._first_start = started
        for number, kept in message.verdicts:
            write_kept_states(self._verifying.pop(number).caches, kept)
        executor, channels, batch = self.executor, self.channels, message.batch
        if message.offload is not None and self.transfers is None:
            inner = model_of(executor)
            fingerprint = message.offload.fingerprints[channels.rank]
            self.transfers = RankTransfers(inner, message.offload.config(inner), fingerprint)
        if batch.transfers is not None:
            self._move_pages(batch)
            if not batch.requests:
                return
        inputs = executor.prepare(batch)
        if any(r.num_draft_tokens for r in batch.requests) and has_states(inputs):
            # Its Mamba2 states wait for the verdict, which only the last stage knows.
            self._verifying[self._num_steps] = inputs
        hidden, waited = None, 0.0
        if channels.prev is not None:
            before = time.perf_counter()
            # This rank's tokens: all of the step's, or its context shard of them.
            hidden = channels.recv_hidden(int(inputs.positions.numel()))
            waited = time.perf_counter() - before
        hidden = executor.forward(inputs, hidden)
        if channels.next is not None:
            channels.send_hidden(hidden)
        else:
            executor.logits_hook = self._keep_logits if message.want_logits else None
            result = executor.finish(batch, inputs, hidden)
            logits, self._logits = self._logits, []
            if channels.sends_results:
                channels.send_result((result, logits or None))
        self._last_end = time.perf_counter()
        self._num_steps += 1
        self._busy_s += self._last_end - started - waited
        self._wait_s += waited

    def _move_pages(self, batch: StepBatch) -> None:
        """This rank's share of the step's saves and loads; its reports to rank 0."""
        assert self.transfers is not None, "a step of transfers before the tiers"
        assert batch.transfers is not None
        reports = self.transfers.run(batch.transfers, is_idle=not batch.requests)
        self.channels.send_reports(reports)

    def close(self) -> None:
        """Write the saves queued, stop the transfer worker (if any), then the executor."""
        if self.transfers is not None:
            self.transfers.close()
        self.executor.close()

    def stats(self) -> StageStats:
        """The counters so far."""
        counters = self.channels.counters
        return StageStats(
            stage=self.channels.stage,
            num_steps=self._num_steps,
            busy_s=self._busy_s,
            wait_s=self._wait_s,
            span_s=self._last_end - (self._first_start or self._last_end),
            control_bytes=counters.control_bytes,
            hidden_bytes=counters.hidden_bytes,
            result_bytes=counters.result_bytes,
        )

    def _keep_logits(self, request_id: str, logits: torch.Tensor) -> None:
        self._logits.append((request_id, logits.detach().to("cpu", copy=True)))


def has_states(inputs: StageInputs) -> bool:
    """Whether the stage holds state (Mamba2) layers in this step."""
    return any(isinstance(metadata, StepStates) for _, metadata in inputs.caches)


def serve_stage(runner: StageRunner) -> None:
    """A worker's loop: run every step rank 0 broadcasts, until it broadcasts stop.

    Runs on the executor's torch thread; then waits for its own sends to complete.
    """
    while (message := runner.channels.receive_step()) is not None:
        runner.run_step(message)
    runner.channels.outbox.drain()
