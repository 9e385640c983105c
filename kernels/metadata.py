"""Per-step metadata of one KV group: where new tokens go and what attention reads.

Built once per step per KV group and shared by every layer of the group. A batch holds
requests in order, each running ``query_len`` tokens at positions
``[context_len - query_len, context_len)``; tokens are laid out request after request::

    request       r0 (prefill chunk)    r1 (decode)   r2 (decode)
    positions     [5 6 7 8]             [12]          [3]
    token index    0 1 2 3               4             5
    context_len    9                     13            4

Token at position ``p`` of a request is stored in page ``block_table[p // block_size]`` at
offset ``p % block_size``; its slot is ``page * block_size + offset``. Page 0 is the null
block: it is never written, and never read inside an attended range.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import torch

from hybridkv.kernels.errors import KernelInputError
from hybridkv.kernels.gather_plan import GatherLayout, GatherPlan
from hybridkv.kernels.geometry import CacheGeometry
from hybridkv.kernels.span_mask import LiveSpans
from hybridkv.kernels.workspace import GatherWorkspace

#: Geometry, query heads per KV head, window, live spans: what a gather plan depends on.
PlanKey = tuple[CacheGeometry, int, int | None, LiveSpans | None]


@attrs.frozen(eq=False, kw_only=True)
class PagedMetadata:
    """Slot mapping and block tables of one step for one KV group.

    Attributes:
        query_lens: tokens each request runs this step (>= 1).
        context_lens: tokens in each request's context after this step.
        block_size: tokens per page.
        device: where the index tensors live (the cache's device).
        block_table: ``[num_requests, max_blocks]`` int64 on the CPU, right-padded with 0.
        positions: ``[num_tokens]`` int64 on ``device``, each token's position in its request.
        slot_mapping: ``[num_tokens]`` int64 on ``device``, ``page * block_size + offset``.
        write_blocks: ``[num_tokens]`` ``slot_mapping // block_size``.
        write_offsets: ``[num_tokens]`` ``slot_mapping % block_size``.
        max_block_id: the largest page id any table names (checked against the cache).
        workspace: where the layers' gather buffers come from.
        layouts: the lengths-only part of the gather plans, shared by every group built
            together by ``build_groups`` (their lengths are the same).
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_size: int
    device: torch.device
    block_table: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    max_block_id: int
    workspace: GatherWorkspace
    layouts: dict[PlanKey, GatherLayout] = attrs.field(factory=dict)
    _plans: dict[PlanKey, GatherPlan] = attrs.field(factory=dict, init=False)
    _subsets: dict[tuple[int, ...], tuple[PagedMetadata, torch.Tensor]] = attrs.field(
        factory=dict, init=False
    )

    @property
    def num_requests(self) -> int:
        """Requests in the batch."""
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch (the sum of query_lens)."""
        return int(self.slot_mapping.numel())

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        workspace: GatherWorkspace | None = None,
    ) -> PagedMetadata:
        """Validate one step's lengths and tables and compute the slot mapping.

        Pass the same ``workspace`` every step (one per executor is enough, since layers
        attend one at a time); without one, each step allocates fresh gather buffers.

        Raises:
            KernelInputError: lengths disagree, a query_len is < 1 or exceeds its
                context_len, a table is too short for its context, or a new token would be
                written into the null block.
        """
        (meta,) = cls.build_groups(
            query_lens, context_lens, [block_tables], block_size, device, workspace=workspace
        )
        return meta

    @classmethod
    def build_groups(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        group_tables: Sequence[Sequence[Sequence[int]]],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        workspace: GatherWorkspace | None = None,
        sparse: Sequence[bool] = (),
    ) -> list[PagedMetadata]:
        """One metadata per KV group of a step: ``group_tables[g]`` is group g's tables.

        Positions and the lengths-only part of the gather plans are computed once and
        shared; each group only looks up its own pages. Raises as ``build`` does, but for
        the groups ``sparse`` marks, whose tables hold pages only in some blocks (DeepSeek
        V4's entries of several blocks): their tokens elsewhere map to the null block,
        which their layers never write.
        """
        for tables in group_tables:
            _check_lengths(query_lens, context_lens, tables, block_size)
        dev = torch.device(device)
        q_lens = torch.tensor(list(query_lens), dtype=torch.long)
        ctx_lens = torch.tensor(list(context_lens), dtype=torch.long)
        request_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
        first_token = torch.cumsum(q_lens, 0) - q_lens
        positions = (
            torch.arange(int(q_lens.sum()))
            - first_token[request_of_token]
            + (ctx_lens - q_lens)[request_of_token]
        )
        columns, offsets = positions // block_size, positions % block_size
        offsets_dev, positions_dev = offsets.to(dev), positions.to(dev)
        q_tuple = tuple(int(n) for n in query_lens)
        ctx_tuple = tuple(int(n) for n in context_lens)
        layouts: dict[PlanKey, GatherLayout] = {}
        shared = GatherWorkspace() if workspace is None else workspace
        out = []
        for index, tables in enumerate(group_tables):
            table = _table(tables)
            pages = table[request_of_token, columns]
            holes = index < len(sparse) and sparse[index]
            if not holes and bool((pages == 0).any()):
                bad = int(request_of_token[pages == 0][0])
                raise KernelInputError(f"request {bad} would write a new token into the null block")
            out.append(
                cls(
                    query_lens=q_tuple,
                    context_lens=ctx_tuple,
                    block_size=block_size,
                    device=dev,
                    block_table=table,
                    positions=positions_dev,
                    slot_mapping=(pages * block_size + offsets).to(dev),
                    write_blocks=pages.to(dev),
                    write_offsets=offsets_dev,
                    max_block_id=int(table.max()),
                    workspace=shared,
                    layouts=layouts,
                )
            )
        return out

    def subset(self, requests: Sequence[int]) -> tuple[PagedMetadata, torch.Tensor]:
        """The metadata of ``requests`` alone (in that order), and the indices of their
        tokens in this step's tokens (on ``device``); built on first use and kept, so
        the layers of a group that split their batch alike split it once a step."""
        key = tuple(requests)
        found = self._subsets.get(key)
        if found is None:
            firsts = [0, *itertools.accumulate(self.query_lens)]
            tokens = [t for i in key for t in range(firsts[i], firsts[i + 1])]
            meta = PagedMetadata.build(
                [self.query_lens[i] for i in key],
                [self.context_lens[i] for i in key],
                self.block_table[list(key)].tolist(),
                self.block_size,
                self.device,
                workspace=self.workspace,
            )
            found = (meta, torch.tensor(tokens, dtype=torch.long, device=self.device))
            self._subsets[key] = found
        return found

    def plan(
        self,
        geometry: CacheGeometry,
        *,
        num_queries_per_kv: int,
        sliding_window: int | None,
        live_spans: LiveSpans | None = None,
    ) -> GatherPlan:
        """The gather plan for this cache geometry, GQA group and keys, built on first use.

        Keys are a window (``sliding_window``, None: every earlier key) or, with
        ``live_spans``, the spans it names (see ``span_mask``). Layers passing the same
        ``live_spans`` object share one plan: pass one callable per policy, not per layer.
        """
        key = (geometry, num_queries_per_kv, sliding_window, live_spans)
        plan = self._plans.get(key)
        if plan is None:
            layout = self.layouts.get(key)
            if layout is None:
                layout = GatherLayout.build(
                    query_lens=self.query_lens,
                    context_lens=self.context_lens,
                    geometry=geometry,
                    num_queries_per_kv=num_queries_per_kv,
                    sliding_window=sliding_window,
                    live_spans=live_spans,
                    device=self.device,
                )
                self.layouts[key] = layout
            plan = layout.bind(self.block_table, self.workspace)
            self._plans[key] = plan
        return plan


def _table(block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[num_requests, max(max_blocks, 1)]`` int64, rows right-padded with the null block."""
    width = max(1, max((len(t) for t in block_tables), default=0))
    table = torch.tensor([[*row, *([0] * (width - len(row)))] for row in block_tables])
    if bool((table < 0).any()):
        raise KernelInputError("block tables hold a negative page id; the null block is 0")
    return table.to(torch.long)


def _check_lengths(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> None:
    if not query_lens:
        raise KernelInputError("a step needs at least one request, got none")
    if block_size < 1:
        raise KernelInputError(f"block_size must be >= 1, got {block_size}")
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise KernelInputError(
            f"{len(query_lens)} query_lens, {len(context_lens)} context_lens and "
            f"{len(block_tables)} block_tables: one of each per request"
        )
    for i, (q_len, ctx_len, row) in enumerate(
        zip(query_lens, context_lens, block_tables, strict=True)
    ):
        if not 1 <= q_len <= ctx_len:
            raise KernelInputError(
                f"request {i}: query_len {q_len} must be >= 1 and <= context_len {ctx_len}"
            )
        needed = -(-ctx_len // block_size)
        if len(row) < needed:
            raise KernelInputError(
                f"request {i}: block table has {len(row)} entries, context_len {ctx_len} "
                f"needs {needed} blocks of {block_size}"
            )
