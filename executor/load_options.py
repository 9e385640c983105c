"""How a checkpoint is loaded and its KV pool laid out: one value every loader takes.

``ModelExecutor.from_pretrained``, ``PipelineExecutor.from_pretrained`` and each pipeline
worker read the same :class:`LoadOptions` (a worker gets it pickled), so a setting is named
and checked once::

    options = LoadOptions(kv_cache_bytes=1 << 30, dtype=torch.bfloat16,
                          policies={"full_attention": SinkWindow(4, 64)})
    executor = ModelExecutor.from_pretrained(path, options)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import torch

from hybridkv.models.checkpoint import Checkpoint
from hybridkv.models.weights.precision import check_weight_format
from hybridkv.policies import MemoryPolicy


def _policy_pairs(
    value: Mapping[str, MemoryPolicy] | tuple[tuple[str, MemoryPolicy], ...] | None,
) -> tuple[tuple[str, MemoryPolicy], ...]:
    if value is None:
        return ()
    return tuple(value.items()) if isinstance(value, Mapping) else tuple(value)


@attrs.frozen(kw_only=True)
class LoadOptions:
    """The settings of one model load.

    Attributes:
        kv_cache_bytes: Bytes of KV cache to allocate (per pipeline stage).
        block_size: Tokens per page.
        dtype: Weights, activations and KV cache dtype.
        device: Where the model and caches live (``cpu``, ``cuda``, ``cuda:1``).
        num_threads: Torch intra-op threads (process-wide); None leaves torch's choice
            (a pipeline divides the cores among its ranks).
        seed: Seed of the sampler's generator for unseeded requests.
        uniform_layout: Give every layer full-attention memory (sliding layers keep every
            token's K/V), the baseline allocator; attention math is unchanged.
        policies: Per layer kind of config.json (``full_attention``, ``sliding_attention``,
            ...), the memory policy its layers keep and attend instead of the config's; a
            mapping or (kind, policy) pairs.
        weights: Storage of the linear layers and LM head: ``dtype`` (exact), ``int8`` or
            ``int4`` weight-only (``models/weights/precision.py``).
        text_only: Serve a multimodal checkpoint's text model (``models/multimodal.py``);
            without it such a checkpoint is refused.
        mtp_proposals: Load the checkpoint's multi-token prediction layers, their memory
            in the pool, and propose this many tokens after each step with them
            (speculative method ``mtp``: ``executor/mtp_step.py``); 0: none.
    """

    kv_cache_bytes: int = attrs.field(validator=attrs.validators.ge(0))
    block_size: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    dtype: torch.dtype = torch.float32
    device: str = attrs.field(default="cpu", converter=str)
    num_threads: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    seed: int | None = None
    uniform_layout: bool = False
    policies: tuple[tuple[str, MemoryPolicy], ...] = attrs.field(
        default=(), converter=_policy_pairs
    )
    weights: str = attrs.field(default="dtype")
    text_only: bool = False
    mtp_proposals: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    @weights.validator
    def _check_weights(self, _: attrs.Attribute[str], value: str) -> None:
        check_weight_format(value)  # WeightFormatError names the known formats

    @property
    def policy_choices(self) -> dict[str, MemoryPolicy]:
        """``policies`` as the mapping ``Checkpoint.open`` takes."""
        return dict(self.policies)

    def open_checkpoint(self, path: str | Path, *, dtype_bytes: int = 2) -> Checkpoint:
        """``Checkpoint.open`` of ``path`` with these options' policies and text choice."""
        return Checkpoint.open(
            path,
            dtype_bytes=dtype_bytes,
            policies=self.policy_choices,
            text_only=self.text_only,
            mtp=self.mtp_proposals > 0,
        )
