"""The modules of a tensor-parallel rank that talk to the others: one collective each.

A rank holds a slice of every weight (``tensor_shards.py`` cuts them). Projections whose
output rows are split (q/k/v, gate/up) need nothing: each rank computes its heads or
its share of the MLP's width. The modules here end each split::

    SummedOverRanks         x[:, mine] @ W[:, mine]^T      all_reduce(sum), then the bias
                            (a row-split linear, or the rank's share of each expert)
    VocabParallelEmbedding  rows of my vocabulary slice    all_reduce(sum); others give 0
    VocabParallelHead       x @ W[mine]^T                  all_gather, cut to the vocabulary

so a decoder block costs two all-reduces of ``[tokens, hidden]`` (after attention and
after the MLP), the embedding one, and the logits one gather. Every rank ends each with
the same tensor, so the residual stream is the same on every rank of a group.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridkv.parallel.tensor_group import TensorCounters, TensorRanks


@contextlib.contextmanager
def _timed(ranks: TensorRanks) -> Iterator[TensorCounters]:
    """The group's counters, with the time spent in the block added to them."""
    started = time.perf_counter()
    yield ranks.counters
    ranks.counters.collective_s += time.perf_counter() - started


def all_reduce(tensor: torch.Tensor, ranks: TensorRanks) -> None:
    """Sum ``tensor`` over the group in place, and count it."""
    with _timed(ranks) as counters:
        dist.all_reduce(tensor, group=ranks.group)
    counters.reduced_bytes += tensor.nbytes
    counters.num_reduces += 1


def all_gather(tensor: torch.Tensor, ranks: TensorRanks) -> torch.Tensor:
    """Every rank's ``tensor``, joined along the last dimension in rank order, and count
    this rank's part."""
    parts = [torch.empty_like(tensor) for _ in range(ranks.size)]
    with _timed(ranks) as counters:
        dist.all_gather(parts, tensor, group=ranks.group)
    counters.gathered_bytes += tensor.nbytes
    return torch.cat(parts, dim=-1)


class SummedOverRanks(nn.Module):
    """A module whose output on each rank is a partial sum (a linear layer over the input
    columns the rank holds, the rank's share of every expert): summed over the group,
    then the bias added once.

    Args:
        inner: The rank's share, without a bias (a plain ``nn.Linear`` is quantised in
            place like any other).
        ranks: The tensor-parallel group.
        bias: The whole bias, or None.
    """

    def __init__(
        self, inner: nn.Module, ranks: TensorRanks, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.inner = inner
        self.ranks = ranks
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        all_reduce(out, self.ranks)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over the ranks in equal runs.

    Args:
        weight: This rank's rows, ``[rows, hidden]`` (the last rank's run may be short).
        start: The first token id they embed.
        ranks: The tensor-parallel group.
    """

    def __init__(self, weight: torch.Tensor, start: int, ranks: TensorRanks) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.start = start
        self.ranks = ranks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * held.unsqueeze(-1).to(out.dtype)
        all_reduce(out, self.ranks)
        return out


class VocabParallelHead(nn.Module):
    """An LM head whose vocabulary is split: each rank scores its run of tokens, and
    every rank gathers the whole row (the sampler, logprobs and grammars read it).

    Args:
        vocab_share: This rank's rows of the head (a float or quantised linear; the
            model may later give it a rescoring 4-bit pass, ``CausalLM.rescore_head``).
        chunk: Rows every rank's run is padded to (a gather takes equal parts; only the
            last run is short).
        vocab_size: Tokens in all; the padding past it is cut off.
        ranks: The tensor-parallel group.
    """

    def __init__(
        self, vocab_share: nn.Module, chunk: int, vocab_size: int, ranks: TensorRanks
    ) -> None:
        super().__init__()
        self.vocab_share = vocab_share
        self.chunk = chunk
        self.vocab_size = vocab_size
        self.ranks = ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.vocab_share(x)
        if scores.shape[-1] < self.chunk:
            scores = F.pad(scores, (0, self.chunk - scores.shape[-1]))
        return all_gather(scores, self.ranks)[..., : self.vocab_size]


__all__ = [
    "SummedOverRanks",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "all_gather",
    "all_reduce",
]
