"""Attention of one step on one context-parallel rank: the ring for prefills, the
all-gather for decodes, both merged exactly by log-sum-exp.

Attention is the only operation that mixes tokens, so each rank runs every other layer
on its own tokens (``context_shards``: a prefill's chunks i and 2cp-1-i, every decode
token) and only attention communicates, on the ranks' context group::

    decodes (every rank has the query)           prefills (2 x cp chunks, pass-KV)
    write the new K/V if this rank stores it     shard = my chunks' K/V + my cached K/V
    attend all query heads to the local keys     cp - 1 times: send shard to rank+1 and
    all-gather (out, lse), merge                   receive rank-1's, while attending my
                                                   queries to the shard in hand; store
                                                   the tokens of it I own; merge all
                                                   (``context_ring``)

Keys are masked by each token's request and global position, so a rank's queries read
exactly the keys they would in one process, sliding windows and soft-capping included. A
prefill over a cached prefix (a prefix hit, a later chunk) reads the cached keys either by
sending them with the shard (pass-KV) or by passing the queries instead (pass-Q), whichever
sends fewer bytes (``context_ring``). Every rank knows every shard's length from the
batch, so nothing but K/V, queries and partial outputs travel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist

from hybridkv.kernels.lse_merge import merge_partials
from hybridkv.kernels.partial_attention import partial_attention
from hybridkv.parallel.context_group import ContextRanks, LayerCall, StoredKeys
from hybridkv.parallel.context_ring import ring_attention
from hybridkv.parallel.context_shards import KVInterleave, rank_positions

_T = TypeVar("_T")


class ContextStep:
    """One step's tokens on this rank and what its attention layers exchange.

    Args:
        query_lens: New tokens per request (1: a decode, every rank runs it).
        context_lens: Tokens per request after the step.
        tables: Per KV group, per request, its virtual block table.
        place: The round-robin KV placement.
        ranks: This rank's context group.
        device: Where the tensors live.
        pass_q: Whether prefills over cached keys pass queries (``context_ring``); None
            chooses per layer by the bytes each would send.
    """

    def __init__(
        self,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        tables: Mapping[int, Sequence[Sequence[int]]],
        place: KVInterleave,
        ranks: ContextRanks,
        device: torch.device,
        pass_q: bool | None = None,
    ) -> None:
        self.place, self.ranks, self.device, self.pass_q = place, ranks, device, pass_q
        self.starts = [c - q for q, c in zip(query_lens, context_lens, strict=True)]
        self.ends = list(context_lens)
        self.decodes = [i for i, q in enumerate(query_lens) if q == 1]
        self.prefills = [i for i, q in enumerate(query_lens) if q > 1]
        self._tables = {g: [list(row) for row in rows] for g, rows in tables.items()}
        self._computed = [self._positions(src) for src in range(ranks.size)]
        firsts = [0]
        for q in query_lens:
            firsts.append(firsts[-1] + q)
        self.num_tokens = firsts[-1]
        mine = self._computed[ranks.rank]
        # This rank's tokens, request by request: where each sits in the step's batch.
        self.global_rows = self.tensor([firsts[i] + p - self.starts[i] for i, p in mine])
        self.positions = self.tensor([p for _, p in mine])
        kinds = [query_lens[i] == 1 for i, _ in mine]
        self._decode_rows = self.tensor([j for j, d in enumerate(kinds) if d])
        self._prefill_rows = self.tensor([j for j, d in enumerate(kinds) if not d])
        self._cache: dict[tuple[object, ...], object] = {}

    # -- the tokens -----------------------------------------------------------------------

    def _positions(self, rank: int) -> list[tuple[int, int]]:
        """(request, position) of each token ``rank`` runs, in its batch order."""
        out = []
        for i, (start, end) in enumerate(zip(self.starts, self.ends, strict=True)):
            if end - start == 1:
                out.append((i, start))
            else:
                cp = self.ranks.size
                out.extend((i, p) for p in rank_positions(start, end - start, cp, rank))
        return out

    def prefill_tokens(self, rank: int) -> list[tuple[int, int]]:
        """(request, position) of the prefill tokens ``rank`` runs: its shard's new keys."""
        return [(i, p) for i, p in self._computed[rank] if self.ends[i] - self.starts[i] > 1]

    def tensor(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the step's device."""
        return torch.tensor(list(values), dtype=torch.long, device=self.device)

    def _keys(self, group: int, seq_positions: Sequence[tuple[int, int]]) -> StoredKeys:
        """This rank's page and offset of each (request, position) it stores."""
        place, table, bs = self.place, self._tables[group], self.place.block_size
        local = [(i, p, place.local_index(p)) for i, p in seq_positions]
        return StoredKeys(
            pages=self.tensor([table[i][j // bs] for i, _, j in local]),
            offsets=self.tensor([j % bs for _, _, j in local]),
            positions=self.tensor([p for _, p, _ in local]),
            seqs=self.tensor([i for i, _, _ in local]),
        )

    def _stored(
        self, rank: int, requests: Sequence[int], lows: Sequence[int], highs: Sequence[int]
    ) -> list[tuple[int, int]]:
        """(request, position) of ``rank``'s stored tokens in ``[low, high)`` per request."""
        place = self.place
        return [
            (i, place.position(rank, local))
            for i, low, high in zip(requests, lows, highs, strict=True)
            for local in place.local_range(max(low, 0), high, rank)
        ]

    def _memo(self, key: tuple[object, ...], build: Callable[[], _T]) -> _T:
        """``build()``, once per step: every layer of a group and window shares it."""
        if key not in self._cache:
            self._cache[key] = build()
        value: Any = self._cache[key]
        return value  # type: ignore[no-any-return]

    # -- attention ------------------------------------------------------------------------

    def attend(
        self, layer: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Store the K/V this rank owns and attend its queries to every rank's keys."""
        out = torch.empty_like(query)
        if self.decodes:
            rows = self._decode_rows
            out[rows] = self._decode(layer, query[rows], key[rows], value[rows])
        if self.prefills:
            rows = self._prefill_rows
            out[rows] = ring_attention(self, layer, query[rows], key[rows], value[rows])
        return out

    def _decode(
        self, layer: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Decodes: write what this rank stores, attend the local keys, all-gather, merge."""
        rank, window, group = self.ranks.rank, layer.sliding_window, layer.group
        kv_cache = layer.kv_cache
        ends = [self.ends[i] for i in self.decodes]
        owned = [j for j, end in enumerate(ends) if self.place.owner(end - 1) == rank]
        if owned:
            new = self._memo(("dnew", group), lambda: self._keys(
                group, [(self.decodes[j], ends[j] - 1) for j in owned]))  # fmt: skip
            rows = self.tensor(owned)
            kv_cache[new.pages, :, :, new.offsets] = torch.stack((key[rows], value[rows]), 1)
        lows = [end - window if window is not None else 0 for end in ends]
        keys = self._memo(("dkeys", group, window), lambda: self._keys(
            group, self._stored(rank, self.decodes, lows, ends)))  # fmt: skip
        kv = kv_cache[keys.pages, :, :, keys.offsets]
        out, lse = partial_attention(
            query, kv[:, 0], kv[:, 1], self.tensor([e - 1 for e in ends]), keys.positions,
            query_seq=self.tensor(self.decodes), key_seq=keys.seqs, scale=layer.scale,
            sliding_window=window, softcap=layer.softcap,
        )  # fmt: skip
        packed = torch.cat((out.float(), lse[..., None]), dim=-1)
        gathered = [torch.empty_like(packed) for _ in range(self.ranks.size)]
        dist.all_gather(gathered, packed, group=self.ranks.group)
        self.ranks.counters.gather_bytes += packed.nbytes
        stacked = torch.stack(gathered)
        merged, _ = merge_partials(stacked[..., :-1], stacked[..., -1])
        return merged.to(query.dtype)

    # -- the ring's shards ----------------------------------------------------------------

    def cached_keys(self, group: int, window: int | None, rank: int) -> StoredKeys:
        """``rank``'s stored keys before each prefill's chunk that a query of it may read."""

        def build() -> StoredKeys:
            starts = [self.starts[i] for i in self.prefills]
            lows = [s - window + 1 if window is not None else 0 for s in starts]
            return self._keys(group, self._stored(rank, self.prefills, lows, starts))

        return self._memo(("cached", group, window, rank), build)

    def shard_len(self, group: int, window: int | None, rank: int, *, with_cached: bool) -> int:
        """Tokens of ``rank``'s ring shard: its new keys (and its cached ones)."""
        cached = self.cached_keys(group, window, rank).num_tokens if with_cached else 0
        return len(self.prefill_tokens(rank)) + cached

    def shard_keys(
        self, group: int, window: int | None, rank: int, *, with_cached: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and requests of ``rank``'s shard: its new keys, then its cached ones."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            new = self.prefill_tokens(rank)
            positions, seqs = self.tensor([p for _, p in new]), self.tensor([i for i, _ in new])
            if not with_cached:
                return positions, seqs
            cached = self.cached_keys(group, window, rank)
            return torch.cat((positions, cached.positions)), torch.cat((seqs, cached.seqs))

        return self._memo(("keys", group, window, rank, with_cached), build)

    def store_owned(
        self, group: int, src: int, shard: torch.Tensor, kv_cache: torch.Tensor
    ) -> None:
        """Write the new tokens of ``src``'s shard that this rank stores."""

        def build() -> tuple[torch.Tensor, StoredKeys]:
            new = self.prefill_tokens(src)
            rows = [j for j, (_, p) in enumerate(new) if self.place.owner(p) == self.ranks.rank]
            return self.tensor(rows), self._keys(group, [new[j] for j in rows])

        rows, keys = self._memo(("own", group, src), build)
        if rows.numel():
            kv_cache[keys.pages, :, :, keys.offsets] = shard[:, rows].transpose(0, 1)

    # -- the step's hidden states ---------------------------------------------------------

    def gather_hidden(self, hidden: torch.Tensor, *, every_row: bool) -> torch.Tensor:
        """``[num_tokens, hidden]`` in batch order on rank 0: every row if ``every_row``
        (all ranks send theirs), else only each request's last token (rank 0 runs them
        all) and zeros elsewhere. Other ranks get their own rows placed the same way."""
        full = hidden.new_zeros((self.num_tokens, hidden.shape[1]))
        if not every_row:
            full[self.global_rows] = hidden
            return full
        counts = [len(self._computed[r]) for r in range(self.ranks.size)]
        padded = hidden.new_zeros((max(counts), hidden.shape[1]))
        padded[: hidden.shape[0]] = hidden
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded, group=self.ranks.group)
        self.ranks.counters.gather_bytes += padded.nbytes
        for r, (rows, count) in enumerate(zip(gathered, counts, strict=True)):
            order = self.tensor([self._global_row(i, p) for i, p in self._computed[r]])
            full[order] = rows[:count]
        return full

    def _global_row(self, request: int, position: int) -> int:
        before = sum(self.ends[i] - self.starts[i] for i in range(request))
        return before + position - self.starts[request]


@attrs.frozen(eq=False)
class ContextLayer:
    """A step's sharded attention over one KV group (a layer's ``LayerInputs.metadata``)."""

    step: ContextStep
    group: int

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """See :meth:`ContextStep.attend`."""
        layer = LayerCall(self.group, kv_cache, scale, sliding_window, softcap)
        return self.step.attend(layer, query, key, value)
