"""The n-gram proposer (prompt lookup) and vLLM's ``--speculative-config`` keys."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.scheduler.speculation import (
    NgramProposer,
    SpeculativeConfig,
    SpeculativeConfigError,
)


def test_the_tokens_after_the_latest_earlier_occurrence_are_proposed() -> None:
    proposer = NgramProposer(min_n=1, max_n=2)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]
    # The tail (5, 6) occurred at 0 and 4; the latest, 4, was followed by 9, 1, 5.
    assert proposer.propose(tokens, 3) == (9, 1, 5)


def test_the_longest_suffix_wins_over_a_later_shorter_one() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [1, 2, 3, 40, 41, 9, 3, 50, 1, 2, 3]
    # (1, 2, 3) occurred at 0 (then 40, 41); (3,) alone occurred later, at 6 (then 50).
    assert proposer.propose(tokens, 2) == (40, 41)


def test_no_match_no_proposal_and_a_proposal_ends_with_the_context() -> None:
    assert NgramProposer(min_n=2, max_n=3).propose([1, 2, 3, 4], 4) == ()
    assert NgramProposer().propose([], 4) == () and NgramProposer().propose([7], 4) == ()
    # (7,) occurred at 1, followed by only 8 and 7 before the context ends.
    assert NgramProposer(min_n=1, max_n=1).propose([0, 7, 8, 7], 4) == (8, 7)


def test_only_the_window_is_searched() -> None:
    tokens = [1, 2, 3, *range(10, 20), 1, 2]
    assert NgramProposer(1, 2).propose(tokens, 1) == (3,)
    assert NgramProposer(1, 2, window=10).propose(tokens, 1) == ()


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 5), st.integers(1, 4))
def test_a_proposal_continues_an_earlier_occurrence_of_the_tail(
    tokens: list[int], k: int, max_n: int
) -> None:
    proposal = NgramProposer(min_n=1, max_n=max_n).propose(tokens, k)
    assert len(proposal) <= k
    if not proposal:
        assert len(tokens) < 2 or tokens[-1] not in tokens[:-1]
        return
    # Some earlier window equal to a tail of length >= 1 is followed by the proposal.
    n_ok = any(
        tokens[end - n : end] == tokens[len(tokens) - n :]
        and tuple(tokens[end : end + len(proposal)]) == proposal
        for n in range(1, max_n + 1)
        for end in range(n, len(tokens))
    )
    assert n_ok


def test_vllm_keys_parse_and_method_is_inferred() -> None:
    config = SpeculativeConfig.from_mapping({"num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert config.method == "ngram" and (config.prompt_lookup_min, config.prompt_lookup_max) == (
        3,
        3,
    )
    assert NgramProposer.for_config(config) == NgramProposer(3, 3)
    draft = SpeculativeConfig.from_mapping({"model": "/ckpt/small", "num_speculative_tokens": 2})
    assert draft.method == "draft_model" and draft.model == "/ckpt/small"


@pytest.mark.parametrize("method", ["mtp", "qwen3_next_mtp", "deepseek_mtp", "mimo_mtp"])
def test_mtp_and_vllms_spellings_for_one_family_name_one_method(method: str) -> None:
    config = SpeculativeConfig.from_mapping({"method": method, "num_speculative_tokens": 2})
    assert (config.method, config.model, config.num_speculative_tokens) == ("mtp", None, 2)


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "> prompt"),
        ({"num_speculative_tokens": 2, "drop_eagle_block": True}, "drop_eagle_block"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model names"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model names"),
        ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "model names"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ],
)
def test_a_bad_config_names_its_key(fields: dict[str, object], names: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=names):
        SpeculativeConfig.from_mapping(fields)
