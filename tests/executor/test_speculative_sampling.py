"""A verification step's tokens are distributed as the sampler's without speculation.

``verify_rows`` over the rows of a request with proposals: the first emitted token must
follow the first row's distribution after temperature and top-k, and the token after an
accepted proposal the next row's, processed as if the proposal were already output (a
frequency penalty counts it). Chi-square bounds over a 6-token vocabulary, the sampler
seeded, so a run is the same every time. Greedy rows keep exactly the argmax chain.
"""

from __future__ import annotations

import torch

from hybridkv.executor.draw import filter_logits
from hybridkv.executor.penalties import process_logits
from hybridkv.executor.sampler import Sampler
from hybridkv.executor.speculative import position_requests, verify_rows
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.params import SamplingParams

VOCAB = 6
DRAWS = 6_000
# Chi-square with 5 degrees of freedom: exceeded with probability 0.001.
CHI2_5_AT_0_001 = 20.52
LOGITS = torch.tensor(
    [
        [1.0, 0.5, 0.2, -0.3, 0.8, -1.0],
        [0.1, 1.2, -0.2, 0.7, 0.3, 0.0],
        [0.4, 0.4, 0.9, -0.5, 0.0, 0.6],
    ]
)
PROMPT = [1, 2, 3, 4]


def request(params: SamplingParams, draft: tuple[int, ...]) -> StepRequest:
    """A decode of the prompt's last token (the last of them an output) with ``draft``."""
    return StepRequest(
        request_id="r",
        token_ids=[PROMPT[-1], *draft],
        start_position=len(PROMPT) - 1,
        block_tables=[],
        sample=True,
        params=params,
        output_index=1,
        all_token_ids=PROMPT if params.needs_processing else (),
        num_draft_tokens=len(draft),
    )


def expected(row: torch.Tensor, entry: StepRequest) -> torch.Tensor:
    """The distribution the sampler draws ``entry``'s token from, computed here."""
    processed = process_logits(row, entry, ()) if entry.params.needs_processing else row
    return filter_logits(processed, entry.params).softmax(-1).to(torch.float64)


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expect = p[keep] * counts.sum()
    return float(((counts[keep] - expect) ** 2 / expect).sum())


def test_emitted_tokens_follow_the_rows_as_processed_at_their_position() -> None:
    params = SamplingParams(temperature=0.8, top_k=5, frequency_penalty=0.7, max_tokens=9)
    draft = (0, 3)
    entry = request(params, draft)
    sampler = Sampler(seed=11)
    first = torch.zeros(VOCAB, dtype=torch.float64)
    after_first = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(DRAWS):
        tokens = verify_rows(sampler, LOGITS, entry)
        assert 1 <= len(tokens) <= 3
        assert list(tokens[:-1]) == list(draft[: len(tokens) - 1])
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            after_first[tokens[1]] += 1
    rows = position_requests(entry)
    assert list(rows[1].all_token_ids) == [*PROMPT, 0] and rows[1].output_index == 2
    assert chi_square(first, expected(LOGITS[0], rows[0])) < CHI2_5_AT_0_001
    # After the first proposal was accepted, the penalty counts it.
    p1 = expected(LOGITS[1], rows[1])
    assert not torch.allclose(p1, expected(LOGITS[1], rows[0]))
    assert after_first.sum() > 1000 and chi_square(after_first, p1) < CHI2_5_AT_0_001


def test_a_seeded_request_repeats_its_verification() -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=9)
    entry = request(params, (4, 1))
    runs = {tuple(verify_rows(Sampler(seed=i), LOGITS, entry)) for i in range(5)}
    assert len(runs) == 1


def test_greedy_rows_keep_the_argmax_chain() -> None:
    entry = request(SamplingParams(temperature=0.0, max_tokens=9), (0, 1))
    assert verify_rows(Sampler(), LOGITS, entry) == [0, 1, 2]
    entry = request(SamplingParams(temperature=0.0, max_tokens=9), (0, 3))
    assert verify_rows(Sampler(), LOGITS, entry) == [0, 1]


def test_structured_output_keeps_only_what_the_grammar_allows_and_the_greedy_text() -> None:
    """Random logits that depend on the sequence (a model's), greedy, under a regex: the
    tokens emitted with proposals (some the grammar forbids) are those of decoding one at
    a time, and the matcher holds only outputs between steps."""
    import re

    from hybridkv.scheduler.params import StructuredOutput
    from hybridkv.testing import BYTE_EOS, byte_tokenizer

    tokenizer, vocab = byte_tokenizer(), BYTE_EOS + 1
    spec = StructuredOutput("regex", "[0-9]{3}-[a-z]{2,6}")
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_output=spec)

    def logits(seq: list[int]) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash(tuple(seq)) % (1 << 31))
        return torch.randn(vocab, generator=generator) * 4

    def entry(seq: list[int], num_prompt: int, draft: tuple[int, ...]) -> StepRequest:
        return StepRequest(
            request_id="s",
            token_ids=[seq[-1], *draft],
            start_position=len(seq) - 1,
            block_tables=[],
            sample=True,
            params=params,
            output_index=len(seq) - num_prompt,
            all_token_ids=seq,
            num_draft_tokens=len(draft),
        )

    prompt = [65, 66]
    plain_sampler, seq = Sampler(eos_token_ids=[BYTE_EOS]), list(prompt)
    while seq[-1] != BYTE_EOS and len(seq) - len(prompt) < 20:
        row = logits(seq).unsqueeze(0)
        seq.append(plain_sampler.sample(row, [entry(seq, 2, ())], tokenizer=tokenizer)[0])
    expected = seq[len(prompt) :]
    assert re.fullmatch(spec.spec, tokenizer.decode(expected[:-1]))

    sampler, seq, step = Sampler(eos_token_ids=[BYTE_EOS]), list(prompt), 0
    while seq[-1] != BYTE_EOS and len(seq) - len(prompt) < 20:
        done = len(seq) - len(prompt)
        # The right continuation with every third token wrong, often one the grammar forbids.
        draft = tuple(
            ord("x") if (step + j) % 3 == 2 else t for j, t in enumerate(expected[done : done + 3])
        )
        rows = torch.stack([logits([*seq, *draft[:i]]) for i in range(len(draft) + 1)])
        seq.extend(verify_rows(sampler, rows, entry(seq, 2, draft), tokenizer))
        step += 1
    assert seq[len(prompt) :] == expected
    assert step < len(expected)
