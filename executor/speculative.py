"""One request's verification step: its proposals against the model's own samples.

A request with ``num_draft_tokens = k`` ran its last token and ``k`` proposed tokens, so
the model gave ``k + 1`` rows of logits; row ``i`` predicts the token after proposal
``i`` (after the request's own last token for ``i = 0``). Each row is processed as the
sampler would process it at that output position, as if the proposals before it were
already part of the request: penalties count them, ``min_tokens`` counts them, and a
seeded request seeds with the output index of that position::

    tokens     ... t | d0 d1 d2        k = 3, output_index o
    row i        0     1  2  3
    processed  as output o + i, with d0 .. d(i-1) appended to the request's tokens

A greedy request keeps the proposals while each is its row's argmax, then the argmax of
the next row (``verify_greedy``): exactly the tokens of decoding one at a time. A sampled
one keeps them by the rejection rule over the rows' distributions after temperature,
min-p, top-k and top-p (``verify_sampled``), so each token it emits is distributed as
without speculation. A request with structured output masks row ``i`` with its grammar
after proposals ``0 .. i-1`` (``GrammarMasks.logit_masks_ahead``), so no kept token is one
the grammar forbids, and its matcher steps back over the proposals afterwards.

A request's rows are processed on the device; a greedy one reads back its argmaxes, a
sampled one its ``k + 1`` distributions (the rejection rule runs on the host, with the
request's CPU generator): ``executor/host_copy.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from tokenizers import Tokenizer

from hybridkv.executor.draw import filter_logits
from hybridkv.executor.host_copy import to_host_list, to_host_tensor
from hybridkv.executor.sampler import Sampler, position_seed
from hybridkv.executor.verification import verify_greedy, verify_sampled
from hybridkv.memory.state_pages import StepStates
from hybridkv.scheduler.batch import StepBatch, StepRequest, StepResult


def position_requests(request: StepRequest) -> list[StepRequest]:
    """The request as the sampler sees it at each of its ``k + 1`` rows."""
    draft = request.draft_token_ids
    tokens = request.all_token_ids
    out = []
    for i in range(len(draft) + 1):
        seen = [*tokens, *draft[:i]] if tokens and i else tokens
        out.append(attrs.evolve(request, output_index=request.output_index + i, all_token_ids=seen))
    return out


def verify_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    request: StepRequest,
    tokenizer: Tokenizer | None = None,
) -> list[int]:
    """The tokens the request emits: the proposals kept, then one of the model's own.

    Args:
        sampler: The executor's sampler (its shared generator for unseeded requests).
        logits: ``[k + 1, vocab]``, the request's last rows.
        request: The request, with its ``num_draft_tokens`` proposals.
        tokenizer: As for :meth:`Sampler.sample`.
    """
    draft, params = request.draft_token_ids, request.params
    masks = None
    if params.structured_output is not None:
        masks = sampler.grammar_masks(request, tokenizer, logits.shape[-1])
    rows = sampler.processed_rows(
        logits, position_requests(request), tokenizer=tokenizer, masks=masks
    )
    if params.is_greedy:
        return verify_greedy(to_host_list(rows.argmax(-1)), draft)
    probs = torch.stack([filter_logits(row, params).softmax(-1) for row in rows])
    return verify_sampled(to_host_tensor(probs), draft, generator=_generator(sampler, request))


def _generator(sampler: Sampler, request: StepRequest) -> torch.Generator:
    seed = request.params.seed
    if seed is None:
        return sampler.shared_generator
    generator = torch.Generator(device="cpu")
    generator.manual_seed(position_seed(seed, request.output_index))
    return generator


def draft_rows(query_lens: Sequence[int], requests: Sequence[StepRequest]) -> list[list[int]]:
    """Per sampled request, the rows of the step's hidden states it samples from: its last
    one, or its last ``k + 1`` with ``k`` proposals."""
    out = []
    end = -1
    for num, request in zip(query_lens, requests, strict=True):
        end += num
        if request.sample:
            out.append(list(range(end - request.num_draft_tokens, end + 1)))
    return out


def kept_tokens(batch: StepBatch, result: StepResult) -> tuple[int, ...]:
    """Per request of a verification step, the tokens it kept: its own last token and the
    proposals accepted (0 for a request the step failed)."""
    accepted = result.num_accepted or (0,) * len(batch.requests)
    return tuple(
        0 if r.request_id in result.errors else r.num_tokens - r.num_draft_tokens + a
        for r, a in zip(batch.requests, accepted, strict=True)
    )


def write_kept_states(caches: Sequence[tuple[torch.Tensor, object]], kept: Sequence[int]) -> None:
    """After a verification step, write the state groups' states of the tokens each
    request kept (``StepStates.pending``; ``kept`` from :func:`kept_tokens`)."""
    seen: set[int] = set()
    with torch.inference_mode():
        for _, metadata in caches:
            if isinstance(metadata, StepStates) and id(metadata) not in seen:
                seen.add(id(metadata))
                metadata.write_verified(kept)


__all__ = ["draft_rows", "kept_tokens", "position_requests", "verify_rows", "write_kept_states"]
