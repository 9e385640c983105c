"""The regions of one step's gather: which requests share an SDPA call, and how they see keys.

``GatherLayout.build`` (``gather_plan``) feeds each region to a :class:`RegionBuilder`:
decodes grouped by page count (:func:`group_by_pages`, padding bounded by ``_PAD_SLACK``),
each prefill alone. A region's layout names the block-table cells it reads, its key
length, its mask and the gathered rows to zero; it does not know the page ids, so KV
groups of one policy share it and each binds it to its own table (``GatherLayout.bind``).
See ``gather_plan`` for the key range, padding and value-bag rules.
"""

from __future__ import annotations

import attrs
import torch

from hybridkv.kernels.geometry import CacheGeometry
from hybridkv.kernels.span_mask import SpanMasks

# Decodes share one SDPA call while padding stays under this fraction of the real keys.
_PAD_SLACK = 1.25
# Decodes read values in place only when each request's values are at least this many
# elements (key_len * num_kv_heads * head_dim): for small heads and short contexts,
# gathering the values too and making one SDPA call is faster (benchmarks/decode/attention.py).
VALUE_BAGS_MIN_ELEMENTS = 1 << 15


@attrs.frozen(eq=False, kw_only=True)
class ValueBags:
    """Where a decode region's values are read in place, as ``embedding_bag`` inputs.

    Bag ``(request, kv_head, g)`` holds the rows (of ``CacheGeometry.token_rows_view``) of
    the values its query sees, in key order, starting at ``offsets[bag]``. Hidden keys
    (outside ``[key_start, context_len)``) are left out, so their rows are never read;
    ``keep`` then picks the visible entries of the flattened ``[B, Hkv, G, key_len]``
    softmax weights (``None``: every key is visible).
    """

    rows: torch.Tensor
    offsets: torch.Tensor
    keep: torch.Tensor | None


@attrs.frozen(eq=False, kw_only=True)
class Region:
    """One SDPA call: ``num_requests`` requests with equal query count and padded key length.

    Its keys and values are ``buffer[row_offset : row_offset + num_rows]`` viewed as
    ``[2, num_requests, num_kv_heads, key_len, head_dim]``, or keys only (``[1, ...]``) when
    ``value_bags`` says where to read the values in place. ``mask`` (True = attend) is
    ``[num_requests, 1, 1, key_len]`` for decodes and ``[G * num_queries, key_len]`` for a
    prefill whose G = num_q_heads // num_kv_heads query heads are folded into its rows;
    ``None`` means every key is visible to every query, or, with ``is_causal``, that the
    region is a whole prompt in one step (positions from 0, no window reaching back past
    position 0): SDPA's top-left ``is_causal`` is then exact, and lets it skip the masked
    half. Padded slots at the end never pass a top-left causal mask.
    """

    token_index: slice | torch.Tensor
    num_requests: int
    num_queries: int
    key_len: int
    row_offset: int
    num_rows: int
    mask: torch.Tensor | None
    is_causal: bool = False
    value_bags: ValueBags | None = None


@attrs.frozen(eq=False, kw_only=True)
class RegionLayout:
    """A region before its pages are known: which table cells it reads, and its shape."""

    region: Region
    ids: torch.Tensor  # [B, 1] rows of the block table
    page_idx: torch.Tensor  # [B, width] columns of the block table
    num_kv: int  # 1: keys only (values read in place), 2: keys and values
    bag_offsets: torch.Tensor | None
    bag_keep: torch.Tensor | None
    required: torch.Tensor | None  # [B, width] pages some query reads; None: every page


class RegionBuilder:
    """Accumulates the region layouts and zeroed rows of a step, one region at a time."""

    def __init__(
        self,
        geometry: CacheGeometry,
        key_start: torch.Tensor,
        ctx_lens: torch.Tensor,
        *,
        num_queries_per_kv: int,
        device: torch.device,
        spans: SpanMasks | None = None,
    ) -> None:
        self.geometry = geometry
        self.spans = spans
        self.block_size, self.num_kv_heads = geometry.block_size, geometry.num_kv_heads
        self.key_start, self.ctx_lens = key_start, ctx_lens
        self.num_queries_per_kv, self.device = num_queries_per_kv, device
        self.first_page = key_start // self.block_size
        self.num_pages = (ctx_lens - 1) // self.block_size - self.first_page + 1
        self.zero_rows: list[torch.Tensor] = []
        self.regions: list[RegionLayout] = []
        self.offset = 0

    def add(
        self,
        ids: list[int],
        token_index: slice | list[int],
        query_pos: torch.Tensor | None,
        window: int | None = None,
    ) -> None:
        """Add one region; ``query_pos`` (prefills only) gives its causal/window mask."""
        idx = torch.tensor(ids, dtype=torch.long)
        first, num_pages = self.first_page[idx], self.num_pages[idx]
        width = int(num_pages.max())
        page_idx = first[:, None] + torch.minimum(torch.arange(width), num_pages[:, None] - 1)
        key_len = width * self.block_size
        pos = first[:, None] * self.block_size + torch.arange(key_len)[None, :]
        required = None
        if self.spans is None:
            visible = (pos >= self.key_start[idx][:, None]) & (pos < self.ctx_lens[idx][:, None])
        else:
            visible = self.spans.visible(ids, key_len)
            # Pages holding no key that is read may be the null block.
            required = visible.view(len(ids), width, self.block_size).any(dim=-1)
        all_visible = bool(visible.all())
        # Decodes read values in place (embedding_bag over token rows): gather keys only.
        per_request = key_len * self.num_kv_heads * self.geometry.head_dim
        in_place = (
            query_pos is None
            and self.geometry.has_token_rows
            and per_request >= VALUE_BAGS_MIN_ELEMENTS
        )
        bag_offsets = bag_keep = None
        if in_place:
            seen = visible[:, None, None, :].expand(
                -1, self.num_kv_heads, self.num_queries_per_kv, -1
            )
            counts = seen.sum(dim=-1).reshape(-1)
            bag_offsets = torch.cumsum(counts, 0) - counts
            bag_keep = None if all_visible else seen.reshape(-1).nonzero().view(-1)
        num_kv = 1 if in_place else 2
        num_rows = num_kv * len(ids) * self.num_kv_heads * key_len
        if not all_visible:
            hidden = (~visible)[None, :, None, :].expand(num_kv, -1, self.num_kv_heads, -1)
            self.zero_rows.append(hidden.reshape(-1).nonzero().view(-1) + self.offset)
        if query_pos is None:
            mask = None if all_visible else visible[:, None, None, :]
        elif self.spans is not None:
            mask = self.spans.mask(ids[0], key_len).repeat(self.num_queries_per_kv, 1)
        elif int(query_pos[0]) == 0 and (window is None or window >= query_pos.numel()):
            mask = None
        else:
            mask = pos[0][None, :] <= query_pos[:, None]
            if window is not None:
                mask &= pos[0][None, :] > query_pos[:, None] - window
            mask = mask.repeat(self.num_queries_per_kv, 1)  # rows g * num_queries + i
        index: slice | torch.Tensor
        if isinstance(token_index, list):
            index = torch.tensor(token_index, dtype=torch.long, device=self.device)
        else:
            index = token_index
        region = Region(
            token_index=index,
            num_requests=len(ids),
            num_queries=1 if query_pos is None else query_pos.numel(),
            key_len=key_len,
            row_offset=self.offset,
            num_rows=num_rows,
            mask=None if mask is None else mask.to(self.device),
            is_causal=query_pos is not None and mask is None,
        )
        self.regions.append(
            RegionLayout(
                region=region,
                ids=idx[:, None],
                page_idx=page_idx,
                num_kv=num_kv,
                bag_offsets=bag_offsets,
                bag_keep=bag_keep,
                required=required,
            )
        )
        self.offset += num_rows


def group_by_pages(request_ids: list[int], num_pages: list[int]) -> list[list[int]]:
    """Split decodes into groups whose padded page count stays within ``_PAD_SLACK``.

    Longest first (stable, so equal lengths keep batch order); a group takes the next
    request while ``len(group) * longest <= _PAD_SLACK * sum(pages of group)``.
    """
    groups: list[list[int]] = []
    real = 0
    for i in sorted(request_ids, key=lambda r: -num_pages[r]):
        if groups and (len(groups[-1]) + 1) * num_pages[groups[-1][0]] <= _PAD_SLACK * (
            real + num_pages[i]
        ):
            groups[-1].append(i)
            real += num_pages[i]
        else:
            groups.append([i])
            real = num_pages[i]
    return groups


def token_index(token_ids: list[int]) -> slice | list[int]:
    """A slice when the tokens are consecutive (no index copy needed), else the ids."""
    if token_ids == list(range(token_ids[0], token_ids[0] + len(token_ids))):
        return slice(token_ids[0], token_ids[0] + len(token_ids))
    return token_ids
