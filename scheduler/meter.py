"""What the engine counts as it runs: recent throughput, and the prefix cache's hit rate."""

from __future__ import annotations

from collections import deque

import attrs


class ThroughputMeter:
    """Remembers (time, tokens run, tokens generated) per step; rates are read on demand.

    A rate runs from the first remembered step inside the window until the time asked,
    so it falls to zero once the engine idles::

        steps     |   s1   s2   s3          now
        window    [-------------------------]      rate = (tokens of s2, s3) / (now - s1)
    """

    def __init__(self, window_s: float = 10.0, max_steps: int = 4096) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=max_steps)

    def record(self, now: float, num_tokens: int, num_outputs: int) -> None:
        """Note a step that ended at ``now``."""
        self._steps.append((now, num_tokens, num_outputs))

    def rates(self, now: float) -> tuple[float, float]:
        """Tokens run and tokens generated per second, recent steps only."""
        recent = [s for s in self._steps if now - s[0] <= self.window_s]
        if len(recent) < 2 or now <= recent[0][0]:
            return 0.0, 0.0
        span = now - recent[0][0]
        return (
            sum(n for _, n, _ in recent[1:]) / span,
            sum(o for _, _, o in recent[1:]) / span,
        )


@attrs.define
class PrefixCounter:
    """Prompt tokens served from the prefix cache (or a tier) at first admission, and
    looked up: a preempted request's recomputation hits its own pages and is not counted."""

    num_hit_tokens: int = 0
    num_query_tokens: int = 0

    def record(self, num_hit_tokens: int, num_prompt_tokens: int) -> None:
        """A request admitted for the first time, with ``num_hit_tokens`` of its prompt."""
        self.num_hit_tokens += num_hit_tokens
        self.num_query_tokens += num_prompt_tokens

    @property
    def hit_rate(self) -> float:
        """Hit tokens over looked-up tokens (0 before any lookup)."""
        queries = self.num_query_tokens
        return self.num_hit_tokens / queries if queries else 0.0
