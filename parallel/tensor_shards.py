"""Tensor parallelism: which share of each layer a rank holds, cut from the loaded model.

Every rank of a tensor group loads its stage's layers as one process would, then keeps
its share (Megatron's split, as vLLM does it)::

    q_proj, k_proj, v_proj     output rows of its heads          (column split, no exchange)
    o_proj                     input columns of its heads        SummedOverRanks: all-reduce
    gate/up (input_linear)     output rows of its MLP width      (column split)
    down (output_linear)       input columns of its MLP width    SummedOverRanks: all-reduce
    experts                    each expert's MLP, split so       SummedOverRanks: all-reduce
    Mamba2 mixer               its heads and groups              (``tensor_mamba.py``)
    embed_tokens, lm_head      a run of the vocabulary           VocabParallel*: reduce, gather

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

from hybridkv.models.blocks.attention import PagedAttention
from hybridkv.models.blocks.mamba2 import Mamba2Mixer
from hybridkv.models.blocks.mlp import GatedMLP, SharedMLP
from hybridkv.models.blocks.moe import MixtureOfExperts
from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ParallelConfigError
from hybridkv.models.specs import tensor_rank_spec
from hybridkv.models.transformer import CausalLM
from hybridkv.models.weights.quantized_linear import INT4_GROUP, QuantizedLinear
from hybridkv.parallel.tensor_cuts import bias_of, columns_of, held_run, param, rows_of
from hybridkv.parallel.tensor_group import TensorRanks
from hybridkv.parallel.tensor_layers import (
    SummedOverRanks,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from hybridkv.parallel.tensor_mamba import shard_mamba


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
    values = [
        ("num_attention_heads", config.num_heads, False),
        ("num_key_value_heads", config.num_kv_heads, True),
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
class TensorShard:
    """Cuts a loaded model to one rank's share (``executor/loader.py`` calls it after
    quantising the whole model, before projections are joined)."""

    ranks: TensorRanks

    def shapes(self, config: ModelConfig) -> ModelConfig:
        """``config`` as one rank holds it: its heads, KV heads, widths and state."""
        size = self.ranks.size
        mamba = config.mamba
        # (attrs' converter on ``layers`` confuses mypy's evolve signature: a dict it is.)
        shares: dict[str, Any] = {
            "num_heads": config.num_heads // size,
            "intermediate_size": config.intermediate_size // size,
            "experts": None if config.experts is None else config.experts.tensor_share(size),
            "layers": tuple(tensor_rank_spec(s, size, mamba) for s in config.layers),
            "mamba": None if mamba is None else mamba.tensor_share(size),
        }
        return attrs.evolve(config, **shares)

    def apply(self, model: CausalLM) -> None:
        """Keep this rank's share of every layer, the embedding and the head, in place."""
        full = model.config
        check_tensor_split(full, self.ranks.size)
        rank, size = self.ranks.rank, self.ranks.size
        shared_experts = {  # cut with their mixture, whose sum they join
            f"{name}.shared_expert"
            for name, module in model.named_modules()
            if isinstance(module, MixtureOfExperts) and module.shared_expert is not None
        }
        for name, module in list(model.named_modules()):
            if isinstance(module, PagedAttention):
                self._attention(module)
            elif isinstance(module, GatedMLP) and name not in shared_experts:
                width = module.gate_proj.out_features // size
                mine = slice(rank * width, (rank + 1) * width)
                module.set_submodule("gate_proj", rows_of(module.gate_proj, mine))
                module.set_submodule("up_proj", rows_of(module.up_proj, mine))
                module.set_submodule("down_proj", self._summed(module.down_proj, mine))
            elif isinstance(module, SharedMLP):
                stacked = module.input_linear
                width = stacked.out_features // 2 // size
                held = torch.arange(rank * width, (rank + 1) * width)
                module.set_submodule(
                    "input_linear", rows_of(stacked, torch.cat((held, held + width * size)))
                )
                module.set_submodule("output_linear", self._summed(module.output_linear, held))
            elif isinstance(module, MixtureOfExperts):
                self._experts(module)
                model.set_submodule(name, SummedOverRanks(module, self.ranks))
            elif isinstance(module, Mamba2Mixer):
                shard_mamba(module, self.ranks)
        self._vocabulary(model, full.vocab_size)
        model.config = self.shapes(full)

    def _attention(self, attn: PagedAttention) -> None:
        rank, size, dim = self.ranks.rank, self.ranks.size, attn.head_dim
        num_heads = attn.num_heads // size
        first_kv, num_kv = held_run(attn.num_kv_heads, size, rank)
        q = slice(rank * num_heads * dim, (rank + 1) * num_heads * dim)
        kv = slice(first_kv * dim, (first_kv + num_kv) * dim)
        attn.set_submodule("q_proj", rows_of(attn.q_proj, q))
        attn.set_submodule("k_proj", rows_of(attn.k_proj, kv))
        attn.set_submodule("v_proj", rows_of(attn.v_proj, kv))
        attn.set_submodule("o_proj", self._summed(attn.o_proj, q))
        if attn.gate_proj is not None:  # one gate per query channel: the heads' rows
            attn.set_submodule("gate_proj", rows_of(attn.gate_proj, q))
        if attn.sinks is not None:
            attn.sinks = param(attn.sinks.detach()[rank * num_heads : (rank + 1) * num_heads])
        attn.num_heads, attn.num_kv_heads = num_heads, num_kv
        attn._qk_v_widths = ((num_heads + num_kv) * dim, num_kv * dim)

    def _experts(self, moe: MixtureOfExperts) -> None:
        """Every expert's gate and up rows (and biases), and down columns, of this rank's
        width."""
        stacked, out = moe.input_linear.weight.detach(), moe.output_linear.weight.detach()
        width = stacked.shape[1] // 2 // self.ranks.size
        mine = torch.arange(self.ranks.rank * width, (self.ranks.rank + 1) * width)
        rows = torch.cat((mine, mine + width * self.ranks.size))
        moe.input_linear.weight = param(stacked[:, rows])
        moe.output_linear.weight = param(out[:, :, mine])
        if moe.input_linear.bias is not None:
            moe.input_linear.bias = param(moe.input_linear.bias.detach()[:, rows])
        if moe.output_linear.bias is not None and self.ranks.rank:
            # Added once to the ranks' sum: by the first rank.
            moe.output_linear.bias = param(torch.zeros_like(moe.output_linear.bias))
        shared = moe.shared_expert
        if shared is not None:  # its share of the width, summed with the experts'
            assert isinstance(shared, GatedMLP)
            width = shared.gate_proj.out_features // self.ranks.size
            held = slice(self.ranks.rank * width, (self.ranks.rank + 1) * width)
            shared.set_submodule("gate_proj", rows_of(shared.gate_proj, held))
            shared.set_submodule("up_proj", rows_of(shared.up_proj, held))
            shared.set_submodule("down_proj", columns_of(shared.down_proj, held))

    def _summed(self, linear: nn.Module, columns: torch.Tensor | slice) -> SummedOverRanks:
        return SummedOverRanks(columns_of(linear, columns), self.ranks, bias_of(linear))

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
