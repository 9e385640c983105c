"""Which cache rows one step's attention reads, and how its queries may see them.

A ``GatherPlan`` is built once per step for one (KV group, window, head geometry) and reused
by every layer of that group. It turns block tables into one flat row index over the cache,
so that each layer gathers the keys and values of the whole batch with a single
``index_select`` into a buffer the plan owns, laid out the way SDPA wants them.

Rows. The cache of one layer is ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``;
viewed as ``[num_blocks * 2 * num_kv_heads * block_size, head_dim]`` the row of
(page, k-or-v, head, offset) is ``((page * 2 + kv) * num_kv_heads + head) * block_size +
offset``.

Key range. Query token at position ``p`` reads keys ``k`` with ``p - W < k <= p``
(``W`` = window, infinite for full attention). A request runs positions
``[context_len - query_len, context_len)``, so it reads keys
``[key_start, context_len)`` with ``key_start = max(0, context_len - query_len - W + 1)``::

    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .     block_size=4, W=3, query_len=2, context_len=10
    table      [null ] | [ b7  ] | [ b2  ]     queries at 8, 9 read keys [6, 10)
    gathered             . . 6 7 | 8 9         key_start=6: blocks before it are never read

Padding. Requests of one region share a padded key length. Pad slots re-read the
request's last key (position ``context_len - 1``, written this step, so finite) and are
masked out: a masked key must still be finite, since softmax weight 0 times NaN is NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from hybridkv.kernels.errors import KernelInputError


@attrs.frozen(eq=False, kw_only=True)
class Region:
    """One SDPA call: ``num_requests`` requests with equal query count and padded key length.

    The gathered keys live at ``buffer[row_offset : row_offset + num_rows]`` viewed as
    ``[num_requests, 2, num_kv_heads, key_len, head_dim]``. ``mask`` (True = attend) is
    ``[num_requests, 1, 1, key_len]`` for decodes and ``[G * num_queries, key_len]`` for a
    prefill whose G = num_q_heads // num_kv_heads query heads are folded into its rows;
    ``None`` means every key is visible to every query.
    """

    token_index: slice | torch.Tensor
    num_requests: int
    num_queries: int
    key_len: int
    row_offset: int
    num_rows: int
    mask: torch.Tensor | None


@attrs.frozen(eq=False, kw_only=True)
class GatherPlan:
    """The flat row index and the regions of one step; see the module docstring."""

    rows: torch.Tensor
    regions: tuple[Region, ...]
    _buffers: dict[torch.dtype, torch.Tensor] = attrs.field(factory=dict, init=False)

    def buffer(self, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        """The ``[num_rows, head_dim]`` gather target, allocated once and reused by layers."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.shape[1] != head_dim:
            buf = torch.empty(self.rows.numel(), head_dim, dtype=dtype, device=self.rows.device)
            self._buffers[dtype] = buf
        return buf

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_table: torch.Tensor,
        block_size: int,
        num_kv_heads: int,
        num_queries_per_kv: int,
        sliding_window: int | None,
        device: torch.device,
    ) -> GatherPlan:
        """Plan one step: all decodes (query_len 1) in one region, each prefill in its own."""
        if sliding_window is not None and sliding_window < 1:
            raise KernelInputError(f"sliding_window must be >= 1, got {sliding_window}")
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx_lens = torch.tensor(context_lens, dtype=torch.long)
        key_start = torch.zeros_like(ctx_lens)
        if sliding_window is not None:
            key_start = (ctx_lens - q_lens - sliding_window + 1).clamp(min=0)
        num_keys = ctx_lens - key_start
        starts = [0, *torch.cumsum(q_lens, 0).tolist()]
        geometry = _Geometry(block_table, block_size, num_kv_heads)

        regions: list[Region] = []
        row_chunks: list[torch.Tensor] = []
        offset = 0
        decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_ids:
            ids = torch.tensor(decode_ids, dtype=torch.long)
            rows, valid = geometry.rows(ids, key_start[ids], num_keys[ids])
            mask = None if bool(valid.all()) else valid[:, None, None, :]
            token_index = _token_index([starts[i] for i in decode_ids], device)
            regions.append(
                Region(
                    token_index=token_index,
                    num_requests=len(decode_ids),
                    num_queries=1,
                    key_len=valid.shape[1],
                    row_offset=offset,
                    num_rows=rows.numel(),
                    mask=None if mask is None else mask.to(device),
                )
            )
            row_chunks.append(rows.reshape(-1))
            offset += rows.numel()
        for i, n in enumerate(query_lens):
            if n == 1:
                continue
            ids = torch.tensor([i], dtype=torch.long)
            rows, _ = geometry.rows(ids, key_start[ids], num_keys[ids])
            q_pos = torch.arange(context_lens[i] - n, context_lens[i])
            k_pos = torch.arange(int(key_start[i]), context_lens[i])
            mask = k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            regions.append(
                Region(
                    token_index=slice(starts[i], starts[i] + n),
                    num_requests=1,
                    num_queries=n,
                    key_len=k_pos.numel(),
                    row_offset=offset,
                    num_rows=rows.numel(),
                    mask=mask.repeat(num_queries_per_kv, 1).to(device),
                )
            )
            row_chunks.append(rows.reshape(-1))
            offset += rows.numel()
        all_rows = torch.cat(row_chunks).to(device)
        return cls(rows=all_rows, regions=tuple(regions))


@attrs.frozen
class _Geometry:
    """Block tables and cache shape: turns (request, key position) into flat cache rows."""

    block_table: torch.Tensor
    block_size: int
    num_kv_heads: int

    def rows(
        self, request_ids: torch.Tensor, key_start: torch.Tensor, num_keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[B, 2, num_kv_heads, L]`` and validity ``[B, L]`` for keys from key_start.

        ``L`` is the largest ``num_keys``; slots past a request's own count re-read its last
        key (see Padding in the module docstring) and are False in the validity mask.
        """
        key_len = int(num_keys.max())
        j = torch.arange(key_len)
        valid = j[None, :] < num_keys[:, None]
        pos = key_start[:, None] + torch.minimum(j[None, :], num_keys[:, None] - 1)
        pages = self.block_table[request_ids[:, None], pos // self.block_size]
        if bool((pages == 0).any()):
            bad = int(request_ids[(pages == 0).any(dim=1)][0])
            raise KernelInputError(
                f"request {bad} reads the null block inside its attended key range; "
                "only blocks before the window may be null"
            )
        offsets = pos % self.block_size
        kv = torch.arange(2)[None, :, None, None]
        heads = torch.arange(self.num_kv_heads)[None, None, :, None]
        base = (pages[:, None, None, :] * 2 + kv) * self.num_kv_heads + heads
        return base * self.block_size + offsets[:, None, None, :], valid


def _token_index(token_ids: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice when the tokens are consecutive (no index copy needed), else an index tensor."""
    if token_ids == list(range(token_ids[0], token_ids[0] + len(token_ids))):
        return slice(token_ids[0], token_ids[0] + len(token_ids))
    return torch.tensor(token_ids, dtype=torch.long, device=device)
