"""The engine core's use of a KV connector: admissions to load, load reports, saves.

A waiting request whose prefix an offload tier extends is admitted to *load* instead of
to compute: it joins the running list with its pages allocated, marked ``in_step`` (so
no step runs it, no preemption takes its pages, an abort frees them only once the load
is reported), and its :class:`LoadTask` rides on the next step. Other requests run
meanwhile. When a step's result reports the load::

    every (group, block) loaded   the request runs from the loaded prefix
    any failed                    its keys are forgotten, its pages freed, and it waits
                                  again: its next lookup resumes the longest prefix every
                                  group can still resume (local pages, other tiers), and
                                  the rest is recomputed: the output is the same

Blocks are saved as steps fill them and when a request ends (see
``hybridkv.memory.offload.connector`` for which); the pages are read at the start of the
next step, before it can write any of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from hybridkv.errors.events import get_logger
from hybridkv.memory.manager import KVCacheManager, PrefixHit
from hybridkv.memory.offload.config import OffloadConfig
from hybridkv.memory.offload.connector import LOOKUP_PENDING, KVConnector, PlannedLoad
from hybridkv.memory.offload.keys import KeySpace
from hybridkv.memory.offload.transfers import BlockSave, KVTransfers, LoadReport, LoadTask
from hybridkv.scheduler.config import ConfigError
from hybridkv.scheduler.meter import PrefixCounter
from hybridkv.scheduler.request import Request, RequestStatus
from hybridkv.scheduler.step_planner import Loader

log = get_logger(__name__)

#: Loads a request may start; after as many failures it computes without the connector.
MAX_LOAD_ATTEMPTS = 2


@attrs.frozen
class LoadOutcome:
    """A reported load: its request, what was planned, and whether every page loaded."""

    request: Request
    planned: PlannedLoad
    report: LoadReport

    @property
    def is_complete(self) -> bool:
        """Every (group, block) of the load holds its K/V."""
        return not self.report.failed


class EngineOffload:
    """Loads in progress and saves to send, for one :class:`EngineCore` (not thread-safe).

    Args:
        config: The tiers and settings.
        keys: The model's key space (the executor's, see ``attach_offload``).
        kv: The engine's KV cache manager.
    """

    def __init__(self, config: OffloadConfig, keys: KeySpace, kv: KVCacheManager) -> None:
        self.connector = KVConnector(config, keys, kv)
        self.stats = config.stats
        self._loading: dict[str, tuple[Request, PlannedLoad]] = {}
        self._attempts: dict[str, int] = {}
        self._new_loads: list[LoadTask] = []
        self._saves: list[BlockSave] = []

    @property
    def has_transfers(self) -> bool:
        """Loads in progress, or loads or saves to send with the next step."""
        return bool(self._loading or self._new_loads or self._saves)

    @property
    def num_loading(self) -> int:
        """Requests whose load has not been reported."""
        return len(self._loading)

    @property
    def loader(self) -> Loader:
        """The planner's loader (:meth:`admit`)."""
        return self.admit

    def admit(self, request: Request, hit: PrefixHit) -> bool | None:
        """The planner's loader: admit ``request`` to load, if a tier extends ``hit``;
        None while a remote tier's answer is on its way (the request waits a step)."""
        rid = request.request_id
        if self._attempts.get(rid, 0) >= MAX_LOAD_ATTEMPTS:
            return False
        planned = self.connector.plan_load(request, hit)
        if planned is LOOKUP_PENDING:
            return None
        if not isinstance(planned, PlannedLoad):
            return False
        self._attempts[rid] = self._attempts.get(rid, 0) + 1
        self._loading[rid] = (request, planned)
        self._new_loads.append(planned.task)
        request.in_step = True
        request.num_computed_tokens = hit.num_tokens
        request.log.info(
            "kv_load_started",
            num_local_tokens=hit.num_tokens,
            num_tokens=planned.num_tokens,
            num_blocks=len(planned.task.blocks),
            tier=planned.tier_name,
        )
        return True

    def take_transfers(self) -> KVTransfers | None:
        """The next step's transfers (None when there are none)."""
        if not self.has_transfers:
            return None
        transfers = KVTransfers(
            loads=tuple(self._new_loads),
            saves=tuple(self._saves),
            num_loading=len(self._loading) - len(self._new_loads),
        )
        self._new_loads, self._saves = [], []
        return transfers

    def reported(self, report: LoadReport) -> LoadOutcome | None:
        """Take a load's report: the request stops waiting for it (``in_step`` cleared).

        A failed load's keys are forgotten in every tier. None for an unknown request.
        """
        entry = self._loading.pop(report.request_id, None)
        if entry is None:
            return None
        request, planned = entry
        request.in_step = False
        if report.failed:
            self.connector.forget(report.failed_keys)
            request.log.warning(
                "kv_load_failed",
                num_failed_blocks=len(report.failed),
                num_loaded_blocks=len(report.loaded),
                first_failed=report.failed[0],
            )
        else:
            hits = self.stats.hit_tokens
            hits[planned.tier_name] = (
                hits.get(planned.tier_name, 0) + planned.num_tokens - planned.num_local_tokens
            )
            request.log.info(
                "kv_load_finished",
                num_tokens=planned.num_tokens,
                num_bytes=report.num_bytes,
                tier=planned.tier_name,
            )
        return LoadOutcome(request, planned, report)

    def apply_loads(
        self, reports: Sequence[LoadReport], now: float, prefix: PrefixCounter
    ) -> list[Request]:
        """Take a step's load reports: a complete load's request runs from its loaded
        prefix; an incomplete one's pages are freed and it is returned, to wait again."""
        kv = self.connector.kv
        again = []
        for report in reports:
            outcome = self.reported(report)
            if outcome is None:
                continue
            request = outcome.request
            if request.status is RequestStatus.FINISHED:  # aborted while loading
                kv.free(request.request_id, computed=False)
            elif not outcome.is_complete:
                kv.free(request.request_id, computed=False)
                request.status = RequestStatus.WAITING
                request.num_computed_tokens = 0
                again.append(request)
            else:
                request.num_computed_tokens = outcome.planned.num_tokens
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                    request.num_cached_tokens = outcome.planned.num_tokens
                    prefix.record(request.num_cached_tokens, request.num_prompt_tokens)
        return again

    def filled(self, request: Request, num_before: int) -> None:
        """A step computed ``request``'s tokens from ``num_before`` on: save what filled."""
        bs = self.connector.kv.block_size
        start, stop = num_before // bs, request.num_computed_tokens // bs
        if stop > start:
            self._saves += self.connector.saves_filled(request, start, stop)

    def ended(self, request: Request) -> None:
        """``request`` ends holding its pages: save what a resume at its end needs."""
        self._attempts.pop(request.request_id, None)
        bs = self.connector.kv.block_size
        stop = request.num_computed_tokens // bs
        if stop:
            self._saves += self.connector.saves_filled(request, stop, stop, is_end=True)
        resumed = request.num_cached_tokens // bs
        if 0 < resumed < stop:
            self.connector.supersede(request, resumed, stop)

    def drop(self, request: Request) -> None:
        """Forget a request that ends without its pages (aborted, failed, shut down)."""
        self._attempts.pop(request.request_id, None)
        self.connector.forget_lookups(request.request_id)

    def close(self) -> None:
        """Stop the connector's lookup worker (the engine shut down)."""
        self.connector.close()

    def loading_requests(self) -> list[Request]:
        """Requests whose load is in progress."""
        return [request for request, _ in self._loading.values()]


class NoOffload:
    """The core's seam without tiers: nothing loads, nothing is saved, nothing reports."""

    loader: Loader | None = None
    has_transfers = False

    def take_transfers(self) -> None:
        """No transfers, ever."""
        return None

    def apply_loads(
        self, reports: Sequence[LoadReport], now: float, prefix: PrefixCounter
    ) -> list[Request]:
        """Never called with reports: no load was started."""
        assert not reports, "load reports without a connector"
        return []

    def filled(self, request: Request, num_before: int) -> None:
        """Nothing to save."""

    def ended(self, request: Request) -> None:
        """Nothing to save."""

    def drop(self, request: Request) -> None:
        """Nothing to forget."""

    def loading_requests(self) -> list[Request]:
        """No loads."""
        return []

    def close(self) -> None:
        """Nothing to stop."""


@runtime_checkable
class OffloadingExecutor(Protocol):
    """An executor that moves KV pages to and from offload tiers.

    ``attach_offload`` starts its transfer worker (``hybridkv.memory.offload.worker``)
    over its pages and returns the key space of its model and layout. From then on it
    runs each batch's ``transfers`` at the start of ``execute``, before any layer, also
    for a batch without requests, and returns the finished loads in ``kv_loads``; a load
    it has started is reported exactly once, by a later result if the step that wrote it
    then failed.
    """

    def attach_offload(self, config: OffloadConfig) -> KeySpace:
        """Start moving pages to and from ``config.tiers``; the model's key space."""
        ...


def attach_offload(
    executor: object, config: OffloadConfig | None, max_steps_in_flight: int
) -> tuple[OffloadConfig, KeySpace] | None:
    """Attach ``config``'s tiers to ``executor``; what :class:`EngineCore` takes.

    Raises:
        ConfigError: the executor cannot move pages, or keeps several steps in flight.
    """
    if config is None:
        return None
    # Steps in flight first: offload refuses them whatever the executor, so the error
    # names both parts rather than a pipelined executor's missing page mover.
    if max_steps_in_flight > 1:
        raise ConfigError(
            f"KV offload runs with one step in flight; the executor keeps {max_steps_in_flight}"
        )
    if not isinstance(executor, OffloadingExecutor):
        raise ConfigError(f"{type(executor).__name__} cannot move KV pages to offload tiers")
    return config, executor.attach_offload(config)
