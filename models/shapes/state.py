"""What sizing needs of a state mixer's shape (``Mamba2Shape``, ``DeltaNetShape``):
its bytes per request, and the share a tensor-parallel rank holds (torch-free)."""

from __future__ import annotations

from typing import Protocol


class StateShape(Protocol):
    """A state mixer's shape, as far as the planner and the tensor cuts need it."""

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in one layer."""
        ...

    @property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of a state's parts, in page order (float32)."""
        ...

    def tensor_share(self, size: int) -> StateShape:
        """The shape one of ``size`` tensor-parallel ranks holds."""
        ...
