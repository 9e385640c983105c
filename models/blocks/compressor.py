"""DeepSeek V4's compressor: the entries of a compressed attention layer, and the state of
the tokens that wait for theirs, in pages of the pool like any recurrent state.

Entry e of a layer of rate r is, per channel, the softmax-weighted sum of its tokens'
projections ``kv`` under their gates ``gate + position_bias[p % r]``. Under overlap
(CSA) each token projects two series: its first (A) feeds the entry after its own, its
second (B) its own, so entry e is made from the A of window e - 1 and the B of window e
(``2r`` slots); an HCA token has B alone. The state is the softmax half-way, per running
entry and channel a maximum ``m``, a sum ``s = sum exp(g - m)`` and a weighted sum
``a = sum exp(g - m) kv``: the entry of the tokens so far is ``a / s`` (``s`` 0: none
yet), and two halves merge exactly (the online softmax)::

    running   cur: the entry of the token's own window     nxt: the next one (overlap)
    token p   cur += B(p);  nxt += A(p);  p % r == r - 1:  emit a / s of cur; cur = nxt

So a prefix hit resumes from the state at any block boundary, with no token kept. The
attention's compressor and its indexer's (CSA) are the same arithmetic on other
channels: both run here side by side, ``[attention | indexer]``. The mixer emits the raw
entry ``a / s`` at the token that completes it (zeros at the others); the attention
normalises and rotates it (``compressed_attention.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.blocks.norms import config_rms_norm
from hybridkv.models.blocks.state_mixer import Inputs, PagedStateMixer, State
from hybridkv.models.config import ModelConfig

#: The state's three running values per channel: maximum, sum, weighted sum.
_MAX, _SUM, _ACC = 0, 1, 2


class EntryProjections(nn.Module):
    """One compressor's weights (DeepSeek V4's checkpoint names): ``wkv`` and ``wgate``
    give each token's series (two under overlap, A then B), ``ape`` ``[rate, series *
    width]`` is added to the gates by the token's place in its window, and ``norm``
    normalises a finished entry."""

    def __init__(self, config: ModelConfig, width: int, rate: int, series: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.wkv = nn.Linear(hidden, series * width, bias=False)
        self.wgate = nn.Linear(hidden, series * width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, series * width))
        self.norm = config_rms_norm(config, width)
        self.width, self.series = width, series

    def project(self, x: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, series, width]`` values and float32 gates of the tokens ``x``, ``slots``
        their places in their windows."""
        kv = self.wkv(x).float().unflatten(1, (self.series, self.width))
        gate = self.wgate(x).float() + self.ape.float()[slots]
        return kv, gate.unflatten(1, (self.series, self.width))


class Indexer(nn.Module):
    """CSA's lightning indexer: entries of its own (``compressor``, ``index_head_dim``
    wide: the attention's compressor's arithmetic on other channels), queries from the
    attention's low-rank query (``wq_b``, ``index_n_heads`` of them) and their weights
    (``weights_proj``)."""

    def __init__(self, config: ModelConfig, rate: int) -> None:
        super().__init__()
        shape = config.compressed
        assert shape is not None, "an indexer without DeepSeek V4's shape"
        heads, width = shape.index_heads, shape.index_head_dim
        self.compressor = EntryProjections(config, width, rate, 2)
        self.wq_b = nn.Linear(shape.q_lora_rank, heads * width, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, heads, bias=False)
        self.heads, self.width, self.top_k = heads, width, shape.index_topk


class Compressor(EntryProjections, PagedStateMixer):
    """The running entries of a compressed layer (its ``state_shapes``: per running entry
    the maximum, sum and weighted sum of every channel), updated token by token
    (:meth:`step`) or a chunk at a time (:meth:`scan`), in pool pages like a Mamba state.

    Its inputs (:meth:`inputs`) are each token's values, gates (``[T, series, width]``,
    the attention's channels and the indexer's side by side) and position; its output, a
    token's row ``[T, width]``, is the raw entry the token completes (zeros where it
    completes none).
    """

    def __init__(self, config: ModelConfig, kind: str) -> None:
        shape = config.compressed
        assert shape is not None, "a compressor without DeepSeek V4's shape"
        rate, overlap = shape.rates[kind], shape.overlap(kind)
        super().__init__(config, shape.head_dim, rate, 2 if overlap else 1)
        self.rate, self.overlap, self.entry_width = rate, overlap, shape.entry_width(kind)
        self.state_shapes = ((2 if overlap else 1, 3, self.entry_width),)

    def inputs(self, x: torch.Tensor, positions: torch.Tensor, indexer: Indexer | None) -> Inputs:
        """The mixer's inputs for the tokens ``x`` at ``positions`` (the indexer's
        channels beside the attention's, where it has one)."""
        slots = positions % self.rate
        kv, gate = self.project(x, slots)
        if indexer is not None:
            kv_i, gate_i = indexer.compressor.project(x, slots)
            kv, gate = torch.cat((kv, kv_i), dim=-1), torch.cat((gate, gate_i), dim=-1)
        return kv, gate, positions

    # -- the recurrence ---------------------------------------------------------------

    def step(self, xs: Inputs, state: State) -> tuple[torch.Tensor, State]:
        kv, gate, positions = xs
        (acc,) = state  # [B, running, 3, width]
        done = ((positions + 1) % self.rate == 0)[:, None]
        own = _merge(acc[:, 0], _single(gate[:, -1], kv[:, -1]))
        out = torch.where(done, _value(own), 0.0)
        if not self.overlap:
            return out, (torch.where(done[..., None], 0.0, own)[:, None],)
        after = _merge(acc[:, 1], _single(gate[:, 0], kv[:, 0]))
        cur = torch.where(done[..., None], after, own)
        nxt = torch.where(done[..., None], 0.0, after)
        return out, (torch.stack((cur, nxt), dim=1),)

    def scan(self, xs: Inputs, state: State, counts: list[int]) -> tuple[torch.Tensor, State]:
        kv, gate, positions = xs
        first, length, start = int(positions[0]), kv.shape[0], state[0][0]
        entries = self._fold(kv, gate, first, start)
        out = kv.new_zeros(length, self.entry_width)
        # Entry w0 + k completes at token (w0 + k + 1) * r - 1: those inside the chunk.
        r, windows = self.rate, self._windows(first, length)
        k = torch.arange(windows)
        last = (first // r + k + 1) * r - 1 - first
        out[last[last < length]] = _value(entries[k[last < length]])
        after = [
            self._state_at(
                entries if count == length else self._fold(kv[:count], gate[:count], first, start),
                first,
                count,
            )
            for count in counts
        ]
        return out, (torch.stack(after),)

    # -- a chunk at once --------------------------------------------------------------

    def _windows(self, first: int, length: int) -> int:
        """Windows the tokens ``[first, first + length)`` touch."""
        return (first + length - 1) // self.rate - first // self.rate + 1

    def _fold(
        self, kv: torch.Tensor, gate: torch.Tensor, first: int, state: torch.Tensor
    ) -> torch.Tensor:
        """The running values ``[entries, 3, width]`` of every entry the tokens feed (those
        of windows ``first // r`` on, and under overlap the one after), the state's
        merged into the first (and second)."""
        r, length = self.rate, kv.shape[0]
        windows = self._windows(first, length)
        lead = first - first // r * r
        grid_g = gate.new_full((windows * r, *gate.shape[1:]), float("-inf"))
        grid_v = kv.new_zeros((windows * r, *kv.shape[1:]))
        grid_g[lead : lead + length], grid_v[lead : lead + length] = gate, kv
        grid_g, grid_v = (
            grid_g.view(windows, r, *gate.shape[1:]),
            grid_v.view(windows, r, *kv.shape[1:]),
        )
        # Per entry its slots: the B of its window, and (overlap) the A of the one before.
        if self.overlap:
            slots_g, slots_v = _overlapped(grid_g, float("-inf")), _overlapped(grid_v, 0.0)
        else:
            slots_g, slots_v = grid_g[:, :, 0], grid_v[:, :, 0]
        top = slots_g.amax(dim=1)
        top = torch.where(torch.isfinite(top), top, 0.0)
        weights = torch.exp(slots_g - top[:, None])
        entries = torch.stack((top, weights.sum(1), (weights * slots_v).sum(1)), dim=1)
        entries[0] = _merge(entries[0], state[0])
        if self.overlap:
            entries[1] = _merge(entries[1], state[1])
        return entries

    def _state_at(self, entries: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """The state after ``count`` tokens from ``first``, from the running values of the
        entries folded from exactly those tokens."""
        r = self.rate
        index = (first + count) // r - first // r  # the entry of the next token's window
        empty = torch.zeros_like(entries[0])
        cur = entries[index] if index < entries.shape[0] else empty
        if not self.overlap:
            return (empty if (first + count) % r == 0 else cur)[None]
        nxt = entries[index + 1] if index + 1 < entries.shape[0] else empty
        return torch.stack((cur, nxt))


def _overlapped(grid: torch.Tensor, empty: float) -> torch.Tensor:
    """Per entry of windows ``[windows, r, 2, width]`` (A then B series) and the one
    after them, its ``2r`` slots ``[windows + 1, 2r, width]``: the A of the window before
    (``empty`` for the first) beside the B of its own (``empty`` for the last)."""
    pad = grid.new_full((1, *grid.shape[1:2], grid.shape[-1]), empty)
    before = torch.cat((pad, grid[:, :, 0]))
    own = torch.cat((grid[:, :, 1], pad))
    return torch.cat((before, own), dim=1)


def _single(gate: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """One token's running values ``[B, 3, width]``: its gate the maximum, sum 1."""
    return torch.stack((gate, torch.ones_like(gate), kv), dim=1)


def _merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two running values ``[..., 3, width]`` as one (an empty one, sum 0, leaves the
    other exactly as it was)."""
    neg = float("-inf")
    a_max = torch.where(a[..., _SUM, :] > 0, a[..., _MAX, :], neg)
    b_max = torch.where(b[..., _SUM, :] > 0, b[..., _MAX, :], neg)
    top = torch.maximum(a_max, b_max)
    top = torch.where(torch.isfinite(top), top, 0.0)
    fa, fb = torch.exp(a_max - top), torch.exp(b_max - top)
    total = a[..., _SUM, :] * fa + b[..., _SUM, :] * fb
    acc = a[..., _ACC, :] * fa + b[..., _ACC, :] * fb
    return torch.stack((top, total, acc), dim=-2)


def _value(running: torch.Tensor) -> torch.Tensor:
    """The entry ``a / s`` of running values ``[..., 3, width]`` (0 where empty)."""
    total = running[..., _SUM, :]
    return running[..., _ACC, :] / torch.where(total > 0, total, 1.0)
