"""The async engine: one long-lived task that plans, runs and applies steps.

::

    async with Engine(config, executor) as engine:       # starts the loop in a task group
        async for out in engine.generate(prompt_ids, SamplingParams(max_tokens=32)):
            print(out.new_token_ids)

One loop keeps up to D steps in flight (1, or a
:class:`~hybridkv.scheduler.batch.PipelinedExecutor`'s ``max_steps_in_flight``)::

    plan step k (sync) --> submit it (a pipelined executor's own submit(); a plain
                           executor's execute() starts on a worker thread as the loop
                           waits for it)
                       --> deliver step k-1's outputs (consumers run while step k does)
                       --> wait for the oldest step, apply its result, plan again

A pipelined executor gets up to D planned steps (each without the requests of the
others) before the loop waits; results are applied in step order as they come back.

It waits only when idle. ``generate`` and ``abort`` are synchronous underneath and run on
the loop's thread, so requests never wait behind the step in flight to be accepted. The
previous step's outputs are released once the next step is on its way, so waking
hundreds of consumers never delays the executor.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from types import TracebackType

import anyio
import anyio.abc

from hybridkv.errors import HybridKVError
from hybridkv.errors.events import get_logger
from hybridkv.memory.cache_events import CacheEventSink
from hybridkv.memory.offload.config import OffloadConfig
from hybridkv.scheduler.batch import (
    Executor,
    ExecutorBrokenError,
    PipelinedExecutor,
    StepBatch,
    StepResult,
)
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.connector import attach_offload
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.errors import EngineStoppedError
from hybridkv.scheduler.in_flight import steps_in_flight
from hybridkv.scheduler.loop_host import AsyncioHost, on_asyncio
from hybridkv.scheduler.outputs import EngineStats, FinishReason
from hybridkv.scheduler.params import SamplingParams
from hybridkv.scheduler.request import Request
from hybridkv.scheduler.speculation import Proposer
from hybridkv.scheduler.step_costs import StepCosts
from hybridkv.scheduler.step_planner import StepPlan
from hybridkv.scheduler.stream import OutputChannel, RequestStream

log = get_logger(__name__)


class Engine:
    """Continuous batching over one executor and one shared KV pool.

    Args:
        config: Pool shape, batch limits, queue bound and stopping tokens.
        executor: Runs steps over the pool it reports (``executor.pool``), which must be
            the pool ``config`` describes: build the config from it
            (``EngineConfig.for_executor``), or the executor from the config.
        offload: Offload tiers for KV blocks (``hybridkv.memory.offload``); the executor
            must move pages (``attach_offload``, see ``scheduler/connector.py``).
        proposer: With ``config.speculative_config``, what proposes tokens (the
            config's n-gram lookup when None; ``scheduler/speculation.py``).
        kv_events: Takes each step's prefix-cache events (``parallel/kv_events.py``).

    Raises:
        ConfigError: the config describes another pool than the executor's, or an
            executor that cannot offload is given tiers.

    Use it as an async context manager (or start :meth:`serve` in your own task group).
    All methods must be called from the thread of the event loop that runs it.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        offload: OffloadConfig | None = None,
        proposer: Proposer | None = None,
        kv_events: CacheEventSink | None = None,
    ) -> None:
        config.check_executor(executor, proposer)
        self.config = config
        self.executor = executor
        depth = steps_in_flight(executor)
        attached = attach_offload(executor, offload, depth)
        self.core = EngineCore(
            config,
            max_steps_in_flight=depth,
            offload=attached,
            proposer=proposer,
            kv_events=kv_events,
            step_costs=StepCosts.of(executor),
        )
        self._wakeup: anyio.Event | None = None  # set while the loop idles
        self._has_served = False
        self._is_running = False
        self._error: BaseException | None = None
        self._loop_thread: int | None = None
        # Aborts from dropped iterators, queued: their finalizers may run on any thread.
        self._foreign_aborts: deque[Request] = deque()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._host: AsyncioHost | None = None
        self._depth = self.core.max_steps_in_flight
        # Steps submitted, oldest first (one at most, unless the executor is pipelined:
        # then a future that _finish runs the step into).
        self._pending: deque[tuple[StepPlan, Future[StepResult]]] = deque()
        # Set (and dropped) whenever the state stats() reads may have changed; made by
        # the first waiter (an anyio Event needs the running loop).
        self._changed: anyio.Event | None = None

    # -- lifetime ----------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        """Start the loop. On asyncio it runs in a host task of its own, so the engine may
        be entered and exited from different tasks (a pytest-asyncio async fixture sets
        up and tears down in two); on trio, in a task group of the entering task."""
        self._check_unserved()
        if on_asyncio():
            self._host = AsyncioHost(self.serve)
            await self._host.start()
            return self
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            await task_group.start(self.serve)
        except BaseException as exc:
            await task_group.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._task_group = task_group
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        host, self._host = self._host, None
        if host is not None:
            await host.stop()
            return None
        task_group, self._task_group = self._task_group, None
        assert task_group is not None
        task_group.cancel_scope.cancel()  # stops the loop once the step in flight returns
        return await task_group.__aexit__(exc_type, exc, tb)

    @property
    def is_running(self) -> bool:
        """Whether the loop runs and accepts requests."""
        return self._is_running

    @property
    def error(self) -> BaseException | None:
        """The executor's :class:`ExecutorBrokenError` that stopped the engine, if any."""
        return self._error

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the loop until cancelled or the executor breaks; then end every request.

        Pending requests end with finish reason ``shutdown`` on cancellation, or with an
        :class:`EngineStoppedError` (caused by the executor's error) when it broke; the
        broken executor's error is not raised again here (see :attr:`error`). Any other
        exception is a bug: waiters get an :class:`EngineStoppedError` and it propagates.
        """
        self._check_unserved()
        self._has_served = True
        self._loop_thread = threading.get_ident()
        # Steps get their own worker thread, never queued behind the app's other threads.
        limiter = anyio.CapacityLimiter(1)
        self._is_running = True
        error: HybridKVError | None = None
        task_status.started()
        try:
            await self._loop(limiter)
        except ExecutorBrokenError as exc:
            self._error = exc
            log.error("engine_broken", error=repr(exc))
            error = EngineStoppedError(f"the executor broke: {exc!r}")
            error.__cause__ = exc
        except Exception as exc:
            self._error = exc
            error = EngineStoppedError(f"the engine loop failed: {exc!r}")
            error.__cause__ = exc
            raise
        finally:
            self._is_running = False
            if self._depth > 1 and self._pending:
                # Submitted steps still use their blocks: wait them out before freeing (a
                # plain executor's step has ended: _finish runs it shielded).
                with anyio.CancelScope(shield=True):
                    futures = [future for _, future in self._pending]
                    await anyio.to_thread.run_sync(wait_futures, futures, limiter=limiter)
            # Synchronous: safe under cancellation, never needs shielding.
            self.core.shutdown(error)
            self._notify()

    def _check_unserved(self) -> None:
        if self._has_served:
            raise EngineStoppedError("an engine serves once; make a new one")

    async def _loop(self, limiter: anyio.CapacityLimiter) -> None:
        """Keep up to ``max_steps_in_flight`` steps submitted (1 unless the executor is
        pipelined); apply their results in order. Outputs go to consumers while a step
        runs, so that they use the core the step leaves idle."""
        core, pending = self.core, self._pending
        while True:
            self._drain_foreign_aborts()
            if len(pending) < self._depth and core.has_work:
                plan = core.plan()
                self._notify()  # admissions and preemptions change what stats() reads
                if plan.runs:
                    pending.append((plan, self._submit(plan.batch)))
                    core.flush()  # consumers run while the step does
                    continue
            core.flush()
            if pending:
                plan, future = pending[0]
                await self._finish(plan.batch, future, limiter)
                pending.popleft()
                error = future.exception()
                if isinstance(error, ExecutorBrokenError):
                    raise error  # shutdown() ends the step's requests with the rest
                if error is not None:  # the step failed; its requests fail, the rest go on
                    core.fail(plan, error)
                else:
                    core.apply(plan, future.result())
                self._notify()
            elif core.has_work:
                # Everyone was preempted (admission resumes next step), or nothing fits.
                await anyio.lowlevel.checkpoint()
            else:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()  # idle until generate() sets it

    def _submit(self, batch: StepBatch) -> Future[StepResult]:
        """Start a step on a pipelined executor (its own ``submit``); a plain executor's
        step gets a future that :meth:`_finish` runs it into."""
        if self._depth > 1:
            executor: PipelinedExecutor = self.executor  # type: ignore[assignment]
            return executor.submit(batch)
        return Future()

    async def _finish(
        self, batch: StepBatch, future: Future[StepResult], limiter: anyio.CapacityLimiter
    ) -> None:
        """Wait for the oldest step: a pipelined one's future, or a plain executor's
        ``execute`` run now on a worker thread, one hop (shielded, so that its outcome
        always reaches the future: the blocks it used are freed only after)."""
        if self._depth > 1:
            await anyio.to_thread.run_sync(wait_futures, [future], limiter=limiter)
            return
        with anyio.CancelScope(shield=True):
            try:
                result = await anyio.to_thread.run_sync(
                    self.executor.execute, batch, limiter=limiter
                )
            except Exception as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
        await anyio.lowlevel.checkpoint()  # a cancellation that came meanwhile, now

    # -- requests ----------------------------------------------------------------------

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        speculative: bool = True,
    ) -> RequestStream:
        """Queue a request and return the async iterator of its outputs.

        Args:
            prompt_token_ids: The prompt (at least one token).
            params: Sampling parameters (defaults: ``SamplingParams()``).
            request_id: Unique among live requests; a fresh one is made if None.
            priority: Lower values are served first, equal ones in arrival order, under
                ``EngineConfig.scheduling_policy="priority"``; under ``"fcfs"`` (the
                default) only 0 is accepted.
            cache_salt: Separates prefix-cache entries (e.g. per tenant).
            speculative: False opts this request out of speculative decoding (where the
                config turns it on): its steps then verify no proposed tokens.

        Raises (at once, before anything is queued):
            InvalidRequestError: malformed prompt or a request id in use.
            PromptTooLongError: the request can never fit the model or the pool.
            EngineOverloadedError: too many requests wait (``max_waiting``).
            EngineStoppedError: the engine is not running.
        """
        if not self._is_running:
            raise EngineStoppedError("the engine is not running") from self._error
        self._drain_foreign_aborts()  # a dropped iterator's request id is free again
        request_id = uuid.uuid4().hex if request_id is None else request_id
        channel = OutputChannel()
        request = self.core.add_request(
            prompt_token_ids,
            params or SamplingParams(),
            channel,
            request_id=request_id,
            priority=priority,
            extra_keys=() if cache_salt is None else (cache_salt,),
            speculative=speculative,
        )
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()
        self._notify()
        return RequestStream(request, channel, self._abort_dropped)

    def abort(self, request_id: str) -> bool:
        """End a request with finish reason ``abort``; its pages are freed at once, or as
        soon as the step running it returns. Returns False if it is not live."""
        self._drain_foreign_aborts()
        aborted = self.core.abort(request_id)
        self._notify()
        return aborted

    def stats(self) -> EngineStats:
        """Queue lengths, pages used per group, prefix hit rate, recent throughput."""
        self._drain_foreign_aborts()
        return self.core.stats()

    async def wait_until(self, predicate: Callable[[EngineStats], bool]) -> EngineStats:
        """Wait, without polling, until ``predicate(stats())`` holds, and return those stats.

        The predicate is tried now and after every change of what :meth:`stats` reads (a
        step planned, applied or failed, a request added or aborted, the engine stopped);
        bound the wait with ``anyio.fail_after``. For tests and health checks::

            await engine.wait_until(lambda s: s.num_running + s.num_waiting == 0)

        Raises:
            EngineStoppedError: the engine stopped with the predicate still false.
        """
        while True:
            if self._changed is None:
                self._changed = anyio.Event()
            changed = self._changed
            stats = self.stats()
            if predicate(stats):
                return stats
            if self._has_served and not self._is_running:
                raise EngineStoppedError("the engine stopped; the state waited for never came")
            await changed.wait()

    def _notify(self) -> None:
        """Wake every :meth:`wait_until` (on the loop's thread)."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _abort_dropped(self, request: Request, is_finalizer: bool) -> None:
        """Abort for an iterator that was closed, or dropped (by a finalizer, which may run
        on another thread or in the middle of the loop's own code: queued for the loop)."""
        if not is_finalizer and threading.get_ident() == self._loop_thread:
            self.core.end(request, FinishReason.ABORT)
        else:
            self._foreign_aborts.append(request)

    def _drain_foreign_aborts(self) -> None:
        """End the requests of dropped iterators. The loop and every public method call it
        before they read or change the core, so a drop still reads as an abort at once."""
        if self._foreign_aborts:
            while self._foreign_aborts:
                self.core.end(self._foreign_aborts.popleft(), FinishReason.ABORT)
            self._notify()


__all__ = ["Engine", "RequestStream"]
