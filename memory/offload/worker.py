"""The executor's side of the connector: moves pages between the KV cache and the tiers.

The executor calls :meth:`TransferWorker.run` at the start of every step, on its own
thread, before any layer runs::

    1. saves    read the pages now (nothing of this step has written yet), queue them for
                the saver thread; a full queue drops them: a step never waits on a save
    2. loads    start fetching new loads on the loader thread (reads, checksums)
    3. done     write the fetched blocks into their pages; report each load
    (a step with no request and loads pending waits up to ``idle_wait_s`` for one)

Pages are read and written only through :class:`PageIO`, on the executor's thread; the
threads touch only bytes and the tiers. Tier failures become failed (group, block) loads
and dropped saves, never an exception out of ``run``.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from hybridkv.errors.events import get_logger
from hybridkv.memory.offload.blob import KVBlock, decode, encode
from hybridkv.memory.offload.config import OffloadConfig
from hybridkv.memory.offload.errors import CorruptBlockError, TierUnavailableError
from hybridkv.memory.offload.transfers import BlockSave, KVTransfers, LoadReport, LoadTask

log = get_logger(__name__)

# One fetched load: its task, and per block the decoded block or None (failed).
_Fetched = tuple[LoadTask, list[KVBlock | None]]


class PageIO(Protocol):
    """Reads and writes whole pages of one KV group, on the executor's thread."""

    def read_pages(self, group: int, pages: Sequence[int]) -> list[KVBlock]:
        """Copies of ``group``'s pages (every layer of the group), in order."""
        ...

    def write_pages(self, group: int, pages: Sequence[int], blocks: Sequence[KVBlock]) -> None:
        """Write blocks into ``group``'s pages.

        Raises:
            CorruptBlockError: a block's shape or dtype is not the page's.
        """
        ...


class TransferWorker:
    """Loads and saves for one executor (see the module docstring).

    Args:
        pages: The executor's page access.
        config: The tiers, the save queue bound, the counters.
        idle_wait_s: How long a step without requests waits for a pending load.
    """

    def __init__(self, pages: PageIO, config: OffloadConfig, *, idle_wait_s: float = 0.01):
        self.pages = pages
        self.config = config
        self.stats = config.stats
        self.idle_wait_s = idle_wait_s
        self._loads: queue.SimpleQueue[LoadTask | None] = queue.SimpleQueue()
        self._saves: queue.Queue[list[tuple[bytes, KVBlock]] | None] = queue.Queue()
        self._num_queued_saves = 0  # blocks in _saves (changed under _lock)
        self._fetched: deque[_Fetched] = deque()
        self._undelivered: list[LoadReport] = []
        self._lock = threading.Condition()
        self._threads = [
            threading.Thread(target=self._load_loop, name="kv-load", daemon=True),
            threading.Thread(target=self._save_loop, name="kv-save", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def run(self, transfers: KVTransfers | None, *, is_idle: bool) -> tuple[LoadReport, ...]:
        """A step's transfers (see the module docstring); the loads finished by now."""
        if transfers is not None:
            if transfers.saves:
                self._queue_saves(transfers.saves)
            for task in transfers.loads:
                self._loads.put(task)
            if is_idle and transfers.num_loading + len(transfers.loads) and not self._fetched:
                with self._lock:
                    self._lock.wait_for(lambda: bool(self._fetched), timeout=self.idle_wait_s)
        reports, self._undelivered = self._undelivered, []
        while self._fetched:
            reports.append(self._write(*self._fetched.popleft()))
        return tuple(reports)

    def undeliver(self, reports: Sequence[LoadReport]) -> None:
        """Reports :meth:`run` returned for a step that then failed: the next run returns
        them again, so every load is reported exactly once."""
        self._undelivered[:0] = reports

    def wait_saved(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued save is written (or dropped); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._num_queued_saves, timeout=timeout_s)

    def close(self) -> None:
        """Stop the threads once they finish what they hold (saves queued are written)."""
        self._loads.put(None)
        self._saves.put(None)
        for thread in self._threads:
            thread.join(timeout=5.0)

    # -- saves -------------------------------------------------------------------------

    def _queue_saves(self, saves: Sequence[BlockSave]) -> None:
        room = self.config.max_pending_saves - self._num_queued_saves
        if room < len(saves):
            self.stats.num_dropped_saves += len(saves) - max(room, 0)
            saves = saves[: max(room, 0)]
        by_group: dict[int, list[BlockSave]] = {}
        for save in saves:
            by_group.setdefault(save.group, []).append(save)
        items: list[tuple[bytes, KVBlock]] = []
        for group, group_saves in by_group.items():
            blocks = self.pages.read_pages(group, [s.page for s in group_saves])
            items.extend((s.key, b) for s, b in zip(group_saves, blocks, strict=True))
        if items:
            with self._lock:
                self._num_queued_saves += len(items)
            self._saves.put(items)

    def _save_loop(self) -> None:
        while (items := self._saves.get()) is not None:
            encoded = [(key, encode(block)) for key, block in items]
            num_bytes = sum(block.num_bytes for _, block in items)
            num_stored = 0
            for tier in self.config.tiers:
                try:
                    tier.put(encoded)
                    num_stored += 1
                except TierUnavailableError:
                    continue  # the tier logged it; the others still get the blocks
            if num_stored:
                self.stats.num_saved_blocks += len(items)
                self.stats.num_saved_bytes += num_bytes
            else:
                self.stats.num_dropped_saves += len(items)
            with self._lock:
                self._num_queued_saves -= len(items)
                self._lock.notify_all()

    # -- loads -------------------------------------------------------------------------

    def _load_loop(self) -> None:
        while (task := self._loads.get()) is not None:
            blocks: list[KVBlock | None] = [None] * len(task.blocks)
            by_tier: dict[int, list[int]] = {}
            for i, load in enumerate(task.blocks):
                by_tier.setdefault(load.tier, []).append(i)
            for tier_index, indices in by_tier.items():
                self._fetch(task, tier_index, indices, blocks)
            # Reported however the fetch went: a block still None is a failed load.
            with self._lock:
                self._fetched.append((task, blocks))
                self._lock.notify_all()

    def _fetch(
        self, task: LoadTask, tier_index: int, indices: list[int], blocks: list[KVBlock | None]
    ) -> None:
        """Fill ``blocks[i]`` for ``indices`` from one tier; a block it cannot deliver
        (the tier down or failing mid-reply, a reply short or of the wrong kind, a value
        missing or corrupt) stays None, so the request recomputes exactly those."""
        tier = self.config.tiers[tier_index]
        try:
            values = tier.get([task.blocks[i].key for i in indices])
        except TierUnavailableError:
            return  # the tier logged it
        except Exception as exc:  # a tier's own bug must fail its blocks, not this thread
            log.warning("kv_tier_failed", tier=tier.name, call="get", error=repr(exc))
            return
        if not isinstance(values, list) or len(values) != len(indices):
            log.warning(
                "kv_tier_failed",
                tier=tier.name,
                call="get",
                error=f"{type(values).__name__} reply for {len(indices)} keys",
            )
            return
        for i, value in zip(indices, values, strict=True):
            if value is None:
                continue
            try:
                blocks[i] = decode(value)
            except (CorruptBlockError, TypeError) as exc:  # TypeError: not bytes at all
                log.warning("kv_block_corrupt", tier=tier.name, error=str(exc))

    def _write(self, task: LoadTask, blocks: list[KVBlock | None]) -> LoadReport:
        """Write a fetched load's blocks into their pages (the executor's thread)."""
        by_group: dict[int, list[int]] = {}
        failed = [i for i, block in enumerate(blocks) if block is None]
        for i, block in enumerate(blocks):
            if block is not None:
                by_group.setdefault(task.blocks[i].group, []).append(i)
        num_bytes = 0
        for group, indices in by_group.items():
            pages = [task.blocks[i].page for i in indices]
            found = [blocks[i] for i in indices]
            try:
                self.pages.write_pages(group, pages, [b for b in found if b is not None])
            except CorruptBlockError as exc:
                log.warning("kv_block_mismatch", group=group, error=str(exc))
                failed.extend(indices)
                continue
            num_bytes += sum(b.num_bytes for b in found if b is not None)
        failed_set = set(failed)
        loaded = [i for i in range(len(blocks)) if i not in failed_set]
        self.stats.num_loaded_blocks += len(loaded)
        self.stats.num_loaded_bytes += num_bytes
        self.stats.num_failed_blocks += len(failed_set)
        return LoadReport(
            request_id=task.request_id,
            loaded=tuple((task.blocks[i].group, task.blocks[i].block) for i in loaded),
            failed=tuple((task.blocks[i].group, task.blocks[i].block) for i in sorted(failed_set)),
            failed_keys=tuple(task.blocks[i].key for i in sorted(failed_set)),
            num_bytes=num_bytes,
        )
