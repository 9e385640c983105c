"""Loading a checkpoint for an executor: its weights in their format, and its KV layout.

::

    Checkpoint.open(path)          config.json parsed once into per-layer specs
    check_stage_cuts               the layers this pipeline stage holds (all, without stages)
    load on the torch thread       weights of those layers, quantised, cut to a tensor-
                                   parallel rank's share (``shard``), projections joined
    plan_layout                    the pool for every stage's layers in kv_cache_bytes

The executor (``model_executor``) takes the result and allocates the KV tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import attrs
import torch
from tokenizers import Tokenizer

from hybridkv.errors.events import get_logger
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.torch_thread import TorchThread
from hybridkv.memory.layout import LayerSpec, LayoutPlan, ModelLayer, cached_layers
from hybridkv.memory.layout_planner import plan_layout
from hybridkv.models.errors import ParallelConfigError
from hybridkv.models.stages import check_stage_cuts, split_layers
from hybridkv.models.transformer import CausalLM, holds_weight
from hybridkv.models.weights.precision import quantize_linears
from hybridkv.policies.builtin import FullAttention

log = get_logger(__name__)


@attrs.frozen
class StageSlice:
    """Which pipeline stage of how many to load (0 of 1: the whole model)."""

    index: int = 0
    num_stages: int = 1


class ModelShard(Protocol):
    """Cuts a loaded model to one process's share of every layer (tensor parallelism:
    ``hybridkv.parallel.tensor_shards.TensorShard``)."""

    def apply(self, model: CausalLM) -> None:
        """Keep the share of ``model``'s weights (float or quantised), in place, and set
        ``model.config`` to the share's shapes (its heads, KV heads, widths): the planner
        lays out pages of those."""
        ...


@attrs.frozen(eq=False)
class LoadedCheckpoint:
    """A model ready for an executor: its layers, the layout for its pool, its text side."""

    model: CausalLM
    plan: LayoutPlan
    device: torch.device
    eos_token_ids: tuple[int, ...]
    tokenizer: Tokenizer | None


def plan_stages(
    layers: Sequence[ModelLayer], options: LoadOptions, num_stages: int
) -> tuple[Sequence[LayerSpec], LayoutPlan]:
    """The specs of the layers that keep something, as their groups keep them, and the
    pool ``options`` lays out for them, the model cut into ``num_stages`` pipeline stages
    (every stage plans the same)."""
    specs = cached_layers(layers)
    if options.uniform_layout:
        # Only what is kept changes: each layer still attends by its own policy, a
        # subset of every position.
        specs = [attrs.evolve(s, policy=FullAttention()) for s in specs]
    cuts = split_layers(len(layers), num_stages)
    stages = [cached_layers(layers[s.start : s.stop]) for s in cuts]
    plan = plan_layout(
        specs,
        options.kv_cache_bytes,
        options.block_size,
        stages=[[s.name for s in stage] for stage in stages],
    )
    return specs, plan


def load_checkpoint(
    path: str | Path,
    options: LoadOptions,
    stage: StageSlice,
    thread: TorchThread,
    shard: ModelShard | None = None,
) -> LoadedCheckpoint:
    """Load ``stage``'s layers of the checkpoint at ``path`` on ``thread`` (``shard``'s
    share of them), and plan the layout of ``options.kv_cache_bytes`` for every stage's
    layers.

    Raises:
        CheckpointError, ModelConfigError, PolicyError, WeightFormatError: see
            :meth:`ModelExecutor.from_pretrained`.
        ParallelConfigError: more stages than layers, or a stage index outside them.
    """
    if options.num_threads is not None:
        torch.set_num_threads(options.num_threads)
        thread.run(torch.set_num_threads, options.num_threads)
    dtype = options.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    checkpoint = options.open_checkpoint(path, dtype_bytes=itemsize)
    config = checkpoint.config
    stages = check_stage_cuts(
        config.layers, stage.num_stages, embeddings_read_by=config.embeddings_read_by
    )
    if not 0 <= stage.index < len(stages):
        raise ParallelConfigError(
            f"pipeline_stage={stage.index} is not one of {len(stages)} stages"
        )
    layers = stages[stage.index].layers
    target = torch.device(options.device)

    def load() -> CausalLM:
        names = checkpoint.weight_names()
        keep = functools.partial(holds_weight, config=config, layers=layers, names=names)
        tensors = checkpoint.load_weights(dtype, target, keep=keep)
        model = CausalLM.from_weights(config, checkpoint.family, tensors, target, layers=layers)
        # Quantised whole, then cut in the stored form: each share keeps the whole
        # layer's scales, so the ranks compute what one process computes.
        quantize_linears(model, options.weights, device=target)
        if shard is not None:
            shard.apply(model)
        model.fuse_projections()
        model.rescore_head()
        return model

    model = thread.run(load)
    _, plan = plan_stages(model.config.planned_layers, options, stage.num_stages)
    log.info(
        "model_loaded",
        model_type=config.model_type,
        num_layers=config.num_layers,
        layers=f"{layers.start}..{layers.stop - 1}",
        num_groups=len(plan.groups),
        num_blocks=plan.num_blocks,
        uniform_num_blocks=plan.uniform_num_blocks,
    )
    return LoadedCheckpoint(
        model=model,
        plan=plan,
        device=target,
        eos_token_ids=tuple(checkpoint.eos_token_ids),
        tokenizer=checkpoint.load_tokenizer(),
    )
