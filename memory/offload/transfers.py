"""What a step carries to the executor's transfer worker, and what comes back.

Loads and saves ride on :class:`~hybridkv.scheduler.batch.StepBatch` (its ``transfers``)
and their reports on :class:`~hybridkv.scheduler.batch.StepResult` (its ``kv_loads``)::

    plan k      a request is admitted to load: pages allocated, LoadTask on batch k
    step k      the worker starts fetching its blocks (a thread), the step runs without it
    step k+j    the fetch is done: pages written before step k+j's layers run;
                its LoadReport (per (group, block): loaded or failed) on result k+j
    apply k+j   the request runs from its loaded prefix, or resumes a shorter one

Saves are the pages of blocks that finished filling, read at the start of the next step,
before any of its writes can reuse a page.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class BlockLoad:
    """Fill ``page`` of ``group`` (block ``block`` of the request) from ``tiers[tier]``."""

    group: int
    block: int
    page: int
    key: bytes
    tier: int


@attrs.frozen
class LoadTask:
    """A request's blocks to load, every group at once."""

    request_id: str
    blocks: tuple[BlockLoad, ...]


@attrs.frozen
class BlockSave:
    """Store the page ``page`` of ``group`` under ``key`` in every tier."""

    group: int
    page: int
    key: bytes


@attrs.frozen(kw_only=True)
class KVTransfers:
    """A step's transfers.

    Attributes:
        loads: Loads to start now.
        saves: Pages to read now (before the step writes anything) and store.
        num_loading: Loads started by earlier steps and not yet reported: a step that
            runs no request waits a little for one of them instead of returning at once.
    """

    loads: tuple[LoadTask, ...] = ()
    saves: tuple[BlockSave, ...] = ()
    num_loading: int = 0


@attrs.frozen(kw_only=True)
class LoadReport:
    """A finished load: which (group, block) pages hold their K/V now, which do not.

    Attributes:
        request_id: The request the load was for.
        loaded: (group, block) pairs written from a tier.
        failed: (group, block) pairs missing, corrupt, or whose tier failed: their pages
            hold nothing usable.
        failed_keys: The keys of ``failed`` (the connector forgets them).
        num_bytes: Bytes written into pages.
    """

    request_id: str
    loaded: tuple[tuple[int, int], ...]
    failed: tuple[tuple[int, int], ...] = ()
    failed_keys: tuple[bytes, ...] = ()
    num_bytes: int = 0
