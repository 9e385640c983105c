"""Which cache pages one step's attention reads, and how its queries may see them.

A ``GatherPlan`` is built once per step for one (KV group, window, head geometry) and reused
by every layer of that group. It turns block tables into one flat index of page runs, so
that each layer gathers the keys and values of the whole batch with a single
``index_select`` into a workspace buffer, already laid out the way SDPA wants them.

Runs. A run is the ``block_size`` keys (or values) of one head in one page, contiguous in
memory (see ``geometry``). Runs of consecutive pages of a request, copied one after the
other, land as consecutive key positions of ``buffer[kv, request, head]``.

Key range. Query token at position ``p`` reads keys ``k`` with ``p - W < k <= p``
(``W`` = window, infinite for full attention). A request runs positions
``[context_len - query_len, context_len)``, so it reads keys
``[key_start, context_len)`` with ``key_start = max(0, context_len - query_len - W + 1)``,
gathered page-wise from the page holding ``key_start``::

    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .     block_size=4, W=3, query_len=2, context_len=10
    table      [null ] | [ b7  ] | [ b2  ]     queries at 8, 9 read keys [6, 10)
    gathered             z z 6 7 | 8 9 z z     pages from key_start's on: never the null block
    mask                 - - x x | x x - -     z: zeroed after the gather

Decodes. A decode region gathers keys only, when every token's value starts a row of the
cache's token-row view (``CacheGeometry.has_token_rows``) and its requests' values are large
enough to be worth not copying (``VALUE_BAGS_MIN_ELEMENTS``): its ``ValueBags`` name, per
(request, query head), the value rows attention reads in place. Smaller decodes gather keys
and values and run one SDPA call.

Padding. Requests of one region share a padded page count; pad runs repeat the request's
last page. Every gathered slot outside ``[key_start, context_len)`` (the first page's head,
the last page's unwritten tail, pad runs) is zeroed after the gather and masked out: a
masked key must still be finite, since softmax weight 0 times NaN is NaN.

Live spans. Keys that are not one window (``live_spans`` instead of ``W``, see
``span_mask``) take the same path with masks built from the spans: ``key_start`` is the
first key any query reads, every slot no query reads is zeroed, and only pages holding a
key some query reads must be real (the others may be the null block).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from hybridkv.kernels.errors import KernelInputError
from hybridkv.kernels.geometry import CacheGeometry
from hybridkv.kernels.span_mask import LiveSpans, SpanMasks
from hybridkv.kernels.workspace import GatherWorkspace

# Decodes share one SDPA call while padding stays under this fraction of the real keys.
_PAD_SLACK = 1.25
# Decodes read values in place only when each request's values are at least this many
# elements (key_len * num_kv_heads * head_dim): for small heads and short contexts (1 KV
# head of 64, 300 keys) gathering values too and one SDPA call is faster (0.33 vs 0.46 ms
# a layer for 64 decodes of 144 keys, 0.68 vs 1.0 ms at 304; equal near 500, 2 threads).
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
class GatherPlan:
    """The run index, the rows to zero and the regions of one step (see module docstring)."""

    runs: torch.Tensor
    zero_rows: torch.Tensor | None
    regions: tuple[Region, ...]
    geometry: CacheGeometry
    workspace: GatherWorkspace

    def buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[num_rows, head_dim]`` gather target, borrowed from the workspace."""
        numel = self.runs.numel() * self.geometry.run_len
        buf = self.workspace.get(numel, dtype, self.runs.device)
        return buf.view(-1, self.geometry.head_dim)

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_table: torch.Tensor,
        geometry: CacheGeometry,
        num_queries_per_kv: int,
        sliding_window: int | None,
        device: torch.device,
        workspace: GatherWorkspace,
        live_spans: LiveSpans | None = None,
    ) -> GatherPlan:
        """Plan one step: decodes (query_len 1) batched by length, each prefill on its own."""
        layout = GatherLayout.build(
            query_lens=query_lens,
            context_lens=context_lens,
            geometry=geometry,
            num_queries_per_kv=num_queries_per_kv,
            sliding_window=sliding_window,
            live_spans=live_spans,
            device=device,
        )
        return layout.bind(block_table, workspace)


@attrs.frozen(eq=False, kw_only=True)
class _RegionLayout:
    """A region before its pages are known: which table cells it reads, and its shape."""

    region: Region
    ids: torch.Tensor  # [B, 1] rows of the block table
    page_idx: torch.Tensor  # [B, width] columns of the block table
    num_kv: int  # 1: keys only (values read in place), 2: keys and values
    bag_offsets: torch.Tensor | None
    bag_keep: torch.Tensor | None
    required: torch.Tensor | None  # [B, width] pages some query reads; None: every page


@attrs.frozen(eq=False, kw_only=True)
class GatherLayout:
    """Everything of a ``GatherPlan`` that depends on lengths only, not on page ids.

    KV groups of one policy run the same lengths every step, so they share one layout and
    each binds it to its own block table (``bind``): only the page lookups are per group.
    """

    regions: tuple[_RegionLayout, ...]
    zero_rows: torch.Tensor | None
    geometry: CacheGeometry
    num_queries_per_kv: int
    device: torch.device

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        geometry: CacheGeometry,
        num_queries_per_kv: int,
        sliding_window: int | None,
        device: torch.device,
        live_spans: LiveSpans | None = None,
    ) -> GatherLayout:
        """Lay out one step: decodes (query_len 1) batched by length, each prefill alone.

        Keys are those of the window ``sliding_window`` (None: every earlier key), or,
        with ``live_spans``, those the spans name (``sliding_window`` must then be None).
        """
        if sliding_window is not None and sliding_window < 1:
            raise KernelInputError(f"sliding_window must be >= 1, got {sliding_window}")
        if sliding_window is not None and live_spans is not None:
            raise KernelInputError("pass sliding_window or live_spans, not both")
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx_lens = torch.tensor(context_lens, dtype=torch.long)
        key_start = torch.zeros_like(ctx_lens)
        spans = None
        if sliding_window is not None:
            key_start = (ctx_lens - q_lens - sliding_window + 1).clamp(min=0)
        elif live_spans is not None:
            spans = SpanMasks.build(live_spans, query_lens, context_lens, geometry.block_size)
            key_start = spans.key_start
        builder = _Builder(
            geometry,
            key_start,
            ctx_lens,
            num_queries_per_kv=num_queries_per_kv,
            device=device,
            spans=spans,
        )
        starts = [0, *torch.cumsum(q_lens, 0).tolist()]
        decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
        for ids in _group_by_pages(decode_ids, builder.num_pages.tolist()):
            builder.add(ids, _token_index([starts[i] for i in ids]), None)
        for i, n in enumerate(query_lens):
            if n > 1:
                q_pos = torch.arange(context_lens[i] - n, context_lens[i])
                builder.add([i], slice(starts[i], starts[i] + n), q_pos, sliding_window)
        zero = torch.cat(builder.zero_rows).to(device) if builder.zero_rows else None
        return cls(
            regions=tuple(builder.regions),
            zero_rows=zero,
            geometry=geometry,
            num_queries_per_kv=num_queries_per_kv,
            device=device,
        )

    def bind(self, block_table: torch.Tensor, workspace: GatherWorkspace) -> GatherPlan:
        """The plan of this layout over one group's ``[num_requests, max_blocks]`` table.

        Raises:
            KernelInputError: a table names the null block inside an attended key range.
        """
        runs, regions = [], []
        for layout in self.regions:
            pages = block_table[layout.ids, layout.page_idx]
            null = pages == 0
            if layout.required is not None:
                null &= layout.required
            if bool(null.any()):
                bad = int(layout.ids[int(null.any(dim=1).nonzero()[0])])
                raise KernelInputError(
                    f"request {bad} reads the null block inside its attended key range; "
                    "only blocks that no query of the step reads may be null"
                )
            runs.append(self.geometry.run_rows(pages)[: layout.num_kv].reshape(-1))
            region = layout.region
            if layout.bag_offsets is not None:
                region = attrs.evolve(region, value_bags=self._value_bags(pages, layout))
            regions.append(region)
        return GatherPlan(
            runs=torch.cat(runs).to(self.device),
            zero_rows=self.zero_rows,
            regions=tuple(regions),
            geometry=self.geometry,
            workspace=workspace,
        )

    def _value_bags(self, pages: torch.Tensor, layout: _RegionLayout) -> ValueBags:
        """One bag of visible value rows per (request, query head), in key order."""
        assert layout.bag_offsets is not None
        rows = self.geometry.value_token_rows(pages)[:, :, None, :]  # [B, Hkv, 1, key_len]
        rows = rows.expand(-1, -1, self.num_queries_per_kv, -1).reshape(-1)
        if layout.bag_keep is not None:
            rows = rows[layout.bag_keep]
        return ValueBags(
            rows=rows.to(self.device),
            offsets=layout.bag_offsets.to(self.device),
            keep=None if layout.bag_keep is None else layout.bag_keep.to(self.device),
        )


class _Builder:
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
        self.regions: list[_RegionLayout] = []
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
            _RegionLayout(
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


def _group_by_pages(request_ids: list[int], num_pages: list[int]) -> list[list[int]]:
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


def _token_index(token_ids: list[int]) -> slice | list[int]:
    """A slice when the tokens are consecutive (no index copy needed), else the ids."""
    if token_ids == list(range(token_ids[0], token_ids[0] + len(token_ids))):
        return slice(token_ids[0], token_ids[0] + len(token_ids))
    return token_ids
