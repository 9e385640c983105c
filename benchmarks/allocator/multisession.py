"""Prefix cache under pressure: independent chat sessions served round-robin.

The workload of vLLM issue 48435, generated here: ``--sessions`` independent chats of
``--turns`` turns each, every session with its own ``--system-tokens`` system prompt;
turn t's prompt is the whole conversation so far plus a new user message, and its reply
joins the next turn's prompt. Turns are queued round-robin (every session's turn 1, then
every session's turn 2, ...; a session's next turn is queued when its reply ends) and at
most ``--in-flight`` requests run at once, so a session comes back only after every
other one was served: the least recently used prefix is always the next one needed.

The pool holds the sessions' working set divided by an occupancy, under two definitions
of the working set (``--working-set``; both are printed by default):

- peak (vLLM issue 48435's): what every session holds at its longest, in every group:
  ``KVCacheManager.num_blocks_needed`` of its last turn's length (every block in a
  full-attention group, a window's worth in a sliding-window one). Occupancy 1.0 is a
  pool that can keep every session resumable to the end and no more.
- mean: the pages the sessions' prefixes need to be resumed (``prefix_pages``), averaged
  over the turns a next turn resumes from. The peak definition puts the layouts under
  unequal pressure: a session's windows cost the same from its first turn on, so after
  turn 1 the hybrid's prefixes already need a larger share of its peak than full
  attention's do (``--per-turn`` prints the shares), and at equal peak occupancy the
  hybrid's pool is fuller at every turn but the last. Equal mean occupancy is equal
  pressure averaged over the run.

The allocator is driven with the verbs of ``allocator.py``'s replay (lookup, admit,
extend, append, free), by a loop that follows the engine's planner: running requests
first (chunked prefill within a token budget, one token per decode; when one cannot
grow, the newest other running request is preempted and recomputed later), then
admissions in queue order, each with a prefix lookup. A prefill chunk is first shortened
as the planner does (``KVCacheManager.spare_chunk``, not below ``--min-chunk``) where a
shorter one spares a kept prefix its pages; vLLM's scheduler never does.

Printed: the prefix hit rate of turns 2 to the last (cached prompt tokens over prompt
tokens, at each turn's first admission) per layout and occupancy, and the allocator's
time per step (``perf_counter_ns`` around each of the step's calls to it, appending
sampled tokens included as in ``allocator.py``: vLLM hashes blocks there; mean over
steps). Under the hit
rates, a *capacity estimate* per layout (``capacity_estimate``): what an eviction order
could reach if the pool could be shared out among the waiting sessions' prefixes at will.
With ``--per-turn``, also each turn's hit rate and the pages the sessions' prefixes need
after each turn, over the working set (the pool must hold that to let every next turn
hit). With ``--reference-src DIR`` (a vLLM source tree, see ``common/vllm_reference.py``),
vLLM's own KVCacheManager serves the same workload in a run of its own.

    python -m benchmarks.allocator.multisession [--repeats N] [--per-turn] [--reference-src DIR]
                                      [--hybrid gemma3|gpt-oss] [--json FILE]

``--hybrid gpt-oss`` compares gpt-oss's layers (sliding of 128 and full alternating: one
group of each) with full attention instead of the Gemma-3-like 1 full + 5 sliding.

The last line printed is one JSON object: per working-set definition, allocator, layout
and occupancy the hit rate, preemptions and the allocator's microseconds per step (the
best of the repeats). ``--json FILE`` writes the same object to FILE, with the workload's
settings and the command (``benchmarks/common/plot.py`` draws the hit rates from it).

Other benchmarks reuse the workload: ``parse_args([])`` gives the defaults, ``Session``
generates a chat, and ``Run(make, LAYOUTS[name], occupancy, args).run()`` serves it
through any allocator with ``OursAllocator``'s verbs (``make(groups, num_blocks)``).

Results: docs/benchmarks.md, section "Prefix cache under pressure: chat sessions served
round-robin".
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

import attrs

from benchmarks.allocator.allocator import OursAllocator
from benchmarks.allocator.multisession_run import (
    BLOCK_SIZE,
    GPT_OSS,
    LAYOUTS,
    OCCUPANCIES,
    WINDOW,
    Run,
)
from benchmarks.common.results import add_json_argument, write_json
from hybridkv.scheduler.config import EngineConfig


def allocators(args: argparse.Namespace) -> dict[str, Any]:
    """Name -> factory(groups, num_blocks) of each allocator to run."""
    kw = {"max_model_len": 1 << 20, "hash_name": "sha256", "reserve_full_isl": False}
    out: dict[str, Any] = {
        "hybridkv": lambda groups, num: OursAllocator(groups, num, BLOCK_SIZE, **kw)
    }
    if args.reference_src:
        import benchmarks.common.vllm_reference as _vllm_reference

        vllm = _load_reference(args.reference_src)
        out[f"vLLM {vllm.version}"] = lambda groups, num: _vllm_reference.ReferenceAllocator(
            vllm, groups, num, BLOCK_SIZE, **kw
        )
    return out


@functools.cache
def _load_reference(src: str) -> Any:
    """vLLM's modules from ``src``, imported once (both working-set definitions use them)."""
    import benchmarks.common.vllm_reference as _vllm_reference

    return _vllm_reference.load(src)


def measure(make: Any, groups: list[dict[str, Any]], occupancy: float, args: Any) -> Any:
    """The hit rates of one run (they never vary); the times, the best of the repeats."""
    runs = [Run(make, groups, occupancy, args).run() for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["step_us_mean"])
    best["step_us_means"] = [r["step_us_mean"] for r in runs]
    return best


def main() -> None:
    args = parse_args()
    print(
        f"{args.sessions} sessions x {args.turns} turns round-robin, {args.in_flight} in flight;"
        f" system prompt {args.system_tokens} tokens, messages {args.user_tokens[0]}-"
        f"{args.user_tokens[1]}, replies {args.reply_tokens[0]}-{args.reply_tokens[1]};"
        f" block {BLOCK_SIZE}, window {WINDOW}, {args.budget} tokens a step"
    )
    definitions = ("peak", "mean") if args.working_set == "both" else (args.working_set,)
    out = {}
    for definition in definitions:
        args.definition = definition
        print(f"\n== working set: {definition}")
        out[definition] = report(args)
    print(json.dumps(out, separators=(",", ":")))
    workload = {
        key: getattr(args, key)
        for key in ("sessions", "turns", "system_tokens", "user_tokens", "reply_tokens",
                    "in_flight", "budget", "min_chunk", "repeats", "seed", "occupancy")
    }  # fmt: skip
    workload |= {"block_size": BLOCK_SIZE, "window": WINDOW}
    write_json(args.json, {"workload": workload, "working_sets": out})


def report(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """Every allocator and layout at every occupancy, under ``args.definition``; printed."""
    occ = [str(o) for o in args.occupancy]
    layouts = LAYOUTS if args.hybrid == "gemma3" else {"full": LAYOUTS["full"], **GPT_OSS}
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name, make in allocators(args).items():
        for layout, groups in layouts.items():
            row = {str(o): measure(make, groups, o, args) for o in args.occupancy}
            results[f"{layout}, {name}"] = row
    width = max(*map(len, results), *(len(f"{lay}, capacity estimate") for lay in layouts)) + 2
    head = f"{'occupancy':<{width}}" + "".join(f"{o:>8}" for o in occ)
    print(f"prefix hit rate over turns 2-{args.turns}\n{head}")
    for label, row in results.items():
        print(f"{label:<{width}}" + "".join(f"{row[o]['hit_rate']:>8.3f}" for o in occ))
    full, hybrid = (results[f"{layout}, hybridkv"] for layout in layouts)
    gaps = "".join(f"{full[o]['hit_rate'] - hybrid[o]['hit_rate']:>8.3f}" for o in occ)
    print(f"{'full minus hybrid, hybridkv':<{width}}{gaps}")
    for layout, row in zip(layouts, (full, hybrid), strict=True):
        label = f"{layout}, capacity estimate"
        print(f"{label:<{width}}" + "".join(f"{row[o]['capacity_estimate']:>8.3f}" for o in occ))
    print(f"\nallocator us per step, mean over steps (best of {args.repeats} runs)\n{head}")
    for label, row in results.items():
        print(f"{label:<{width}}" + "".join(f"{row[o]['step_us_mean']:>8.1f}" for o in occ))
    print(f"\npreemptions\n{head}")
    for label, row in results.items():
        print(f"{label:<{width}}" + "".join(f"{row[o]['preemptions']:>8}" for o in occ))
    if args.per_turn:
        print("\nsessions' prefixes after each turn, in pages, over the peak working set")
        for layout in layouts:
            row = next(r for label, r in results.items() if label.startswith(layout + ","))
            shares = " ".join(f"{x:.2f}" for x in row[occ[0]]["prefix_share"])
            print(f"{layout:<{width}} {'':>5}  {shares}")
        print("\nhit rate per turn")
        for label, row in results.items():
            for o in occ:
                turns = " ".join(f"{h:.2f}" for h in row[o]["per_turn"][1:])
                print(f"{label:<{width}} {o:>5}  {turns}")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, or ``sys.argv``); ``parse_args([])``: the defaults."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--occupancy", type=float, nargs="+", default=list(OCCUPANCIES))
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--user-tokens", type=int, nargs=2, default=(50, 150), metavar=("MIN", "MAX"))
    p.add_argument("--reply-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"))
    p.add_argument("--in-flight", type=int, default=4, help="requests running at once")
    p.add_argument("--budget", type=int, default=2048, help="tokens a step (prefill chunk)")
    p.add_argument(
        "--min-chunk",
        type=int,
        default=attrs.fields(EngineConfig).min_prefill_chunk.default,
        help="fewest tokens the planner shortens a prefill chunk to, sparing kept prefixes "
        "(EngineConfig.min_prefill_chunk; a budget or more turns it off)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per cell; times: the best")
    p.add_argument("--per-turn", action="store_true", help="also print each turn's hit rate")
    p.add_argument("--reference-src", help="vLLM source tree (holding vllm/) to compare")
    p.add_argument(
        "--working-set",
        choices=("peak", "mean", "both"),
        default="both",
        help="what occupancy 1.0 holds: every session at its longest (peak), or the "
        "sessions' resumable prefixes averaged over the turns (mean: equal pressure)",
    )
    p.add_argument(
        "--hybrid",
        choices=("gemma3", "gpt-oss"),
        default="gemma3",
        help="the hybrid layout set beside full attention: Gemma 3's (1 full + 5 sliding "
        f"of {WINDOW}) or gpt-oss's (1 full + 1 sliding of 128)",
    )
    p.add_argument("--seed", type=int, default=0)
    add_json_argument(p)
    args = p.parse_args(argv)
    args.definition = "peak" if args.working_set == "both" else args.working_set

    return args


if __name__ == "__main__":
    main()
