"""DeepSeek V4's compressor state (``models/blocks/compressor.py``): a chunk folded at once
equals the tokens one by one, the state at any boundary resumes exactly, and the entries
are transformers' windows of softmax-weighted tokens."""

from __future__ import annotations

import pytest
import torch

from hybridkv.models.blocks.compressor import Compressor
from hybridkv.models.config import ModelConfig
from hybridkv.models.families import normalized, running_family
from hybridkv.models.shapes.compressed import CSA, HCA

#: A tiny DeepSeek V4 config as transformers writes it (the fields the parse reads).
_CONFIG = {
    "model_type": "deepseek_v4",
    "vocab_size": 64,
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "q_lora_rank": 8,
    "partial_rotary_factor": 0.25,
    "o_groups": 2,
    "o_lora_rank": 8,
    "sliding_window": 8,
    "layer_types": [CSA, HCA],
    "compress_rates": {CSA: 4, HCA: 8},
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 2,
}


def _config() -> ModelConfig:
    family = running_family("deepseek_v4")
    assert family.parse is not None
    return family.parse(dict(normalized(family, _CONFIG)))


def _inputs(compressor: Compressor, first: int, count: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    series = 2 if compressor.overlap else 1
    shape = (count, series, compressor.entry_width)
    kv = torch.randn(shape, generator=generator)
    gate = torch.randn(shape, generator=generator) * 3
    return kv, gate, torch.arange(first, first + count)


def _stepped(compressor: Compressor, xs: tuple[torch.Tensor, ...], state: torch.Tensor):
    outs, states = [], []
    for t in range(xs[0].shape[0]):
        out, (state,) = compressor.step(tuple(x[t : t + 1] for x in xs), (state,))
        outs.append(out)
        states.append(state)
    return torch.cat(outs), torch.cat(states)


@pytest.mark.parametrize("kind", [CSA, HCA])
@pytest.mark.parametrize(("first", "count"), [(0, 21), (3, 17), (8, 8), (5, 1)])
def test_a_chunk_folds_as_its_tokens_one_by_one(kind: str, first: int, count: int) -> None:
    """Entries and the state after every token of a chunk starting anywhere (mid-window
    too, from a state) match the recurrence token by token."""
    compressor = Compressor(_config(), kind)
    before = _inputs(compressor, 0, first, seed=1)
    state = torch.zeros(1, *compressor.state_shapes[0])
    if first:
        _, states = _stepped(compressor, before, state)
        state = states[-1:]
    xs = _inputs(compressor, first, count, seed=2)
    want_out, want_states = _stepped(compressor, xs, state)
    counts = list(range(1, count + 1))
    out, (states,) = compressor.scan(xs, (state,), counts)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_entries_are_transformers_softmax_windows(kind: str) -> None:
    """Entry e is the softmax over its window's gates of its tokens' values (CSA: the A
    series of the window before beside the B series of its own), as transformers sums it."""
    compressor = Compressor(_config(), kind)
    r = compressor.rate
    kv, gate, positions = _inputs(compressor, 0, 4 * r, seed=3)
    out, _ = compressor.scan(
        (kv, gate, positions), (torch.zeros(1, *compressor.state_shapes[0]),), [4 * r]
    )
    for e in range(4):
        window = slice(e * r, (e + 1) * r)
        g, v = gate[window, -1], kv[window, -1]
        if compressor.overlap and e:
            before = slice((e - 1) * r, e * r)
            g, v = torch.cat((gate[before, 0], g)), torch.cat((kv[before, 0], v))
        want = (torch.softmax(g, dim=0) * v).sum(0)
        torch.testing.assert_close(out[(e + 1) * r - 1], want, rtol=1e-5, atol=1e-5)
    others = [t for t in range(4 * r) if (t + 1) % r]
    assert not out[others].any()
