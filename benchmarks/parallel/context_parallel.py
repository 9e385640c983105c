"""Context parallelism on the CPU: long-prompt prefill time at cp = 1 and 2, bytes on the ring.

A random-weight Llama-shaped model (4 layers, hidden 256, 8 query heads over 2 KV heads of
64, float32) prefills one long prompt in one step:

  cp = 1, 1 thread     ModelExecutor (paged SDPA), the baseline
  cp = 1, 2 threads    the same on both cores (what cp = 2 competes with on 2 cores)
  cp = 2, 1 thread     PipelineExecutor(context_parallel_size=2): two gloo processes,
                       2 x cp chunks, pass-KV ring overlapped with partial attention

and then a chunk of new tokens after a long cached prefix (a chunked prefill), where the
ring also carries the cached keys the chunk reads, and the paper's rule would pass Q.

Each setting runs ``--repeats`` times, round robin (the machine is shared); per prompt it
prints the median time of each, the speed-up of cp = 2 over one thread as the median of
the per-round ratios with their range, and the parallel efficiency (speed-up / 2).

Bytes: what rank 0 sent for the prefill per step (K/V around the ring, and with pass-Q
the queries around the ring and the partial outputs back), against the paper's formulas
(arXiv 2411.01783), per layer and rank: pass-KV sends its K/V shard to the next rank
cp - 1 times, ``(cp - 1) * (T + P)/cp * 2 * NKV * D * e`` (T new tokens, P cached ones
read); pass-Q sends ``(cp - 1) * T/cp * NH * D * e`` of queries, plus the partial outputs
back (float32, with the lse) and here the new K/V as well (their round-robin owners store
them). The engine picks the one that sends fewer bytes, per layer.

    python -m benchmarks.parallel.context_parallel             # the full run
    python -m benchmarks.parallel.context_parallel --quick     # a smoke run

The last line printed is one JSON object.

Results, and how long the full run takes: docs/benchmarks.md, section "Context
parallelism: long-prompt prefill".
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.parallel.context_shards import prefill_chunks
from hybridkv.parallel.pipeline_executor import PipelineExecutor
from hybridkv.scheduler import SamplingParams
from hybridkv.scheduler.batch import StepBatch, StepRequest

MODEL: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 16384,
}
BLOCK_SIZE = 16
KV_BYTES = 256 << 20
DTYPE_BYTES = 4


def make_checkpoint(folder: Path) -> Path:
    """A random-weight Llama checkpoint, made on a short-lived thread (see throughput.py:
    the main thread then starts no OpenMP team of its own)."""

    def make() -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(folder)

    worker = threading.Thread(target=make)
    worker.start()
    worker.join()
    return folder


def _request(tokens: list[int], start: int, num: int, block_size: int) -> StepBatch:
    """A step running ``tokens[start : start + num]`` of one request, pages 1, 2, ..."""
    end = start + num
    table = list(range(1, -(-end // block_size) + 1))
    request = StepRequest(
        request_id="r", token_ids=tokens[start:end], start_position=start,
        block_tables=[table], sample=True, params=SamplingParams(temperature=0.0),
        output_index=0,
    )  # fmt: skip
    return StepBatch((request,))


def _sent(counters: Any) -> int:
    """Bytes rank 0 sent for prefills: K/V, queries and partial outputs."""
    return int(counters.ring_bytes + counters.query_bytes + counters.partial_bytes)


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def ring_formulas(new: int, cached: int, cp: int) -> dict[str, float]:
    """Bytes one rank sends per step by the paper's formulas (all layers)."""
    layers, heads = MODEL["num_hidden_layers"], MODEL["num_attention_heads"]
    kv_heads, head_dim = MODEL["num_key_value_heads"], MODEL["head_dim"]
    hops = (cp - 1) / cp
    kv = 2 * kv_heads * head_dim * DTYPE_BYTES * layers
    queries = hops * new * heads * head_dim * DTYPE_BYTES * layers
    outputs = hops * new * heads * (head_dim + 1) * 4 * layers
    return {
        "pass_kv": hops * (new + cached) * kv,
        "pass_q": hops * new * kv + queries + outputs,
        "pass_q_paper": queries,  # the paper counts the queries only
    }


def measure(path: Path, prompts: list[tuple[int, int]], repeats: int) -> list[dict[str, Any]]:
    """Per (cached, new) prompt: times of every setting, round robin, and ring bytes."""
    one = ModelExecutor.from_pretrained(
        path, LoadOptions(kv_cache_bytes=KV_BYTES, block_size=BLOCK_SIZE, num_threads=1)
    )
    two_threads = ModelExecutor.from_pretrained(
        path, LoadOptions(kv_cache_bytes=KV_BYTES, block_size=BLOCK_SIZE, num_threads=2)
    )
    rows = []
    options = LoadOptions(kv_cache_bytes=KV_BYTES, block_size=BLOCK_SIZE, num_threads=1)
    with PipelineExecutor.from_pretrained(
        path, options, pipeline_parallel_size=1, context_parallel_size=2, step_timeout_s=600.0
    ) as cp2:
        counters = cp2.stage0.ranks.counters  # type: ignore[union-attr]
        virtual = cp2.pool.block_size
        for cached, new in prompts:
            tokens = torch.randint(3, MODEL["vocab_size"], (cached + new,)).tolist()

            times: dict[str, list[float]] = {"cp1": [], "cp1_2threads": [], "cp2": []}
            ring: list[int] = []
            for round_ in range(repeats + 1):  # the first round warms up
                if cached:  # the prefix is cached before the timed chunk
                    one.execute(_request(tokens, 0, cached, BLOCK_SIZE))
                    two_threads.execute(_request(tokens, 0, cached, BLOCK_SIZE))
                    cp2.execute(_request(tokens, 0, cached, virtual))
                step, virtual_step = (
                    _request(tokens, cached, new, bs) for bs in (BLOCK_SIZE, virtual)
                )
                t1 = timed(functools.partial(one.execute, step))
                t12 = timed(functools.partial(two_threads.execute, step))
                before = _sent(counters)
                t2 = timed(functools.partial(cp2.execute, virtual_step))
                if round_:
                    times["cp1"].append(t1)
                    times["cp1_2threads"].append(t12)
                    times["cp2"].append(t2)
                    ring.append(_sent(counters) - before)
            ratios = [a / b for a, b in zip(times["cp1"], times["cp2"], strict=True)]
            chunks = prefill_chunks(cached, new, 2)
            rank0_tokens = len(chunks[0]) + len(chunks[3])
            formulas = ring_formulas(new, cached, 2)
            rows.append(
                {
                    "cached": cached,
                    "new": new,
                    "median_s": {k: statistics.median(v) for k, v in times.items()},
                    "speedup_median": statistics.median(ratios),
                    "speedup_range": [min(ratios), max(ratios)],
                    "efficiency": statistics.median(ratios) / 2,
                    "speedup_vs_2_threads": statistics.median(
                        [a / b for a, b in zip(times["cp1_2threads"], times["cp2"], strict=True)]
                    ),
                    "ring_bytes_rank0": statistics.median(ring),
                    "rank0_new_tokens": rank0_tokens,
                    **{f"formula_{k}": v for k, v in formulas.items()},
                }
            )
            print(f"{cached} cached + {new} new: done", file=sys.stderr)
    one.close()
    two_threads.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short prompts, one round")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (5)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.quick:
        prompts, repeats = [(0, 512), (512, 128)], 1
    else:
        prompts, repeats = [(0, 2048), (0, 4096), (3584, 512)], args.repeats
    with tempfile.TemporaryDirectory() as folder:
        rows = measure(make_checkpoint(Path(folder)), prompts, repeats)
    mib = 1 << 20
    print(f"{'cached':>6} {'new':>5} {'cp1 1t s':>9} {'cp1 2t s':>9} {'cp2 s':>7} "
          f"{'speed-up (range)':>20} {'eff.':>5} {'vs 2t':>6} {'sent MiB':>9} "
          f"{'pass-KV MiB':>11} {'pass-Q MiB':>10} {'paper Q MiB':>11}")  # fmt: skip
    for r in rows:
        t = r["median_s"]
        low, high = r["speedup_range"]
        print(
            f"{r['cached']:>6} {r['new']:>5} {t['cp1']:>9.3f} {t['cp1_2threads']:>9.3f} "
            f"{t['cp2']:>7.3f} {r['speedup_median']:>7.2f} ({low:.2f}-{high:.2f}) "
            f"{r['efficiency']:>5.2f} {r['speedup_vs_2_threads']:>6.2f} "
            f"{r['ring_bytes_rank0'] / mib:>9.2f} {r['formula_pass_kv'] / mib:>11.2f} "
            f"{r['formula_pass_q'] / mib:>10.2f} {r['formula_pass_q_paper'] / mib:>11.2f}"
        )
    print(json.dumps({"model": MODEL, "repeats": repeats, "rows": rows}))


if __name__ == "__main__":
    main()
