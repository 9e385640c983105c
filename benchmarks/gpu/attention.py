"""Paged attention on the device against contiguous SDPA, FlexAttention's paged attention
and ``flash_attn`` (where installed): decode and prefill, GQA 8:1, block 16, bf16.

Every row runs the same keys and values three ways: ``paged_attention`` over pages in
random order (the engine's layout, ``[blocks, 2, kv_heads, 16, head_dim]``), one SDPA call
over the same K/V copied contiguous, and FlexAttention over the same pages in its own
``[1, kv_heads, slots, head_dim]`` layout with its page table set to ours. A decode reads
every key and value once: its bytes over its time is the bandwidth it achieves, reported
as a share of the measured copy bandwidth and of the card's published HBM bandwidth.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from benchmarks.gpu.device import Probe, time_rounds
from hybridkv.kernels import GatherWorkspace, PagedMetadata, gather_regions, paged_attention

BLOCK = 16
NUM_KV_HEADS, GROUP = 8, 8


@attrs.frozen
class Shape:
    batch: int
    context: int
    head_dim: int

    @property
    def pages(self) -> int:
        return -(-self.context // BLOCK)


@attrs.frozen
class Grid:
    decode: tuple[Shape, ...]
    prefill: tuple[Shape, ...]
    flex: frozenset[Shape]  # decode shapes FlexAttention also runs (each is a compile)


def grid(dry_run: bool) -> Grid:
    """Batch 1-64, contexts 1k-32k, head dims 64/128/256 (at most 512k cached tokens a
    row); the dry run: the same rows at toy sizes."""
    if dry_run:
        decode = tuple(Shape(b, c, d) for b in (1, 4) for c in (64, 200) for d in (64, 128))
        prefill = (Shape(1, 96, 64), Shape(2, 64, 128))
        return Grid(decode, prefill, frozenset({Shape(4, 200, 64)}))
    decode = tuple(
        Shape(b, c, d)
        for d in (128, 64, 256)
        for b in (1, 8, 64)
        for c in (1024, 8192, 32768)
        if b * c <= 1 << 19
    )
    prefill = tuple(Shape(1, c, d) for d in (128, 64, 256) for c in (1024, 8192, 32768))
    prefill += (Shape(8, 1024, 128), Shape(8, 8192, 128))
    flex = frozenset(Shape(b, 8192, 128) for b in (1, 8, 64))
    return Grid(decode, prefill, flex)


@attrs.define
class Paged:
    """One row's K/V in the engine's pages, and the same K/V contiguous."""

    cache: torch.Tensor  # [blocks, 2, kv_heads, BLOCK, head_dim]
    tables: list[list[int]]
    keys: torch.Tensor  # [batch, kv_heads, context, head_dim]
    values: torch.Tensor

    @classmethod
    def random(cls, shape: Shape, device: torch.device, dtype: torch.dtype) -> Paged:
        num_blocks = shape.batch * shape.pages + 1  # page 0 is the null block
        cache = torch.randn(
            num_blocks, 2, NUM_KV_HEADS, BLOCK, shape.head_dim, dtype=dtype, device=device
        )
        order = (
            torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
        ).tolist()
        tables = [order[i * shape.pages : (i + 1) * shape.pages] for i in range(shape.batch)]
        index = torch.tensor(tables, device=device)
        kv = cache[index].permute(2, 0, 3, 1, 4, 5)  # [2, B, Hkv, pages, BLOCK, D]
        kv = kv.reshape(2, shape.batch, NUM_KV_HEADS, -1, shape.head_dim)[:, :, :, : shape.context]
        return cls(cache, tables, kv[0].contiguous(), kv[1].contiguous())


def run(probe: Probe, dtype: torch.dtype, dry_run: bool, budget_s: float) -> dict[str, Any]:
    """Every row of the grid that fits in ``budget_s``; the rest listed as skipped."""
    device, rows, skipped = probe.device, [], []
    deadline = time.monotonic() + budget_s
    shapes = grid(dry_run)
    flex = _flex_attention(device)
    with torch.inference_mode():
        for mode, row in [("decode", s) for s in shapes.decode] + [
            ("prefill", s) for s in shapes.prefill
        ]:
            if time.monotonic() > deadline:
                skipped.append({"mode": mode, **attrs.asdict(row)})
                continue
            try:
                if mode == "decode":
                    use_flex = flex if row in shapes.flex else None
                    rows.append(_decode_row(probe, row, dtype, use_flex))
                else:
                    rows.append(_prefill_row(probe, row, dtype))
            except Exception as error:  # a row that fails is reported, the rest still run
                rows.append({"mode": mode, **attrs.asdict(row), "error": repr(error)[:300]})
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return {"rows": rows, "skipped": skipped, "flash_attn": _flash_attn_version()}


def _decode_row(
    probe: Probe, shape: Shape, dtype: torch.dtype, flex: Callable[..., torch.Tensor] | None
) -> dict[str, Any]:
    device = probe.device
    kv = Paged.random(shape, device, dtype)
    scale = shape.head_dim**-0.5
    q = torch.randn(shape.batch, NUM_KV_HEADS * GROUP, shape.head_dim, dtype=dtype, device=device)
    q4 = q[:, :, None, :]
    meta_started = time.perf_counter()
    meta = _decode_meta(shape, kv, device)
    paged_attention(q, kv.cache, meta, scale=scale)  # builds the step's gather plan
    first_call_ms = (time.perf_counter() - meta_started) * 1e3
    # The same step with the values gathered beside the keys (one SDPA call) instead of
    # read in place by embedding_bag: which of the two decode paths the device prefers.
    saved, gather_regions.VALUE_BAGS_MIN_ELEMENTS = gather_regions.VALUE_BAGS_MIN_ELEMENTS, 1 << 62
    try:
        gathered = _decode_meta(shape, kv, device)
        paged_attention(q, kv.cache, gathered, scale=scale)
    finally:
        gather_regions.VALUE_BAGS_MIN_ELEMENTS = saved
    ours: dict[str, Callable[[], torch.Tensor]] = {
        "paged": lambda: paged_attention(q, kv.cache, meta, scale=scale),
        "paged_kv_gathered": lambda: paged_attention(q, kv.cache, gathered, scale=scale),
    }
    calls: dict[str, Callable[[], object]] = {
        **ours,
        "contiguous": lambda: F.scaled_dot_product_attention(
            q4, kv.keys, kv.values, scale=scale, enable_gqa=True
        ),
    }
    expected = F.scaled_dot_product_attention(q4, kv.keys, kv.values, scale=scale, enable_gqa=True)
    error = max(float((call() - expected[:, :, 0]).float().abs().max()) for call in ours.values())
    if flex is not None:
        calls["flex_paged"] = _flex_call(flex, kv, shape, q4, scale)
        flex_out = calls["flex_paged"]()
        assert isinstance(flex_out, torch.Tensor)
        flex_error = float((flex_out - expected).float().abs().max())
    flash = _flash_call(kv, q4, scale)
    if flash is not None:
        calls["flash_attn"] = flash
    timings = time_rounds(device, calls)
    num_bytes = (
        2 * shape.batch * shape.context * NUM_KV_HEADS * shape.head_dim * kv.cache.element_size()
    )
    row = {
        "mode": "decode",
        **attrs.asdict(shape),
        "max_abs_diff": error,
        "first_call_ms": round(first_call_ms, 3),
    }
    row.update({f"{name}_ms": t.as_dict() for name, t in timings.items()})
    for name, t in timings.items():
        bandwidth = num_bytes / t.median
        row[f"{name}_gbps"] = round(bandwidth / 1e9, 1)
        row[f"{name}_of_copy_bw"] = round(bandwidth / probe.copy_bandwidth, 3)
        if probe.nominal_bandwidth:
            row[f"{name}_of_hbm"] = round(bandwidth / probe.nominal_bandwidth, 3)
    row["paged_over_contiguous"] = round(timings["paged"].median / timings["contiguous"].median, 3)
    row["kv_gathered_over_contiguous"] = round(
        timings["paged_kv_gathered"].median / timings["contiguous"].median, 3
    )
    if flex is not None:
        row["flex_max_abs_diff"] = flex_error
        row["flex_over_contiguous"] = round(
            timings["flex_paged"].median / timings["contiguous"].median, 3
        )
    return row


def _decode_meta(shape: Shape, kv: Paged, device: torch.device) -> PagedMetadata:
    lens = [shape.context] * shape.batch
    return PagedMetadata.build(
        [1] * shape.batch, lens, kv.tables, BLOCK, device, workspace=GatherWorkspace()
    )


def _prefill_row(probe: Probe, shape: Shape, dtype: torch.dtype) -> dict[str, Any]:
    device = probe.device
    kv = Paged.random(shape, device, dtype)
    scale = shape.head_dim**-0.5
    lens = [shape.context] * shape.batch
    meta = PagedMetadata.build(lens, lens, kv.tables, BLOCK, device, workspace=GatherWorkspace())
    heads = NUM_KV_HEADS * GROUP
    q = torch.randn(shape.batch, shape.context, heads, shape.head_dim, dtype=dtype, device=device)
    flat, q4 = q.view(-1, heads, shape.head_dim), q.transpose(1, 2)
    calls: dict[str, Callable[[], object]] = {
        "paged": lambda: paged_attention(flat, kv.cache, meta, scale=scale),
        "contiguous": lambda: F.scaled_dot_product_attention(
            q4, kv.keys, kv.values, scale=scale, is_causal=True, enable_gqa=True
        ),
    }
    expected = calls["contiguous"]().transpose(1, 2).reshape(flat.shape)
    error = float((calls["paged"]().float() - expected.float()).abs().max())
    timings = time_rounds(device, calls, rounds=3)
    flops = 2 * shape.batch * heads * shape.head_dim * shape.context * (shape.context + 1)
    row = {"mode": "prefill", **attrs.asdict(shape), "max_abs_diff": error}
    row.update({f"{name}_ms": t.as_dict() for name, t in timings.items()})
    row.update({f"{name}_tflops": round(flops / t.median / 1e12, 1) for name, t in timings.items()})
    row["paged_over_contiguous"] = round(timings["paged"].median / timings["contiguous"].median, 3)
    return row


def _flex_attention(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """FlexAttention, compiled on CUDA (its kernels come from the compile); eager on the
    CPU, where the dry run only checks that the calls are right."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    fn: Callable[..., torch.Tensor] = flex_attention
    if device.type == "cuda":
        return torch.compile(fn)

    def eager(*args: Any, **kwargs: Any) -> torch.Tensor:
        with warnings.catch_warnings():  # "called without torch.compile": meant here
            warnings.simplefilter("ignore", UserWarning)
            return fn(*args, **kwargs)

    return eager


def _flex_call(
    flex: Callable[..., torch.Tensor], kv: Paged, shape: Shape, q4: torch.Tensor, scale: float
) -> Callable[[], torch.Tensor]:
    """FlexAttention's paged decode over our pages: its page table is ours, its cache the
    same pages in its layout."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    device, num_blocks = kv.cache.device, kv.cache.shape[0]
    paged = PagedAttention(num_blocks, BLOCK, shape.batch, device=str(device))
    table = torch.tensor(kv.tables, device=device)
    paged.page_table[:, : shape.pages] = table
    logical = torch.arange(shape.pages, device=device).expand(shape.batch, -1)
    paged.physical_to_logical.scatter_(1, table, logical)
    paged.capacity[:] = shape.pages * BLOCK
    layout = kv.cache.permute(1, 2, 0, 3, 4).reshape(
        2, NUM_KV_HEADS, num_blocks * BLOCK, shape.head_dim
    )
    k_cache, v_cache = layout[0][None].contiguous(), layout[1][None].contiguous()
    context = shape.context

    def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < context

    logical_mask = create_block_mask(
        visible,
        shape.batch,
        None,
        1,
        shape.pages * BLOCK,
        device=str(device),
        BLOCK_SIZE=(128, BLOCK),
    )
    mask = paged.convert_logical_block_mask(logical_mask)
    return lambda: flex(q4, k_cache, v_cache, block_mask=mask, scale=scale, enable_gqa=True)


def _flash_call(kv: Paged, q4: torch.Tensor, scale: float) -> Callable[[], object] | None:
    """flash_attn's decode over the contiguous K/V, where flash_attn is installed."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    q, k, v = q4.transpose(1, 2), kv.keys.transpose(1, 2), kv.values.transpose(1, 2)
    return lambda: flash_attn_with_kvcache(q, k, v, softmax_scale=scale)


def _flash_attn_version() -> str | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return str(getattr(flash_attn, "__version__", "installed"))
