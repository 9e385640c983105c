"""The wire between pipeline stages: four process groups, and what travels on each.

::

    rank 0 (engine + stage 0)        rank 1 (stage 1)          rank N-1 (last stage)
    control      step k's batch ──broadcast──▶ every stage, once per step
    activations  hidden of step k ──send──▶ hidden ──send──▶ ...
    results      ◀──────────────────────────────────────────── step k's StepResult
    reports      ◀── every rank's offload load reports of step k (with KV offload only)

With context parallelism (``cp`` ranks per stage) or tensor parallelism (``tp``) control
spans every rank; each context or tensor rank c has its own activations chain (stage s,
rank c to stage s + 1, rank c: its share of the tokens, or, for a tensor rank, the whole
hidden states, which every tensor rank of a stage ends with) and only the last stage's
rank 0 sends results. A single stage's
results stay in rank 0's process.

Each group is used by a single thread in each process, so every process issues its
operations in the same order; gloo matches them by a per-group sequence number. The
control group never times out (a server may idle for hours between steps); the other
two time out after ``2 * step_timeout_s``, a backstop behind the engine-side watchdog.

Sends are asynchronous. Gloo completes a send only once the receiver has posted its
receive, so a stage hands each send to its :class:`Outbox`, which keeps the tensor alive
until then, and goes on with the next step: that is what lets the stages overlap.

Objects (a step's batch, a step's result) travel pickled, as a length then the bytes, as
``torch.distributed``'s own object collectives do: only between the processes of one
pipeline, over the connections of its process group. Hidden states travel as raw tensors
whose shape every stage knows from the batch (``[num_tokens, hidden_size]``).
"""

from __future__ import annotations

import pickle
import queue
from collections import deque
from datetime import timedelta
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist

from hybridkv.memory.offload.transfers import LoadReport
from hybridkv.parallel.rank_layout import ParallelConfig, new_groups
from hybridkv.parallel.rank_offload import OffloadSetup
from hybridkv.scheduler.batch import StepBatch

#: Timeout of the control group: effectively none, a stage waits for the next step.
IDLE_TIMEOUT = timedelta(days=365)

_STOP = -1


@attrs.frozen
class StepMessage:
    """What rank 0 broadcasts for one step: the batch, whether to return logits, the
    verdicts of earlier verification steps that arrived since the last message (step
    number in submission order, tokens each request kept), for the stages to write the
    states of the kept tokens before this step runs (``pipeline_stage.py``), and, once,
    the offload tiers every rank starts before the step (``rank_offload.py``)."""

    batch: StepBatch
    want_logits: bool = False
    verdicts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    offload: OffloadSetup | None = None


@attrs.define
class WireCounters:
    """Bytes a process sent per channel."""

    control_bytes: int = 0
    hidden_bytes: int = 0
    result_bytes: int = 0


def _groups_of(layout: ParallelConfig, rank: int, *axes: str, **options: Any) -> dist.ProcessGroup:
    return new_groups(layout, rank, *axes, **options)[0]


class Outbox:
    """Sends in progress, each with the tensors it reads, until they complete."""

    def __init__(self) -> None:
        self._works: deque[tuple[dist.Work, tuple[torch.Tensor, ...]]] = deque()

    def add(self, work: dist.Work | None, *tensors: torch.Tensor) -> None:
        """Keep ``tensors`` until ``work`` completes."""
        assert work is not None, "asynchronous operations return a work"
        self._works.append((work, tensors))

    def reap(self) -> None:
        """Forget completed sends; raise the error of one that failed."""
        while self._works and self._works[0][0].is_completed():
            work, _ = self._works.popleft()
            work.wait()

    def drain(self) -> None:
        """Wait for every send."""
        while self._works:
            work, _ = self._works.popleft()
            work.wait()


class PipelineChannels:
    """One process's end of the three channels of a pipeline of ``layout.pipeline`` stages.

    ``torch.distributed`` must be initialised with every rank of ``layout``.

    Args:
        rank: This process's rank (its stage, in a pipeline-only world).
        layout: The stages and context ranks.
        hidden_size: Width of the hidden states.
        dtype: Their dtype.
        device: Where this stage keeps them (CUDA sends go over NCCL).
        step_timeout_s: The activations and results groups time out at twice this.
    """

    def __init__(
        self,
        rank: int,
        layout: ParallelConfig,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        step_timeout_s: float,
    ) -> None:
        timeout = timedelta(seconds=2 * step_timeout_s)
        self.control = _groups_of(
            layout, rank, "pipeline", "context", "tensor", backend="gloo", timeout=IDLE_TIMEOUT
        )
        data_backend = "nccl" if device.type == "cuda" else "gloo"
        self.activations = _groups_of(
            layout, rank, "pipeline", backend=data_backend, timeout=timeout
        )
        self.results = _groups_of(layout, rank, "pipeline", backend="gloo", timeout=timeout)
        self.reports = _groups_of(
            layout, rank, "pipeline", "context", "tensor", backend="gloo", timeout=timeout
        )
        self.rank, self.layout = rank, layout
        self._local_reports: queue.SimpleQueue[Any] = queue.SimpleQueue()
        ranks = layout.group_of(rank, "pipeline")
        self.stage = ranks.index(rank)
        self.num_stages = len(ranks)
        # Rank 0 broadcasts every step and receives every result.
        self.first, self.last = 0, layout.group_of(0, "pipeline")[-1]
        self.sends_results = rank == self.last
        self._local_results: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.prev = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage + 1 < len(ranks) else None
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.outbox = Outbox()
        self.counters = WireCounters()

    # -- control: rank 0 to every stage ---------------------------------------------------

    def broadcast_step(self, message: StepMessage | None) -> None:
        """Send a step (None: stop) to every stage, without waiting (rank 0)."""
        if message is None:
            tensors: tuple[torch.Tensor, ...] = (torch.tensor([_STOP]),)
        else:
            payload = _encode(message)
            tensors = (torch.tensor([payload.numel()]), payload)
        for tensor in tensors:
            work = dist.broadcast(tensor, src=self.first, group=self.control, async_op=True)
            self.outbox.add(work, tensor)
        self.counters.control_bytes += sum(t.nbytes for t in tensors)
        self.outbox.reap()

    def receive_step(self) -> StepMessage | None:
        """The next step rank 0 broadcast, or None when it stops the pipeline."""
        header = torch.empty(1, dtype=torch.long)
        dist.broadcast(header, src=self.first, group=self.control)
        if int(header) == _STOP:
            return None
        payload = torch.empty(int(header), dtype=torch.uint8)
        dist.broadcast(payload, src=self.first, group=self.control)
        message = _decode(payload)
        assert isinstance(message, StepMessage)
        return message

    # -- activations: stage to stage ------------------------------------------------------

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """Hand this step's hidden states to the next stage, without waiting."""
        assert self.next is not None, "the last stage sends results, not hidden states"
        hidden = hidden.contiguous()
        self.outbox.add(dist.isend(hidden, dst=self.next, group=self.activations), hidden)
        self.counters.hidden_bytes += hidden.nbytes
        self.outbox.reap()

    def recv_hidden(self, num_tokens: int) -> torch.Tensor:
        """The previous stage's hidden states of a step of ``num_tokens`` tokens."""
        assert self.prev is not None, "the first stage embeds, it receives no hidden states"
        hidden = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, src=self.prev, group=self.activations)
        return hidden

    # -- results: the last stage to rank 0 ------------------------------------------------

    def send_result(self, result: object) -> None:
        """Send a step's result to rank 0, without waiting (the last stage)."""
        if self.last == self.first:  # one stage: rank 0 itself
            self._local_results.put(result)
            return
        self.counters.result_bytes += self._send_object(result, self.results)

    def recv_result(self) -> object:
        """The next step's result from the last stage (rank 0).

        Raises:
            ChannelsAbandonedError: :meth:`abandon` was called (one stage only: a remote
                stage's receive fails when its worker is killed).
        """
        if self.last == self.first:
            return _local(self._local_results.get())
        return _recv_object(self.last, self.results)

    def abandon(self) -> None:
        """Wake every receive from rank 0 itself with an error: the pipeline broke, and
        the step they wait for will never be sent (a tensor-only pipeline's rank 0 is
        its own last stage, and nothing else would end that wait)."""
        self._local_results.put(_ABANDONED)
        self._local_reports.put(_ABANDONED)

    # -- reports: every rank to rank 0 ----------------------------------------------------

    def send_reports(self, reports: tuple[LoadReport, ...]) -> None:
        """Send this rank's load reports of a step to rank 0, without waiting."""
        if self.rank == self.first:
            self._local_reports.put(reports)
            return
        self._send_object(reports, self.reports)

    def recv_reports(self) -> list[LoadReport]:
        """Every rank's load reports of the next step that carried transfers (rank 0)."""
        out = list(_local(self._local_reports.get()))
        for rank in range(1, self.layout.world_size):
            out.extend(cast(tuple[LoadReport, ...], _recv_object(rank, self.reports)))
        return out

    def _send_object(self, value: object, group: dist.ProcessGroup) -> int:
        """Send ``value`` to rank 0 over ``group``, without waiting; the bytes sent."""
        payload = _encode(value)
        header = torch.tensor([payload.numel()])
        for tensor in (header, payload):
            self.outbox.add(dist.isend(tensor, dst=self.first, group=group), tensor)
        self.outbox.reap()
        return header.nbytes + payload.nbytes


class ChannelsAbandonedError(RuntimeError):
    """A receive on channels that were abandoned (the pipeline broke)."""


#: What :meth:`PipelineChannels.abandon` puts in rank 0's own queues.
_ABANDONED = object()


def _local(item: Any) -> Any:
    """An item of rank 0's own queue, or the error its abandonment means."""
    if item is _ABANDONED:
        raise ChannelsAbandonedError("the pipeline broke; no result will come")
    return item


def _recv_object(src: int, group: dist.ProcessGroup) -> object:
    """The next object ``src`` sent over ``group``."""
    header = torch.empty(1, dtype=torch.long)
    dist.recv(header, src=src, group=group)
    payload = torch.empty(int(header), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group)
    return _decode(payload)


def _encode(value: object) -> torch.Tensor:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> object:
    return pickle.loads(payload.numpy().tobytes())
