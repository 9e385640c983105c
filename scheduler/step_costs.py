"""What a step costs by its number of rows, learned from the steps that ran.

Speculation adds rows to a step (each proposed token is one), so whether a proposal pays
depends on what those rows cost. On a CPU that is not linear: the built-in model's int4
LM head multiplies rows in tiles of four, and its int8 layers switch kernels at 32 rows,
so the 9th row of a step costs about as much as the 9th to the 12th together
(``benchmarks/speculative/run.py`` prints the steps it measured)::

    rows      1    4    8    9   12   13   20   26
    ms       42   59   99  135  140  170  222  295     (2 threads, decode-only steps)

:class:`StepCosts` keeps, per number of rows, a moving average of the seconds of the
decode-only steps that ran with that many (a step with a prefill chunk measures the chunk
too). A row count never measured is estimated from its measured neighbours: between two,
on the line joining them; past the last, along the slope of a least-squares line through
all of them, or as the last while only one was measured (untried, so that it is tried);
below the first, not at all (the caller measures it).
"""

from __future__ import annotations

import bisect
import weakref

#: Weight of a new step's seconds in a row count's moving average.
_SMOOTHING = 0.25
#: Choices before the first one the costs do not favour (made to measure them again); the
#: wait doubles after each, up to ``_EXPLORE_MOST``, since each costs a slower step.
_EXPLORE = 16
_EXPLORE_MOST = 256
#: What an exploring choice adds to the best number of tokens (0: none at all).
_EXPLORE_MORE = (0, 1, 2, 4)


class StepCosts:
    """Seconds of a step by its number of rows (query tokens). Not thread-safe.

    A step's cost is the executor's and the machine's, not an engine's: ``of(executor)``
    gives every engine that runs one executor (one after another, as a benchmark or a
    restarted server does) the costs measured so far, instead of measuring them again.
    """

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._rows: list[int] = []  # measured row counts, sorted
        self._slope_kept: float | None = None  # of the current points; None: recompute
        self._until_explore = _EXPLORE
        self._num_explored = 0

    @classmethod
    def of(cls, executor: object) -> StepCosts:
        """The costs measured on ``executor`` so far (new ones for an executor that
        cannot be weakly referenced)."""
        try:
            return _BY_EXECUTOR.setdefault(executor, cls())
        except TypeError:
            return cls()

    def __len__(self) -> int:
        """How many row counts were measured."""
        return len(self._rows)

    def record(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` rows took ``seconds``."""
        old = self._seconds.get(rows)
        self._slope_kept = None
        if old is None:
            bisect.insort(self._rows, rows)
            self._seconds[rows] = seconds
        else:
            self._seconds[rows] = old + _SMOOTHING * (seconds - old)

    def estimate(self, rows: int) -> float | None:
        """The seconds a step of ``rows`` rows should take; None where no step of as many
        rows or fewer was measured."""
        known = self._seconds.get(rows)
        if known is not None:
            return known
        if not self._rows:
            return None
        at = bisect.bisect_left(self._rows, rows)
        if at == 0:
            return None
        low = self._rows[at - 1]
        if at < len(self._rows):
            high = self._rows[at]
            share = (rows - low) / (high - low)
            return self._seconds[low] + share * (self._seconds[high] - self._seconds[low])
        return self._seconds[low] + (rows - low) * self._slope()

    def exploration(self) -> int | None:
        """Count a choice; now and then (after 16 choices, then 32 more, 64, ... every
        256) what it should verify beyond the best count so that one the costs do not
        favour is measured again: 0 (no proposal at all), 1, 2 or 4 in turn; None else."""
        self._until_explore -= 1
        if self._until_explore:
            return None
        self._num_explored += 1
        self._until_explore = min(_EXPLORE_MOST, _EXPLORE << self._num_explored)
        return _EXPLORE_MORE[self._num_explored % len(_EXPLORE_MORE)]

    def _slope(self) -> float:
        """Seconds per row of a least-squares line through the measured counts (0 with
        one, never negative), kept until the next measurement: a choice estimates many
        counts past the last."""
        if self._slope_kept is None:
            self._slope_kept = self._fit()
        return self._slope_kept

    def _fit(self) -> float:
        points = [(rows, self._seconds[rows]) for rows in self._rows]
        if len(points) < 2:
            return 0.0
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        return max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)


_BY_EXECUTOR: weakref.WeakKeyDictionary[object, StepCosts] = weakref.WeakKeyDictionary()

__all__ = ["StepCosts"]
