"""Speculative method ``mtp``, the executor's side: after each step the model's own MTP
layer (``models/shapes/mtp.py``) writes its cache for the tokens the step kept, and
proposes the tokens after each request's last.

MTP position ``q`` reads the target's hidden state at ``q`` and the token at ``q + 1``,
so it runs once that token is known: after sampling, over the positions the step kept,
each with the token after it (the next prompt token, a kept proposal, the emitted one)::

    step runs        t  d0 d1 d2            a verification that kept d0, then emitted x
    kept rows        t  d0                  the rejected rows' positions run again later
    MTP reads        (h_t, d0) (h_d0, x)    -> writes its keys there, names y0 after x
    then k - 1 times (g, y_j) at the next position, g its own output -> y1, y2, ...

Its keys at a position are a function of the request's tokens up to the one after it, so
the MTP group's blocks are cached, reused, freed and offloaded as any group's (a block's
last key read the token after the block, which the request that filled it chose: a later
request reusing the block that goes on otherwise proposes from that one key as the first
request saw it; what it emits is verified all the same). The ``k - 1`` further proposals
attend keys that are not the request's yet: they run over a copy of its pages with room
after them, so nothing a proposal computes reaches the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.executor.kv_caches import sparse_groups
from hybridkv.executor.speculative import kept_tokens
from hybridkv.kernels import GatherWorkspace, PagedMetadata
from hybridkv.memory.layout import LayoutPlan
from hybridkv.models.transformer import CacheEntry, CausalLM
from hybridkv.scheduler.batch import StepBatch, StepRequest, StepResult


class MtpProposer:
    """Runs a model's first MTP layer after each step; proposes ``num_proposals`` tokens
    per sampled request.

    Args:
        model: The model, its MTP layer loaded (``model.mtp``).
        plan: The KV layout.
        caches: Per memory of the MTP layer, its cache and KV group.
        num_proposals: Tokens proposed after each request's last (``k``).
        workspace: The executor's gather buffers.
    """

    def __init__(
        self,
        model: CausalLM,
        plan: LayoutPlan,
        caches: Sequence[tuple[torch.Tensor, int]],
        num_proposals: int,
        workspace: GatherWorkspace,
    ) -> None:
        self.model = model
        self.plan = plan
        self.caches = list(caches)
        self.num_proposals = num_proposals
        self._workspace = workspace

    def run(
        self, batch: StepBatch, hidden: torch.Tensor, result: StepResult
    ) -> tuple[tuple[int, ...], ...]:
        """Write the MTP cache for the tokens ``batch`` kept; per request, the tokens
        proposed after its last (empty where it sampled nothing)."""
        requests = batch.requests
        rows, next_ids, ran, kept = _kept_rows(batch, result)
        if not ran:
            return ((),) * len(requests)
        model, device = self.model, hidden.device
        starts = [requests[i].start_position for i in ran]
        ids = torch.tensor(next_ids, dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, kept, strict=True)])
        tables = [[requests[i].block_tables[g] for i in ran] for _, g in self.caches]
        metas = self._metadata(kept, [s + n for s, n in zip(starts, kept, strict=True)], tables)
        out = model.run_mtp(
            0, model.mtp_hidden(hidden[rows]), ids, positions.to(device), self._entries(metas)
        )
        # The requests that sampled propose, from their last kept row.
        proposing = [
            n for n, i in enumerate(ran) if requests[i].sample and result.token_ids[i] is not None
        ]
        if not proposing:
            return ((),) * len(requests)
        ends = torch.tensor(kept).cumsum(0) - 1
        last = out[ends[proposing]]
        tokens = [model.mtp_tokens(last)]
        if self.num_proposals > 1:
            lasts = [starts[n] + kept[n] - 1 for n in proposing]
            owners = [requests[ran[n]] for n in proposing]
            tokens += self._further(owners, lasts, last, tokens[0])
        proposed = torch.stack(tokens, dim=1).tolist()
        out_rows: list[tuple[int, ...]] = [()] * len(requests)
        for n, row in zip(proposing, proposed, strict=True):
            out_rows[ran[n]] = tuple(row)
        return tuple(out_rows)

    def _further(
        self,
        requests: Sequence[StepRequest],
        lasts: Sequence[int],
        hidden: torch.Tensor,
        token: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Proposals 2 .. k: the MTP layer on its own output and the token it named, one
        position further each time, over a copy of the requests' pages (``lasts``: each
        request's last kept position)."""
        bs, k, model = self.plan.block_size, self.num_proposals, self.model
        copies, tables = [], []
        for cache, group in self.caches:
            pages = [
                list(r.block_tables[group][: p // bs + 1])
                for r, p in zip(requests, lasts, strict=True)
            ]
            copy, table = _scratch_copy(cache, pages, [(p + k - 1) // bs + 1 for p in lasts])
            copies.append(copy)
            tables.append(table)
        device = hidden.device
        out = []
        for step in range(1, k):
            context = [p + step + 1 for p in lasts]
            metas = self._metadata([1] * len(lasts), context, tables)
            entries = [(copy, meta) for copy, meta in zip(copies, metas, strict=True)]
            positions = torch.tensor([p + step for p in lasts], device=device)
            hidden = model.run_mtp(0, hidden, token, positions, entries)
            token = model.mtp_tokens(hidden)
            out.append(token)
        return out

    def _metadata(
        self,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        tables: Sequence[Sequence[Sequence[int]]],
    ) -> list[PagedMetadata]:
        """Per MTP memory, the metadata of a pass over ``query_lens`` tokens per request
        ending at ``context_lens``, reading ``tables[m]`` (per request, its pages)."""
        return PagedMetadata.build_groups(
            query_lens,
            context_lens,
            tables,
            self.plan.block_size,
            device=self.caches[0][0].device,
            workspace=self._workspace,
            sparse=sparse_groups(self.plan, [g for _, g in self.caches]),
        )

    def _entries(self, metas: Sequence[PagedMetadata]) -> list[CacheEntry]:
        return [(cache, meta) for (cache, _), meta in zip(self.caches, metas, strict=True)]


def _kept_rows(
    batch: StepBatch, result: StepResult
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The rows of the step's hidden states the MTP layer reads: each position a request
    kept (``kept_tokens``), with the token after it. Returns the rows, those tokens, the
    requests they belong to (indices) and how many each.

    A prompt chunk's last position reads the next chunk's first token
    (``next_token_id``); from an engine that sends none, that position's key stays
    unwritten, and later proposals read whatever the page held: proposals, which the
    model verifies, never an emitted token.
    """
    rows: list[int] = []
    next_ids: list[int] = []
    ran: list[int] = []
    kept: list[int] = []
    first = 0
    kept_by_request = kept_tokens(batch, result)  # none for a request the step failed
    for i, (request, num) in enumerate(zip(batch.requests, kept_by_request, strict=True)):
        after = _next_token(request, result, i)
        successors = [*request.token_ids[1:num], *([] if after is None else [after])]
        if num and successors:
            rows.extend(range(first, first + len(successors)))
            next_ids.extend(successors)
            ran.append(i)
            kept.append(len(successors))
        first += request.num_tokens
    return rows, next_ids, ran, kept


def _next_token(request: StepRequest, result: StepResult, index: int) -> int | None:
    """The token after the request's last kept position: the one it emitted, or after a
    prompt chunk the prompt's next (``next_token_id``)."""
    return result.token_ids[index] if request.sample else request.next_token_id


def _scratch_copy(
    cache: torch.Tensor, pages: Sequence[Sequence[int]], needed: Sequence[int]
) -> tuple[torch.Tensor, list[list[int]]]:
    """A copy of each request's ``pages`` of ``cache`` followed by zeroed pages, up to
    ``needed`` pages a request; returns it and the requests' tables into it. Page 0 of the
    copy stands for the null block (a released page reads as it)."""
    index = [0]
    tables = []
    for own, count in zip(pages, needed, strict=True):
        table = []
        for page in own:
            table.append(len(index) if page else 0)
            if page:
                index.append(page)
        table.extend(range(len(index), len(index) + count - len(own)))
        index.extend([0] * (count - len(own)))
        tables.append(table)
    # Pages after a request's own are written before any proposal reads them.
    pages_index = torch.tensor(index, device=cache.device)
    if cache.stride(1) == 0:  # one vector a token, the values viewing the keys: so too
        keys = cache.narrow(1, 0, 1).index_select(0, pages_index)
        return keys.expand(len(index), *cache.shape[1:]), tables
    return cache.index_select(0, pages_index), tables


__all__ = ["MtpProposer"]
