"""The prefill ring of context parallelism: pass-KV, and pass-Q over a long cached prefix.

Every rank holds its queries (chunks i and 2cp-1-i of each prefill), the K/V of those
tokens, and its round-robin share of each request's cached K/V. A query must meet every
key it reads exactly once; the partial results are merged by log-sum-exp::

    pass-KV   shard_i = my new K/V (+ my cached K/V)   rotates cp - 1 hops; each rank
                                                        attends its queries to each shard
    pass-Q    shard_i = my new K/V                      rotates as above, then
              Q_i                                       rotates cp - 1 hops; each rank
                                                        attends each Q to its cached K/V
                                                        and sends the (out, lse) back

Each hop's send and receive run while the rank attends the shard in hand (gloo and NCCL
transfer on their own threads). The new K/V always travel: their owners (round-robin) must
store them, and they pick them out of the shards passing by. The cached part is where the
two differ: pass-KV sends ``(cp-1)/cp * P`` cached tokens of K/V per rank, pass-Q sends the
step's ``T`` queries and gets their partial outputs back. The paper (arXiv 2411.01783)
passes Q when ``T / (T + P) < 2 * NKV / NH``; here the new K/V travel in both, so the rule
compares only what differs: pass Q when the cached K/V outweigh the queries and partial
outputs (:func:`prefers_pass_q`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from hybridkv.kernels.lse_merge import merge_partials
from hybridkv.kernels.partial_attention import partial_attention
from hybridkv.parallel.context_group import ContextRanks, LayerCall, StoredKeys

#: Partial outputs travel in float32 with their lse as one more column.
_PARTIAL_BYTES = 4


class RingStep(Protocol):
    """What the ring reads of a step (``context_attention.ContextStep`` is one): the
    tokens each rank runs, the keys each stores, and where the new keys go."""

    ranks: ContextRanks
    pass_q: bool | None

    def tensor(self, values: Sequence[int]) -> torch.Tensor: ...

    def prefill_tokens(self, rank: int) -> list[tuple[int, int]]: ...

    def cached_keys(self, group: int, window: int | None, rank: int) -> StoredKeys: ...

    def shard_len(self, group: int, window: int | None, rank: int, *, with_cached: bool) -> int: ...

    def shard_keys(
        self, group: int, window: int | None, rank: int, *, with_cached: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def store_owned(
        self, group: int, src: int, shard: torch.Tensor, kv_cache: torch.Tensor
    ) -> None: ...


def prefers_pass_q(num_new: int, num_cached: int, query: torch.Tensor, kv_token_bytes: int) -> bool:
    """Whether passing queries moves fewer bytes than passing the cached K/V.

    Args:
        num_new: The step's prefill tokens (its queries), over all ranks.
        num_cached: The cached tokens they read, over all ranks.
        query: A query shard, ``[tokens, num_q_heads, head_dim]`` (its width and dtype).
        kv_token_bytes: Bytes of one token's K and V in a layer.
    """
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    sent = num_q_heads * head_dim * query.element_size()
    returned = num_q_heads * (head_dim + 1) * _PARTIAL_BYTES
    return num_cached * kv_token_bytes > num_new * (sent + returned)


def ring_attention(
    step: RingStep, layer: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """This rank's prefill queries attended to every key they read; stores the new K/V
    this rank owns on the way."""
    ranks, group, window = step.ranks, layer.group, layer.sliding_window
    num_new = sum(len(step.prefill_tokens(r)) for r in range(ranks.size))
    num_cached = sum(step.cached_keys(group, window, r).num_tokens for r in range(ranks.size))
    kv_token_bytes = 2 * key.shape[1] * key.shape[2] * key.element_size()
    pass_q = step.pass_q
    if pass_q is None:
        pass_q = prefers_pass_q(num_new, num_cached, query, kv_token_bytes)
    mine = step.prefill_tokens(ranks.rank)
    query_pos = step.tensor([p for _, p in mine])
    query_seq = step.tensor([i for i, _ in mine])
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []

    def attend(keys: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor) -> None:
        out, lse = partial_attention(
            query, keys[0], keys[1], query_pos, positions, query_seq=query_seq, key_seq=seqs,
            scale=layer.scale, sliding_window=window, softcap=layer.softcap,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)

    def visit_kv(src: int, shard: torch.Tensor) -> None:
        step.store_owned(group, src, shard, layer.kv_cache)
        attend(shard, *step.shard_keys(group, window, src, with_cached=not pass_q))

    shard = torch.stack((key, value))
    if not pass_q:
        cached = step.cached_keys(group, window, ranks.rank)
        old = layer.kv_cache[cached.pages, :, :, cached.offsets].transpose(0, 1)
        shard = torch.cat((shard, old), dim=1)
    ranks.counters.ring_bytes += rotate(
        ranks,
        shard.contiguous(),
        lambda src: step.shard_len(group, window, src, with_cached=not pass_q),
        visit_kv,
    )
    if pass_q:
        for out, lse in _pass_q(step, layer, query):
            outs.append(out)
            lses.append(lse)
    merged, _ = merge_partials(torch.stack(outs), torch.stack(lses))
    return merged


def _pass_q(
    step: RingStep, layer: LayerCall, query: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's queries against this rank's cached keys; this rank's queries' partial
    results from every rank (its own included), as (out, lse) pairs."""
    ranks, group, window = step.ranks, layer.group, layer.sliding_window
    cached = step.cached_keys(group, window, ranks.rank)
    keys = layer.kv_cache[cached.pages, :, :, cached.offsets]
    head_dim = query.shape[2]
    packed: dict[int, torch.Tensor] = {}

    def visit_q(src: int, queries: torch.Tensor) -> None:
        tokens = step.prefill_tokens(src)
        out, lse = partial_attention(
            queries[0], keys[:, 0], keys[:, 1], step.tensor([p for _, p in tokens]),
            cached.positions, query_seq=step.tensor([i for i, _ in tokens]),
            key_seq=cached.seqs, scale=layer.scale, sliding_window=window,
            softcap=layer.softcap,
        )  # fmt: skip
        packed[src] = torch.cat((out.float(), lse[..., None]), dim=-1)

    ranks.counters.query_bytes += rotate(
        ranks, query[None], lambda src: len(step.prefill_tokens(src)), visit_q
    )
    # The partial results go back to their queries' rank.
    mine = len(step.prefill_tokens(ranks.rank))
    works, received = [], [packed[ranks.rank]]
    for other in range(ranks.size):
        if other == ranks.rank:
            continue
        if packed[other].shape[0]:
            works.append(dist.isend(packed[other], group=ranks.group, group_dst=other))
            ranks.counters.partial_bytes += packed[other].nbytes
        if mine:
            buffer = query.new_empty((mine, query.shape[1], head_dim + 1), dtype=torch.float32)
            works.append(dist.irecv(buffer, group=ranks.group, group_src=other))
            received.append(buffer)
    for work in works:
        assert work is not None
        work.wait()
    return [(p[..., :-1].to(query.dtype), p[..., -1]) for p in received]


def rotate(
    ranks: ContextRanks,
    tensor: torch.Tensor,
    length_of: Callable[[int], int],
    visit: Callable[[int, torch.Tensor], None],
) -> int:
    """Pass every rank's ``tensor`` (tokens on dim 1) around the ring; ``visit(src, t)``
    each, overlapping the next transfer. Returns the bytes this rank sent.

    ``length_of(src)`` is the token count of rank src's tensor, known to every rank, so a
    rank allocates what it receives and skips empty transfers on both sides.
    """
    cp, rank, sent = ranks.size, ranks.rank, 0
    for step in range(cp):
        src = (rank - step) % cp
        works, incoming = [], None
        if step + 1 < cp:
            if tensor.shape[1]:
                works.append(dist.isend(tensor, group=ranks.group, group_dst=(rank + 1) % cp))
                sent += tensor.nbytes
            size = length_of((src - 1) % cp)
            if size:
                incoming = tensor.new_empty((tensor.shape[0], size, *tensor.shape[2:]))
                works.append(dist.irecv(incoming, group=ranks.group, group_src=(rank - 1) % cp))
        visit(src, tensor)
        for work in works:
            assert work is not None
            work.wait()
        tensor = incoming if incoming is not None else tensor[:, :0]
    return sent
