"""The waiting queue: requests not holding pages, most urgent first.

A binary heap keyed by ``(priority, arrival_seq)``. Under the default ``fcfs`` scheduling
policy every priority is 0 (the core refuses others: ``EngineConfig.check_priority``), so
arrival alone orders it; under ``priority``, lower values go first. A preempted request
goes back with its original key, so it is readmitted ahead of everything that arrived
after it. An aborted request is dropped lazily: its entry stays until it reaches the
top::

    heap  (0, 3, r3)  (0, 7, r7)  (1, 2, r2) ...     peek() -> r3 unless r3 finished
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from hybridkv.scheduler.errors import EngineOverloadedError
from hybridkv.scheduler.request import Request, RequestStatus


class WaitingQueue:
    """Waiting requests by priority, then arrival. ``len`` counts live entries only."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._num_live = 0

    def __len__(self) -> int:
        return self._num_live

    def __iter__(self) -> Iterator[Request]:
        """Live requests, in no particular order."""
        return (r for _, _, r in self._heap if r.status is RequestStatus.WAITING)

    def check_room(self, limit: int) -> None:
        """Refuse a request while ``limit`` wait already.

        Raises:
            EngineOverloadedError: the queue is full.
        """
        if self._num_live >= limit:
            raise EngineOverloadedError(
                f"{self._num_live} requests are waiting, the limit is max_waiting={limit}; "
                "retry later"
            )

    def push(self, request: Request) -> None:
        """Add a request whose status is WAITING."""
        assert request.status is RequestStatus.WAITING
        heapq.heappush(self._heap, (request.priority, request.arrival_seq, request))
        self._num_live += 1

    def peek(self) -> Request | None:
        """The most urgent live request, or None."""
        heap = self._heap
        while heap:
            request = heap[0][2]
            if request.status is RequestStatus.WAITING:
                return request
            heapq.heappop(heap)  # discarded earlier: drop it now
        return None

    def pop(self) -> Request:
        """Remove and return the request :meth:`peek` returned."""
        request = self.peek()
        assert request is not None
        heapq.heappop(self._heap)
        self._num_live -= 1
        return request

    def discard(self, request: Request) -> None:
        """Forget a live request; call it before changing its status from WAITING."""
        assert request.status is RequestStatus.WAITING
        self._num_live -= 1
