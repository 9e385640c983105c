"""Paged attention vs SDPA over the same K/V stored contiguously, in one run.

Rows: dtype x mode.
  decode attend        paged_attention over a decode batch   vs one SDPA call on [B, Hkv, L, D]
  decode write+attend  write_kv + paged_attention            vs writing the new token into the
                                                               contiguous K/V + the SDPA call
  mixed write+attend   decodes plus one prefill chunk         vs the same SDPA calls (decodes
                       after a cached prefix                    batched, the chunk with its
                                                                end-aligned causal mask)
The contiguous baseline calls SDPA exactly as the paged path does (GQA folded into query
rows); "gqa ms" is the plain ``enable_gqa=True`` call on the same tensors, for reference.
Timings interleave paged and contiguous calls and report medians. "meta ms" is the per-step
cost of PagedMetadata.build plus the gather plan, paid once per step per KV group, with a
warm GatherWorkspace; "cold ms" is build plus one attend without a workspace, as the first
layer of a step pays it when the executor passes none (fresh buffers fault in their pages).

    python -m benchmarks.decode.attention --device cpu --dtype float32 bfloat16 --repeats 7

On a CPU machine shared with other work, ``--threads 1 --clock process`` measures CPU time
rather than wall time and is much steadier.

The last line printed is one JSON object with the ratios (paged / contiguous).

The workload, at the defaults: ``--batch`` 32 decodes at ``--context`` 2,048 tokens, 32
query and 8 KV heads of dim 128, block 16, pages in random order; the mixed rows add one
request at the same context whose last ``--prefill`` 256 tokens are a prefill chunk after
its cached prefix.

Results: docs/benchmarks.md, section "Attention: paged against contiguous SDPA" (the
ratios on each CPU kind, and where the paged time goes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridkv.kernels import GatherWorkspace, PagedMetadata, paged_attention, write_kv
from hybridkv.kernels.geometry import CacheGeometry

NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 32, 128, 16


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    print(
        f"device={device} threads={torch.get_num_threads()} batch={args.batch} "
        f"context={args.context} kv_heads={NUM_KV_HEADS} q_heads={NUM_Q_HEADS} "
        f"head_dim={HEAD_DIM} block={BLOCK_SIZE} repeats={args.repeats} clock={args.clock}"
    )
    print(
        f"{'dtype':<9} {'mode':<20} {'paged ms':>9} {'contig ms':>9} {'ratio':>6} "
        f"{'gqa ms':>8} {'meta ms':>8} {'cold ms':>8}"
    )
    ratios: dict[str, float] = {}
    with torch.inference_mode():
        for name in args.dtype:
            dtype = getattr(torch, name)
            for mode, prefill in (("decode", 0), ("mixed", args.prefill)):
                rows = bench(args, device, dtype, prefill)
                for sub, (paged, contig, gqa, meta, cold) in rows.items():
                    label = f"{mode} {sub}"
                    ratio = paged / contig
                    ratios[f"{name} {label}"] = round(ratio, 3)
                    print(
                        f"{name:<9} {label:<20} {paged:9.2f} {contig:9.2f} {ratio:6.2f} "
                        f"{gqa:8.2f} {meta:8.2f} {cold:8.2f}"
                    )
    print(json.dumps({"ratios": ratios}))


def bench(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, prefill: int
) -> dict[str, tuple[float, float, float, float, float]]:
    """Time one batch: ``args.batch`` decodes at ``args.context``, plus an optional chunk."""
    batch, ctx = args.batch, args.context
    q_lens = [1] * batch + ([prefill] if prefill else [])
    ctx_lens = [ctx] * batch + ([ctx] if prefill else [])
    num_req = len(q_lens)
    blocks_per_req = -(-ctx // BLOCK_SIZE)
    pages = torch.randperm(num_req * blocks_per_req) + 1  # page 0 is the null block
    tables = pages.view(num_req, blocks_per_req).tolist()
    cache = torch.randn(
        num_req * blocks_per_req + 1,
        2,
        NUM_KV_HEADS,
        BLOCK_SIZE,
        HEAD_DIM,
        dtype=dtype,
        device=device,
    )
    # The same K/V, contiguous per request: [2, R, Hkv, L, D].
    idx = torch.tensor(tables, device=device).view(-1)
    contig = cache[idx].view(num_req, blocks_per_req, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    contig = contig.permute(2, 0, 3, 1, 4, 5).reshape(2, num_req, NUM_KV_HEADS, -1, HEAD_DIM)
    contig = contig[:, :, :, :ctx].contiguous()
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    new_kv = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    scale = HEAD_DIM**-0.5
    group = NUM_Q_HEADS // NUM_KV_HEADS
    mask = None
    if prefill:
        q_pos = torch.arange(ctx - prefill, ctx, device=device)[:, None]
        mask = (torch.arange(ctx, device=device)[None, :] <= q_pos).repeat(group, 1)

    workspace = GatherWorkspace()

    def build(ws: GatherWorkspace | None = workspace) -> PagedMetadata:
        meta = PagedMetadata.build(
            q_lens, ctx_lens, tables, BLOCK_SIZE, device=device, workspace=ws
        )
        meta.plan(CacheGeometry.of(cache), num_queries_per_kv=group, sliding_window=None)
        return meta

    meta = build()

    def cold_attend() -> None:
        paged_attention(query, cache, build(None), scale=scale)

    def paged_attend() -> None:
        paged_attention(query, cache, meta, scale=scale)

    def paged_write_attend() -> None:
        write_kv(cache, new_kv[0], new_kv[1], meta)
        paged_attention(query, cache, meta, scale=scale)

    def contig_attend(fold: bool = True) -> None:
        q_dec = query[:batch]
        k, v = contig[0, :batch], contig[1, :batch]
        if fold:
            F.scaled_dot_product_attention(
                q_dec.view(batch, NUM_KV_HEADS, group, HEAD_DIM), k, v, scale=scale
            )
        else:
            F.scaled_dot_product_attention(
                q_dec.view(batch, NUM_Q_HEADS, 1, HEAD_DIM), k, v, scale=scale, enable_gqa=True
            )
        if prefill:
            q = query[batch:].view(prefill, NUM_KV_HEADS, group, HEAD_DIM).permute(1, 2, 0, 3)
            q = q.reshape(1, NUM_KV_HEADS, group * prefill, HEAD_DIM)
            F.scaled_dot_product_attention(
                q, contig[0, batch:], contig[1, batch:], attn_mask=mask, scale=scale
            )

    def contig_write_attend() -> None:
        contig[0, :batch, :, ctx - 1] = new_kv[0, :batch]
        contig[1, :batch, :, ctx - 1] = new_kv[1, :batch]
        if prefill:
            contig[0, batch, :, ctx - prefill :] = new_kv[0, batch:].transpose(0, 1)
            contig[1, batch, :, ctx - prefill :] = new_kv[1, batch:].transpose(0, 1)
        contig_attend()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    meta_ms = timed([build], args.repeats, sync, clock)[0]
    cold_ms = timed([cold_attend], min(3, args.repeats), sync, clock)[0]  # slow: page faults
    fns = [paged_attend, contig_attend, lambda: contig_attend(False)]
    attend = timed(fns, args.repeats, sync, clock)
    write = timed([paged_write_attend, contig_write_attend], args.repeats, sync, clock)
    return {
        "attend": (*attend, meta_ms, cold_ms),
        "write+attend": (*write, attend[2], meta_ms, cold_ms),
    }


def timed(
    fns: list[Callable[[], None]],
    repeats: int,
    sync: Callable[[], None],
    clock: Callable[[], float],
) -> list[float]:
    """Median milliseconds of each function, calls interleaved so that noise hits all alike."""
    samples: list[list[float]] = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, out in zip(fns, samples, strict=True):
            sync()
            start = clock()
            fn()
            sync()
            if i:  # the first round warms up allocators and kernels
                out.append((clock() - start) * 1e3)
    return [statistics.median(s) for s in samples]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "float16"],
    )
    parser.add_argument("--batch", type=int, default=32, help="decode requests")
    parser.add_argument("--context", type=int, default=2048, help="tokens per request")
    parser.add_argument(
        "--prefill", type=int, default=256, help="query tokens of the mixed rows' prefill chunk"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--clock",
        choices=["wall", "process"],
        default="wall",
        help="process: CPU time of this process, steadier on a shared CPU machine",
    )
    return parser.parse_args()


if __name__ == "__main__":
    main()
