"""Pipeline stages: which contiguous run of layers each stage holds.

A model of 6 layers in 3 stages, as ``hybridkv plan --pp-stages`` splits it too::

    layer    0  1 | 2  3 | 4  5
    stage      0  |   1  |   2        stage 0 also embeds the tokens,
                                       the last stage also norms, projects and samples

Earlier stages take the remainder when the layers do not divide evenly. The KV layout
is planned for the whole model with these stages (``plan_layout(stages=...)``), so every
stage gets the same number of pages per group and holds only its own layers' pages.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from hybridkv.memory.layout import ModelLayer, page_owner
from hybridkv.models.errors import ParallelConfigError


@attrs.frozen
class PipelineStage:
    """Stage ``index`` of ``num_stages``, holding layers ``[start, stop)``."""

    index: int
    num_stages: int
    start: int
    stop: int

    @property
    def layers(self) -> range:
        """The global indices of its layers."""
        return range(self.start, self.stop)

    @property
    def is_first(self) -> bool:
        """Whether it embeds the tokens."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Whether it computes logits and samples."""
        return self.index == self.num_stages - 1


def split_layers(num_layers: int, num_stages: int) -> list[PipelineStage]:
    """Contiguous stages of near-equal layer counts, earlier stages taking the remainder.

    Raises:
        ParallelConfigError: fewer than one stage, or more stages than layers (a stage
            without a layer would only forward hidden states).
    """
    if num_stages < 1:
        raise ParallelConfigError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ParallelConfigError(
            f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers; "
            "each stage needs at least one layer"
        )
    base, extra = divmod(num_layers, num_stages)
    stages, start = [], 0
    for i in range(num_stages):
        stop = start + base + (1 if i < extra else 0)
        stages.append(PipelineStage(i, num_stages, start, stop))
        start = stop
    return stages


def check_stage_cuts(
    layers: Sequence[ModelLayer], num_stages: int, *, embeddings_read_by: str | None = None
) -> list[PipelineStage]:
    """The stages of :func:`split_layers`, once every layer that reads another layer's
    cache finds it in its own stage.

    Raises:
        ParallelConfigError: as :func:`split_layers`; a cut between a layer and the layer
            whose cache it reads (Gemma 4's KV-shared layers), or, where layers read
            the token embeddings (``embeddings_read_by`` names what reads them:
            ``ModelConfig.embeddings_read_by``), any cut: only the first stage holds them.
    """
    stages = split_layers(len(layers), num_stages)
    if embeddings_read_by is not None and num_stages > 1:
        raise ParallelConfigError(
            f"pipeline_parallel_size={num_stages}: the model's layers read the token "
            f"embeddings ({embeddings_read_by}), which only the first stage holds; serve it "
            "in one stage"
        )
    stage_of = {layers[i].name: stage.index for stage in stages for i in stage.layers}
    for spec in layers:
        owner = page_owner(spec)
        if stage_of.get(owner, stage_of[spec.name]) != stage_of[spec.name]:
            raise ParallelConfigError(
                f"pipeline_parallel_size={num_stages} puts layer {spec.name!r} in stage "
                f"{stage_of[spec.name]} and {owner!r}, whose KV cache it reads, in stage "
                f"{stage_of[owner]}; choose a stage count that keeps them together"
            )
    return stages
