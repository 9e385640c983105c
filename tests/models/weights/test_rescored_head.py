"""The rescored LM head: a 4-bit pass over the vocabulary, its best candidates exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridkv.executor.load_options import LoadOptions
from hybridkv.models.weights.precision import decode_weight_bytes
from hybridkv.models.weights.quantized_linear import DEQUANT_ROWS, Int4Linear, Int8Linear
from hybridkv.models.weights.rescored_head import STORED_ROWS, RescoredHead


def _head(rows: int = 2048, cols: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def _rows(num: int, cols: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randn(num, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("exact", [True, False], ids=["tied-rows", "int8-rows"])
def test_best_candidates_are_exact(exact):
    """The k best candidates of the 4-bit pass carry the exact logits (from the tied
    rows, or from the int8 rows), so the greedy token is the exact head's."""
    weight = _head()
    int8 = Int8Linear(weight)
    head = RescoredHead(int8, weight if exact else None, num_rescored=64)
    x = _rows(4)
    logits = head(x)
    reference = x @ (weight if exact else int8.expand(0, 2048, torch.float32)).T
    ids = head.coarse(x).topk(64, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, ids), reference.gather(1, ids))
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_the_tail_keeps_the_four_bit_logits():
    """Outside the rescored candidates a row holds the 4-bit pass's values."""
    weight = _head()
    head = RescoredHead(Int8Linear(weight), weight, num_rescored=16)
    x = _rows(2)
    coarse = head.coarse.matmul_bf16(x.bfloat16()).float()
    logits = head(x)
    rescored = torch.zeros_like(logits, dtype=torch.bool)
    rescored.scatter_(1, coarse.topk(16, dim=-1).indices, True)
    assert torch.equal(logits[~rescored], coarse[~rescored])


def test_many_rows_take_the_int8_head():
    """From STORED_ROWS rows (a long prompt's logprobs) the int8 head computes them; below,
    a batch of 32 decodes (the int8 head's expanded path) is rescored."""
    weight = _head()
    int8 = Int8Linear(weight)
    head = RescoredHead(int8, weight)
    x = _rows(STORED_ROWS)
    assert torch.equal(head(x), int8(x))
    x = _rows(DEQUANT_ROWS)
    assert torch.equal(head(x).argmax(-1), (x @ weight.T).argmax(-1))


def test_small_vocabularies_rescore_every_token():
    """With fewer tokens than candidates every logit is exact."""
    weight = _head(rows=64)
    head = RescoredHead(Int8Linear(weight), weight)
    x = _rows(3)
    torch.testing.assert_close(head(x), x @ weight.T)


def test_mismatched_rows_and_biased_heads_are_refused():
    """Exact rows of another shape, or a head with a bias, are a ValueError naming it."""
    with pytest.raises(ValueError, match="do not match"):
        RescoredHead(Int8Linear(_head()), _head(rows=1024))
    with pytest.raises(ValueError, match="bias"):
        RescoredHead(Int8Linear(_head(), torch.zeros(2048)))
    with pytest.raises(ValueError, match="Int4Linear head needs exact rows"):
        RescoredHead(Int4Linear(_head()))
    assert not RescoredHead.fits(Int8Linear(_head(rows=2040)), has_exact_rows=True)
    assert not RescoredHead.fits(Int4Linear(_head()), has_exact_rows=False)
    assert RescoredHead.fits(Int4Linear(_head()), has_exact_rows=True)


def test_decode_bytes_count_the_four_bit_pass():
    """A decode step reads the 4-bit pass, not the int8 head beside it."""
    int8 = Int8Linear(_head())
    head = RescoredHead(int8)
    assert decode_weight_bytes(nn.Sequential(head)) == head.coarse.weight_bytes()
    assert head.coarse.weight_bytes() < 0.7 * int8.weight_bytes()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_tied_models_rescore_from_their_embedding(weights, tiny_models):
    """A tied model loaded with quantised weights gets a rescored head whose exact rows
    are the embedding's (no copy)."""
    from hybridkv.executor.model_executor import ModelExecutor

    executor = ModelExecutor.from_pretrained(
        tiny_models["gemma3"].path, LoadOptions(kv_cache_bytes=1 << 20, weights=weights)
    )
    try:
        head = executor.model.lm_head
        assert isinstance(head, RescoredHead)
        assert head.exact_rows is not None
        embedding = executor.model.model.embed_tokens.weight
        assert head.exact_rows.data_ptr() == embedding.data_ptr()
    finally:
        executor.close()


def test_untied_heads_rescore_from_int8_rows_only(tiny_models):
    """An untied int8 head rescores from its own rows; an untied int4 head has nothing
    finer to rescore from and stays as it is."""
    from hybridkv.executor.model_executor import ModelExecutor

    path = tiny_models["llama"].path
    for weights, kind in (("int8", RescoredHead), ("int4", Int4Linear)):
        executor = ModelExecutor.from_pretrained(
            path, LoadOptions(kv_cache_bytes=1 << 20, weights=weights)
        )
        try:
            head = executor.model.lm_head
            assert isinstance(head, kind)
            assert not isinstance(head, RescoredHead) or head.exact_rows is None
        finally:
            executor.close()
