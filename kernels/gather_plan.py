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
from hybridkv.kernels.gather_regions import (
    Region,
    RegionBuilder,
    RegionLayout,
    ValueBags,
    group_by_pages,
    token_index,
)
from hybridkv.kernels.geometry import CacheGeometry
from hybridkv.kernels.span_mask import LiveSpans, SpanMasks
from hybridkv.kernels.workspace import GatherWorkspace

__all__ = ["GatherLayout", "GatherPlan", "Region", "ValueBags"]


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
class GatherLayout:
    """Everything of a ``GatherPlan`` that depends on lengths only, not on page ids.

    KV groups of one policy run the same lengths every step, so they share one layout and
    each binds it to its own block table (``bind``): only the page lookups are per group.
    """

    regions: tuple[RegionLayout, ...]
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
        builder = RegionBuilder(
            geometry,
            key_start,
            ctx_lens,
            num_queries_per_kv=num_queries_per_kv,
            device=device,
            spans=spans,
        )
        starts = [0, *torch.cumsum(q_lens, 0).tolist()]
        decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
        for ids in group_by_pages(decode_ids, builder.num_pages.tolist()):
            builder.add(ids, token_index([starts[i] for i in ids]), None)
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

    def _value_bags(self, pages: torch.Tensor, layout: RegionLayout) -> ValueBags:
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
