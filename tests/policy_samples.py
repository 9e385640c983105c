"""A user's memory policy for the tests that run it in several processes: a spawned worker
unpickles it by its module, so it lives where every process of the suite imports it."""

from __future__ import annotations

from typing import ClassVar

import attrs

from hybridkv.policies import MemoryPolicy, Span, register_policy
from hybridkv.policies.base import positive


@register_policy
@attrs.frozen
class SinkWindow(MemoryPolicy):
    """Keep the first ``sinks`` tokens and the last ``window`` tokens (StreamingLLM),
    written by subclassing ``MemoryPolicy`` only; registered, so a command line names it
    (``--import policy_samples --layer-policy full_attention=sample_sink_window:...``)."""

    name: ClassVar[str] = "sample_sink_window"
    sinks: int = attrs.field(validator=positive)
    window: int = attrs.field(validator=positive)

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        start = max(0, num_tokens - self.window + 1)
        if start <= self.sinks:
            return ((0, num_tokens),) if num_tokens else ()
        return ((0, self.sinks), (start, num_tokens))
