"""Hybrid cliffs: prefix hits and capacity of real-size Mamba2 hybrids, two page sizes
against one.

A real Mamba2 state is megabytes. With one page size for every group, the planner raises
the block size until an attention page holds a state (what vLLM does): the 16 tokens asked
for become a block of hundreds of tokens or more, every group caches in units of that
block and short prompts never hit, the cliff vLLM users report (vLLM #40696: 528-token
blocks, no hits below them; #45238: a 1,500-token shared prefix and 700-token suffixes at
block 528, 0 of 64 requests hit; #48402). With two page sizes (the default), attention
keeps the 16-token block and a state takes a span of K/V pages (``memory/spans.py``). This
script runs both layouts of three models side by side, at ``--kv-memory`` (8 GiB) and
``--block-size`` (16) asked for:

1. **First repeat of a prompt** of 100, 300, 500, 1,000 and 3,000 tokens: tokens hit on
   the repeat. Goal (the issue's): ``(len - 1) // 16 * 16``.
2. **vLLM #45238's workload**: 64 requests queued at once, a 1,500-token shared prefix and
   700-token unique suffixes: requests that hit, tokens hit. Goal: every request but the
   first hits the prefix to its last 16-token boundary (1,488 tokens).
3. **An 8-turn chat of 16 sessions** (``multisession.py``'s workload: its ``Session``, its
   defaults: a 2,000-token system prompt each, messages of 50-150 tokens, replies of
   100-300, 4 requests in flight, turns queued round-robin): prefix hit rate of turns 2-8,
   against the full-attention layout of the same model (every layer an attention layer of
   the model's attention shape, one full-attention group, in the same bytes: no state,
   so no state cliff). Goal: within 0.02 of it.
4. **Capacity**: requests of 4k and 32k tokens that fit in the budget at once (the
   planner's ``describe`` report: every group at its peak), and the bytes a request holds
   over the bytes of its live state and K/V (its K/V and one state per Mamba2 layer;
   padding, empty slots, partial blocks and the extra state pages a mamba group holds make
   the rest). Also measured: requests our KVCacheManager holds at once when each prompt is
   prefilled in 2,048-token chunks, as the engine runs it, with the pool's bytes those
   requests hold as padding (``waste``: page bytes beyond the K/V of the tokens and one
   state per state page), and requests vLLM's manager admits when each allocates its
   whole prompt in one call (its admission gate). Goal: at least as many as one page size
   fits, waste under 5% of the pool.

Workloads 1-3 run through ``EngineCore`` with the checking ``FakeExecutor`` (every step's
state pages are checked against the contract, and every request's tokens against the fake
model's reference) at the plan's pool. With vLLM 0.33.0 obtainable, its own
``KVCacheManager`` serves the same requests (same prompts, the same fake tokens, same
order, in-flight limit and token budget) through ``_vllm_reference.ReferenceAllocator``,
driven the way vLLM's scheduler drives it: running requests first, then admissions with
a prefix lookup, the newest running request preempted when one cannot grow, and, where
the layout has mamba groups, each prefill chunk clipped by vLLM's own
``Scheduler._mamba_block_aligned_split``. Its mamba groups are ``MambaSpec`` groups as
vLLM builds them for a Mamba2 mixer with prefix caching on: ``mamba_cache_mode="align"``
(vLLM switches to it whenever prefix caching is enabled), a prefill checkpoint block, the
plan's block size (``prefix_match_unit`` unset, so hashes are per block as in vLLM's
default). Where vLLM refuses a layout the cell reads ``refused: <its error>`` (``not
driven: <why>`` where the adapter cannot express it).

Models, with the fields ``models/specs.py`` reads written in as the published config.json
values (``benchmarks/common/layouts.py``: Granite 4.0-H Tiny, Bamba 9B, Nemotron-H 8B, and
the mixers beyond Mamba2 at ``hybridkv plan``'s shapes). Their memories come from
``layer_specs_from_config``, so the state bytes are what the executor would lay out
(float32 conv and SSM state); layers that keep nothing (Nemotron-H's 24 MLP-only layers)
are left out. Unsure: Granite 4.0-H Tiny's attention layer indices (written 5, 15, 25, 35)
and the exact places of Nemotron-H's ``*`` layers; neither changes the layout, which
depends on the counts only.

The layouts come from one function, :func:`build_layout` (``plan_layout``, two page sizes,
or ``one_page``: ``unify_page_size``); everything else takes the block size and page bytes
of each group from :func:`group_pages` (whose ``_group_page`` is the one reader of the
plan's page sizes). vLLM runs at the one-page layout, which is the layout it plans itself
(its state pages are one page each; ``ReferenceAllocator`` has no state spans).

vLLM is never installed: unless ``--reference-src DIR`` names an unpacked source tree,
the script fetches the ``vllm==0.33.0`` wheel with ``pip download --no-deps`` into a cache
outside the repository (``$HYBRIDKV_PEER_DIR``, else ``hybridkv-peers`` in the XDG cache
folder, as ``llama_peers.py``), unzips its ``vllm/*.py`` there once, and imports them with
``_vllm_source.load`` (which needs msgspec and pydantic: ``pip install -e '.[bench]'``).
Where that fails, it says so and prints hybridkv's numbers alone; ``--no-reference``
skips vLLM.

Sizes: the issue's prompts, ``multisession.py``'s chat and 8-token replies elsewhere keep a
full run (three models, both allocators, four workloads) well inside five minutes on two
shared cores once the wheel (336 MB) is fetched (the time of a run: docs/benchmarks.md);
every number is deterministic (``--seed``).

    python -m benchmarks.hybrid.cliffs [--reference-src DIR | --no-reference] [--json FILE]

``--json FILE`` writes every number printed, the plans' block and page sizes, and the
command (``benchmarks/results/hybrid_cliffs.json``).

Results: docs/benchmarks.md, section "Real-size hybrid states: two page sizes against
one".
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from typing import Any

import structlog

from benchmarks.common.layouts import (
    MODELS,
    build_layout,
    hybrid_layout,
    model_specs,
    uniform_layout,
)
from benchmarks.common.results import add_json_argument, write_json
from benchmarks.hybrid.capacity import capacity
from benchmarks.hybrid.report import describe_plan, print_report
from benchmarks.hybrid.vllm_mamba import VLLM_VERSION, load_reference, run_vllm
from benchmarks.hybrid.workloads import (
    CAPACITY_TOKENS,
    GOAL_BLOCK,
    REPEAT_LENGTHS,
    chat_jobs,
    repeat_jobs,
    run_ours,
    shared_prefix_jobs,
)
from hybridkv.memory.sizes import parse_size

GiB = 1 << 30


def main() -> None:
    args = parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    t0 = time.perf_counter()
    budget = parse_size(args.kv_memory)
    vllm, loaded = load_reference(args, args.vllm_version)
    rng = random.Random(args.seed)
    chat, chat_settings = chat_jobs(args.seed)
    workloads = {
        "repeat": (repeat_jobs(rng, args.output_tokens), 1, args.budget),
        "shared_prefix": (shared_prefix_jobs(rng, args), args.requests, args.budget),
        "chat": (chat, chat_settings["in_flight"], chat_settings["budget"]),
    }
    models = args.models
    plans, results = {}, {}
    for name in models:
        specs = model_specs(name)
        plan = build_layout(name, budget, args.block_size)
        one = build_layout(name, budget, args.block_size, one_page=True)
        plans[name] = {
            "two_level": describe_plan(name, plan, specs, args.block_size),
            "one_page": describe_plan(name, one, specs, args.block_size),
        }
        layouts = {
            "hybrid": hybrid_layout(name, plan, specs),
            "one_page": hybrid_layout(name, one, specs),
            "uniform": uniform_layout(plan, specs),
        }
        row: dict[str, Any] = {}
        for workload, (jobs, in_flight, step_budget) in workloads.items():
            wanted = ["hybrid", "one_page"] + (["uniform"] if workload == "chat" else [])
            for key in wanted:
                cell = row.setdefault(workload, {}).setdefault(key, {})
                cell["hybridkv"] = run_ours(layouts[key], jobs, in_flight, step_budget)
                # vLLM plans its own layout: one page size, the block raised (one_page).
                if vllm is not None and key != "hybrid":
                    cell["vllm"] = run_vllm(vllm, layouts[key], jobs, in_flight, step_budget)
        row["capacity"] = {
            str(t): capacity(layouts["hybrid"], plan, specs, t, None, budget)
            for t in CAPACITY_TOKENS
        }
        row["capacity_one_page"] = {
            str(t): capacity(layouts["one_page"], one, specs, t, vllm, budget)
            for t in CAPACITY_TOKENS
        }
        results[name] = row
    elapsed = time.perf_counter() - t0

    print_report(args, plans, results, vllm, loaded, budget, chat_settings, elapsed)
    settings = {
        "kv_memory": args.kv_memory,
        "budget_bytes": budget,
        "block_size_asked": args.block_size,
        "goal_block_size": GOAL_BLOCK,
        "kv_dtype": "bfloat16",
        "state_dtype": "float32",
        "seed": args.seed,
        "repeat": {"lengths": list(REPEAT_LENGTHS), "output_tokens": args.output_tokens,
                   "budget": args.budget},
        "shared_prefix": {"requests": args.requests, "prefix_tokens": args.prefix_tokens,
                          "suffix_tokens": args.suffix_tokens,
                          "output_tokens": args.output_tokens, "budget": args.budget},
        "chat": chat_settings,
        "capacity_tokens": list(CAPACITY_TOKENS),
    }  # fmt: skip
    reference = {
        "loaded": vllm is not None,
        "version": getattr(vllm, "version", None),
        "status": loaded,
        "mamba_groups": "MambaSpec, mamba_cache_mode align, num_prefill_checkpoint_blocks 1, "
        "prefill_checkpoint_alignment 1, hash_block_size = block size",
    }
    write_json(
        args.json,
        {
            "settings": settings,
            "vllm": reference,
            "plans": plans,
            "results": results,
            "run_seconds": round(elapsed, 1),
        },
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-memory", default="8GiB", help="KV memory of the device (8GiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block asked for")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--budget", type=int, default=2048, help="tokens a step (workloads 1, 2)")
    p.add_argument("--output-tokens", type=int, default=8, help="reply tokens (workloads 1, 2)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--suffix-tokens", type=int, default=700)
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--reference-src", help="an unpacked vLLM source tree (holding vllm/)")
    ref.add_argument("--no-reference", action="store_true", help="hybridkv's numbers only")
    p.add_argument("--vllm-version", default=VLLM_VERSION, help=f"vLLM's ({VLLM_VERSION})")
    p.add_argument("--seed", type=int, default=0)
    add_json_argument(p)
    return p.parse_args()


if __name__ == "__main__":
    main()
