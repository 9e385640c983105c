"""Tensor parallelism: which share of each layer a rank holds, cut from the loaded model.

Every rank of a tensor group loads its stage's layers as one process would, then keeps
its share (Megatron's split, as vLLM does it)::

    q_proj, k_proj, v_proj     output rows of its heads          (column split, no exchange)
    o_proj                     input columns of its heads        SummedOverRanks: all-reduce
    gate/up (input_linear)     output rows of its MLP width      (column split)
    down (output_linear)       input columns of its MLP width    SummedOverRanks: all-reduce
    experts                    each expert's MLP, split so       all-reduce of their sum
    Mamba2 mixer               its heads and groups              SummedOverRanks: all-reduce
    Mamba1 mixer               its channels; x_proj's columns    all-reduce (x_proj, out_proj)
    lightning attention        its heads                         all-reduce (norm, out_proj)
    embed_tokens, lm_head      a run of the vocabulary           VocabParallel*: reduce, gather

Each block cuts itself (``shard``, with what ``RankCut`` gives it); this module checks the
split, calls them, and cuts the vocabulary.

Query heads split evenly; KV heads too where there are at least as many as ranks, and are
otherwise replicated, each rank keeping the one its query heads read (``tp // kv`` ranks
share one). So every rank holds the same number of KV heads per layer and the same state
size: its pages are the same size on every rank, the planner lays out the same pool on
each, and the engine's block tables hold on all of them. ``shapes`` is that rank's
config, which the planner reads; the sampler still sees the whole vocabulary (the head
gathers it). The router of a mixture of experts runs whole on every rank (it is small),
so every rank routes each token to the same experts.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ParallelConfigError
from hybridkv.models.specs import tensor_rank_spec
from hybridkv.models.transformer import CausalLM
from hybridkv.models.weights.cuts import Shardable, rows_of
from hybridkv.models.weights.quantized_linear import INT4_GROUP, QuantizedLinear
from hybridkv.parallel.tensor_group import TensorRanks
from hybridkv.parallel.tensor_layers import (
    SummedOverRanks,
    VocabParallelEmbedding,
    VocabParallelHead,
    all_reduce,
)


def check_tensor_split(config: ModelConfig, size: int, weights: str = "dtype") -> None:
    """Refuse a model ``size`` ranks cannot share evenly, naming the values.

    Raises:
        ParallelConfigError: query heads, the MLP or expert width, Mamba2 heads or width
            that ``size`` does not divide, or KV heads or B/C groups that neither divide
            ``size`` nor are divided by it; with ``weights`` int4, a row-split layer's
            inputs cut inside a group of 32 (each group has one scale, as vLLM refuses
            a quantised input width not aligned to its groups).
    """
    if size == 1:
        return
    if config.qk_norm and config.qk_norm_width == "projection":
        raise ParallelConfigError(
            f"tensor_parallel_size={size}: {config.model_type}'s attention layers normalise "
            "q and k over every head together (qk_norm over the whole projection), which "
            "ranks holding a share of the heads cannot compute apart"
        )
    if weights == "int4":
        _check_int4_groups(config, size)
    kv_heads = sorted({s.num_kv_heads for s in config.attention_layers})
    values = [
        ("num_attention_heads", config.num_heads, False),
        *[("num_key_value_heads", heads, True) for heads in kv_heads],
        ("intermediate_size", config.intermediate_size, False),
    ]
    if config.experts is not None:
        values.append(("expert intermediate_size", config.experts.inner, False))
        if config.experts.shared_inner:
            values.append(("shared expert intermediate_size", config.experts.shared_inner, False))
    if config.mamba is not None:
        values += [
            ("mamba_n_heads", config.mamba.num_heads, False),
            ("mamba_n_groups", config.mamba.num_groups, True),
        ]
    if config.short_conv is not None:
        values.append(("hidden_size (short convolutions)", config.short_conv.channels, False))
    if config.mamba1 is not None:
        values.append(
            ("mamba_expand x hidden_size (Mamba1 channels)", config.mamba1.channels, False)
        )
    if config.compressed is not None:  # DeepSeek V4: whole groups of heads a rank
        values.append(("o_groups", config.compressed.o_groups, False))
    if config.deltanet is not None:
        values += [
            ("linear_num_key_heads", config.deltanet.num_key_heads, False),
            ("linear_num_value_heads", config.deltanet.num_value_heads, False),
        ]
    named = [
        f"{name}={value}"
        for name, value, may_replicate in values
        if value % size and not (may_replicate and size % value == 0)
    ]
    if named:
        raise ParallelConfigError(
            f"tensor_parallel_size={size} does not divide {', '.join(named)} of {config.model_type}"
        )


def _check_int4_groups(config: ModelConfig, size: int) -> None:
    widths = [
        ("attention heads x head_dim", config.num_heads * config.head_dim),
        ("intermediate_size", config.intermediate_size),
    ]
    if config.mamba is not None:
        widths.append(("mamba intermediate size", config.mamba.intermediate_size))
    if config.mamba1 is not None:
        widths.append(("Mamba1 channels", config.mamba1.channels))
    cut = [
        f"{name}={width} into {width // size}"
        for name, width in widths
        if width % INT4_GROUP == 0 and (width // size) % INT4_GROUP
    ]
    if cut:
        raise ParallelConfigError(
            f"--weights int4 groups {INT4_GROUP} inputs under one scale; "
            f"tensor_parallel_size={size} cuts {', '.join(cut)} inputs per rank: use int8, "
            "or fewer ranks"
        )


@attrs.frozen
class RankCut:
    """A rank of a tensor group as the blocks cut themselves for it (``TensorCut``)."""

    ranks: TensorRanks

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self.ranks.rank

    @property
    def size(self) -> int:
        """tp."""
        return self.ranks.size

    def summed(self, part: nn.Module, bias: torch.Tensor | None) -> nn.Module:
        """``part``'s output summed over the group, then ``bias`` added."""
        return SummedOverRanks(part, self.ranks, bias)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group in place (counted)."""
        all_reduce(tensor, self.ranks)


@attrs.frozen
class TensorShard:
    """Cuts a loaded model to one rank's share (``executor/loader.py`` calls it after
    quantising the whole model, before projections are joined)."""

    ranks: TensorRanks

    def shapes(self, config: ModelConfig) -> ModelConfig:
        """``config`` as one rank holds it: its heads, KV heads, widths and state."""
        size = self.ranks.size
        mamba, deltanet, conv = config.mamba, config.deltanet, config.short_conv
        mamba1, lightning = config.mamba1, config.lightning
        state = mamba or deltanet or conv or mamba1 or lightning
        # (attrs' converter on ``layers`` confuses mypy's evolve signature: a dict it is.)
        shares: dict[str, Any] = {
            "num_heads": config.num_heads // size,
            "intermediate_size": config.intermediate_size // size,
            "experts": None if config.experts is None else config.experts.tensor_share(size),
            "layers": tuple(tensor_rank_spec(s, size, state) for s in config.layers),
            "mamba": None if mamba is None else mamba.tensor_share(size),
            "deltanet": None if deltanet is None else deltanet.tensor_share(size),
            "short_conv": None if conv is None else conv.tensor_share(size),
            "mamba1": None if mamba1 is None else mamba1.tensor_share(size),
            "lightning": None if lightning is None else lightning.tensor_share(size),
        }
        return attrs.evolve(config, **shares)

    def apply(self, model: CausalLM) -> None:
        """Keep this rank's share of every layer, the embedding and the head, in place:
        each block cuts itself (``shard``: ``models/weights/cuts.py``), blocks inside a
        block with its own ``shard`` (a mixture's shared expert) cut by it."""
        full = model.config
        check_tensor_split(full, self.ranks.size)
        cut = RankCut(self.ranks)
        cut_blocks: list[str] = []
        for name, module in list(model.named_modules()):
            if isinstance(module, Shardable) and not name.startswith(tuple(cut_blocks)):
                module.shard(cut)
                cut_blocks.append(f"{name}.")
        self._vocabulary(model, full.vocab_size)
        model.config = self.shapes(full)

    def _vocabulary(self, model: CausalLM, vocab_size: int) -> None:
        """The embedding's and the head's run of the vocabulary: equal runs of
        ``ceil(vocab / tp)`` token ids, the head's last one zero-padded to that."""
        chunk = -(-vocab_size // self.ranks.size)
        start = min(vocab_size, self.ranks.rank * chunk)
        stop = min(vocab_size, start + chunk)
        backbone = model.model
        if backbone.embed_tokens is not None:
            weight = backbone.embed_tokens.weight.detach()
            cut = VocabParallelEmbedding(weight[start:stop], start, self.ranks)
            backbone.set_submodule("embed_tokens", cut)
        if isinstance(model.lm_head, (nn.Linear, QuantizedLinear)):
            share = rows_of(model.lm_head, slice(start, stop))
            model.lm_head = VocabParallelHead(share, chunk, vocab_size, self.ranks)


__all__ = ["TensorShard", "check_tensor_split"]
