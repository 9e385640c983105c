"""Routing data-parallel replicas: prefix hits, TTFT and load balance per routing policy.

The multisession workload (``routing/workload.py``: chats whose turns resend the whole
conversation, groups of chats sharing a system prompt, chats starting over time and
coming back after a think time) served by several replicas, each request sent to one by
a routing policy:

- ``round-robin``: each request to the next replica (``RoundRobin``);
- ``least-loaded``: the fewest requests waiting and running (``LeastLoaded``);
- ``full-attention-only``: ``PrefixRouter(full_attention_only=True)``, the hit a replica's
  full-attention blocks alone promise, as Dynamo's and SGLang's routers see a replica;
- ``ours``: ``PrefixRouter``, the hit a replica resumes in every group, against its load;
- both prefix routers again with the weights the router had before this benchmark
  measured them (``BEFORE``: a memory of 65,536 blocks sent, 256 tokens a request);
- ``ours, no free pages``: ours never told a replica's free pages (what ``/load`` adds);
- ``one engine``: the reference, one engine with the pool, batch and compute of all the
  replicas (the hit rate a router should come close to).

The replicas are simulated (``routing/sim.py``): KV cache managers without a model,
stepped in modelled time (a step costs ``--step-ms`` plus ``--token-ms`` per token), their
KV events encoded in vLLM's wire format and read by the router's indexes a step late.
Scales ``--scales RxS``: R replicas, S sessions; from ``--big-from`` replicas on, sessions
have ``--big-turns`` turns and only the first ``--big-seeds`` seeds run (minutes each).
Layouts: full attention (the control), Gemma-3-like (1 full : 5 sliding-window groups,
``--window``) and Bamba-like (the planner's Mamba2 state groups and one full-attention
group). Sessions start at the rate that keeps about ``--alive`` per replica alive, and a
replica's pool holds that many at their mean length over ``--occupancy``.

Printed per scale, layout and policy, the mean over seeds and [min, max]: the prefix hit
rate (cached prompt tokens over prompt tokens at each turn's first admission), TTFT in
modelled ms (mean, p50, p90), load imbalance (the most tokens a replica computed over the
mean), preemptions; then the issue's goals for each ``ours``: a hit rate within 0.05 of
one engine's, at least 1.5x round-robin's, above the full-attention-only router's (same
weights) on the hybrid layouts, and an imbalance under 1.25; on real replicas beside smg,
a TTFT at most 1.2x smg's (also printed as the ratio of each seed's pair: median [min,
max]). ``ours, 2 front ends`` runs two ``hybridkv route`` processes, each session through
one of them (real runs only). Real runs also print the TTFT at the replicas (arrival
there to the first token: the rest is the front end's and the transport's) and the front
ends' CPU seconds, and play every policy of one seed in turn before the next seed (every other
seed in reverse), so that the policies compared share the machine's load of the same
minutes.

    python -m benchmarks.routing.policies [--quick] [--scales RxS ...] [--seeds N ...] [--jobs N]
                                 [--json FILE]

:func:`simulated` measures simulated replicas; with ``--real``, :func:`real` measures the
same policies on real ones (``routing/real.py``: ``hybridkv serve`` processes of a tiny
model of each layout behind ``hybridkv route``, and behind SGLang's model gateway
``smg`` with its cache-aware policy), in the same shape for :func:`print_table` and
:func:`goals`. Results: docs/benchmarks.md, section "Routing data-parallel replicas".
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Collection, Hashable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from benchmarks.common.results import add_json_argument, write_json
from benchmarks.routing.real import run_real, save_model, sessions
from benchmarks.routing.replica import ReplicaSpec, SimReplica
from benchmarks.routing.report import REFERENCE, goals, print_table, spread
from benchmarks.routing.sim import Simulation
from benchmarks.routing.workload import BLOCK_SIZE, HASH, Layout, Workload, layouts, make_chats
from hybridkv.scheduler.config import EngineConfig
from hybridkv.serving.router.index import ReplicaIndex
from hybridkv.serving.router.ranking import (
    LeastLoaded,
    PrefixRouter,
    ReplicaLoad,
    RoundRobin,
    Router,
    RouterWeights,
)

#: The router's defaults, and the weights it had before this benchmark measured them
#: (docs/benchmarks.md says why they changed).
BEFORE = RouterWeights(
    tokens_per_request=256.0, provisional_blocks=65_536, slack_requests=0, slack_ratio=0.0
)
WEIGHTS = {"": RouterWeights(), ", before": BEFORE}
#: Ours blind to free pages: what the replicas' ``/load`` adds.
BLIND = "ours, no free pages"
POLICIES = (
    "round-robin",
    "least-loaded",
    *(f"{router}{suffix}" for suffix in WEIGHTS for router in ("full-attention-only", "ours")),
    BLIND,
)


@attrs.frozen
class Scale:
    """Replicas and the sessions they serve."""

    num_replicas: int
    workload: Workload
    seeds: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.num_replicas} replicas, {self.workload.num_sessions} sessions"


def scales(args: argparse.Namespace) -> list[Scale]:
    """Each ``--scales`` entry with its workload and seeds."""
    out = []
    for entry in args.scales:
        num_replicas, num_sessions = map(int, entry.split("x"))
        is_big = num_replicas >= args.big_from
        turns = args.big_turns if is_big else args.turns
        # A session lasts its turns' think times and replies (a decode step a token, at
        # about a full batch): this rate keeps about --alive a replica alive.
        reply_ms = sum(args.reply_tokens) / 2 * (args.step_ms + args.token_ms * args.max_running)
        rate = num_replicas * args.alive / (turns * (args.think_ms + reply_ms))
        workload = Workload(
            num_sessions=num_sessions,
            num_turns=turns,
            sessions_per_prompt=args.sessions_per_prompt,
            system_tokens=args.system_tokens,
            user_tokens=tuple(args.user_tokens),
            reply_tokens=tuple(args.reply_tokens),
            think_ms=args.think_ms,
            sessions_per_ms=rate,
        )
        seeds = tuple(args.seeds[: args.big_seeds] if is_big else args.seeds)
        out.append(Scale(num_replicas, workload, seeds))
    return out


def replica_spec(layout: Layout, workload: Workload, args: argparse.Namespace) -> ReplicaSpec:
    """A replica whose pool holds ``--alive`` sessions at their mean length over
    ``--occupancy`` (and twice the longest turn at least)."""
    mean_pages = layout.pages_needed(round(workload.mean_length()))
    longest = workload.system_tokens + workload.num_turns * (
        workload.user_tokens[1] + workload.reply_tokens[1]
    )
    num_blocks = max(
        math.ceil(args.alive * mean_pages / args.occupancy), 2 * layout.pages_needed(longest)
    )
    return ReplicaSpec(
        num_blocks=num_blocks + 1,
        budget=args.budget,
        max_running=args.max_running,
        min_chunk=args.min_chunk,
        step_ms=args.step_ms,
        token_ms=args.token_ms,
    )


class _WithoutFreePages:
    """A router that is never told a replica's free pages."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self.sent = router.sent

    def rank(
        self,
        token_ids: Sequence[int],
        loads: Mapping[str, ReplicaLoad],
        candidates: Collection[str],
        extra_keys: tuple[Hashable, ...] = (),
    ) -> list[str]:
        blind = {name: attrs.evolve(load, free_tokens=None) for name, load in loads.items()}
        return self._router.rank(token_ids, blind, candidates, extra_keys)


def make_router(policy: str, indexes: dict[str, ReplicaIndex]) -> Router:
    if policy == BLIND:
        return _WithoutFreePages(PrefixRouter(indexes, WEIGHTS[""]))
    if policy == "round-robin":
        return RoundRobin()
    if policy == "least-loaded":
        return LeastLoaded()
    router, _, tuned = policy.partition(", ")
    weights = WEIGHTS[f", {tuned}" if tuned else ""]
    return PrefixRouter(indexes, weights, full_attention_only=router == "full-attention-only")


def simulate(
    layout: Layout, scale: Scale, policy: str, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One run of ``policy`` (or the one-engine reference) on simulated replicas."""
    t0 = time.perf_counter()
    chats = make_chats(scale.workload, seed)
    spec = replica_spec(layout, scale.workload, args)
    if policy == REFERENCE:
        one = SimReplica(layout, spec.pooled(scale.num_replicas), None)
        run = Simulation(chats, {"one": one}, None).run()
    else:
        indexes = {f"r{i:02d}": ReplicaIndex(BLOCK_SIZE, HASH) for i in range(scale.num_replicas)}
        uses_events = policy not in ("round-robin", "least-loaded")
        replicas = {
            name: SimReplica(layout, spec, index if uses_events else None)
            for name, index in indexes.items()
        }
        run = Simulation(chats, replicas, make_router(policy, indexes)).run()
    return run | {"wall_s": round(time.perf_counter() - t0, 1)}


def simulated(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """Scale label -> layout -> policy -> its runs (one per seed, each run's measures:
    ``Simulation.summary``) and their spread; and the goals per scale and layout."""
    cells = [
        (scale, name, layout, policy, seed)
        for scale in scales(args)
        for name, layout in layouts(args.window).items()
        if not args.layouts or name in args.layouts
        for policy in (*args.policies, REFERENCE)
        for seed in scale.seeds
    ]
    jobs = [(layout, scale, policy, seed, args) for scale, _, layout, policy, seed in cells]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            runs = list(pool.map(simulate, *zip(*jobs, strict=True)))
    else:
        runs = [simulate(*job) for job in jobs]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (scale, name, layout, policy, _), run in zip(cells, runs, strict=True):
        cell = out.setdefault(scale.label, {}).setdefault(name, {})
        cell.setdefault(policy, {"runs": []})["runs"].append(run)
        if policy == REFERENCE and len(cell[policy]["runs"]) == len(scale.seeds):
            for entry in cell.values():
                entry |= spread(entry["runs"])
            cell["goals"] = goals(cell, layout.is_hybrid, tuple(args.policies))
    return out


#: Real runs: each policy's name here, the front end that runs it, and how many of those
#: (two: each plays half the sessions and follows every replica on its own).
REAL_POLICIES = {
    "round-robin": ("round-robin", 1),
    "least-loaded": ("least-loaded", 1),
    "full-attention-only": ("prefix-full-attention", 1),
    "ours": ("prefix", 1),
    "ours, 2 front ends": ("prefix", 2),
    "smg cache-aware": ("smg", 1),
}


def real_policies(args: argparse.Namespace) -> dict[str, tuple[str, int]]:
    """The real runs' policies and their front ends (``--real-policies``; smg only with
    ``--smg``)."""
    chosen = args.real_policies or list(REAL_POLICIES)
    return {k: v for k, v in REAL_POLICIES.items() if k in chosen and (args.smg or v[0] != "smg")}


def real(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """The same measures on real replicas (``routing/real.py``): ``hybridkv serve``
    processes of a tiny model of each layout behind ``hybridkv route`` (or smg)."""
    import tempfile

    sizes = {"system": args.real_system, "user": args.real_user, "reply": args.real_reply}
    policies = real_policies(args)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for entry in args.real_scales:
            num_replicas, num_sessions = map(int, entry.split("x"))
            label = f"{num_replicas} real replicas, {num_sessions} sessions"
            for name in args.real_layouts:
                folder = save_model(name, Path(tmp) / name)
                cell: dict[str, Any] = {}
                # Every policy in turn for one seed, then the next seed: the policies
                # compared see the machine's load of the same minutes. Every other seed
                # plays them in reverse, so that a load rising or falling through a
                # seed's turns favours none of them.
                for index, seed in enumerate(args.seeds[: args.real_seeds]):
                    chats = sessions(
                        seed, num_sessions, args.real_turns, args.sessions_per_prompt, sizes
                    )
                    turns = [*policies.items(), (REFERENCE, (None, 0))]
                    for policy, (front, front_ends) in turns[:: -1 if index % 2 else 1]:
                        run = run_real(
                            folder, num_replicas, front, chats,
                            kv_memory=args.real_kv_memory, reply_tokens=args.real_reply,
                            max_num_seqs=args.max_running, front_ends=front_ends,
                        )  # fmt: skip
                        print(f"{label}, {name}, {policy}, seed {seed}: {run}", file=sys.stderr)
                        cell.setdefault(policy, {"runs": []})["runs"].append(run)
                for entry in cell.values():
                    entry |= spread(entry["runs"])
                cell["goals"] = goals(cell, name != "full", tuple(policies))
                out.setdefault(label, {})[name] = cell
    return out


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    results = {} if args.no_simulated else simulated(args)
    print_table(results, tuple(args.policies))
    real_results = real(args) if args.real else {}
    print_table(real_results, tuple(real_policies(args)))
    wall = round(time.perf_counter() - t0)
    print(f"\n{wall} s")
    settings = {
        key: getattr(args, key)
        for key in ("scales", "policies", "seeds", "big_from", "big_turns", "big_seeds", "turns",
                    "sessions_per_prompt", "system_tokens", "user_tokens", "reply_tokens",
                    "think_ms", "alive", "occupancy", "max_running", "budget", "min_chunk",
                    "step_ms", "token_ms", "window")
    }  # fmt: skip
    settings |= {
        "block_size": BLOCK_SIZE,
        "weights": {f"ours{k}": attrs.asdict(w) for k, w in WEIGHTS.items()},
    }
    settings |= {
        key: getattr(args, key)
        for key in ("real_scales", "real_layouts", "real_turns", "real_system", "real_user",
                    "real_reply", "real_kv_memory", "real_seeds", "smg")
    }  # fmt: skip
    write_json(
        args.json,
        {"settings": settings, "wall_s": wall, "results": results, "real": real_results},
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, or ``sys.argv``); ``--quick``: a small smoke run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small scales and prompts, one seed")
    p.add_argument("--scales", nargs="+", default=["2x16", "4x32", "64x2000"], metavar="RxS")
    p.add_argument("--layouts", nargs="+", choices=("full", "gemma-3-like", "bamba-like"))
    p.add_argument(
        "--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
        help="the simulated runs' policies (round-robin and full-attention-only with ours)",
    )  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--big-from", type=int, default=16, help="replicas of a big scale")
    p.add_argument("--big-turns", type=int, default=4, help="turns at a big scale")
    p.add_argument("--big-seeds", type=int, default=1, help="seeds at a big scale")
    p.add_argument("--sessions-per-prompt", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--user-tokens", type=int, nargs=2, default=(50, 150), metavar=("MIN", "MAX"))
    p.add_argument("--reply-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"))
    p.add_argument("--think-ms", type=float, default=2000.0, help="mean think time")
    p.add_argument("--alive", type=float, default=8.0, help="sessions alive per replica")
    p.add_argument("--occupancy", type=float, default=0.6, help="alive sessions over the pool")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--budget", type=int, default=2048, help="tokens a step")
    p.add_argument(
        "--min-chunk", type=int, default=attrs.fields(EngineConfig).min_prefill_chunk.default
    )
    p.add_argument("--step-ms", type=float, default=10.0, help="modelled cost of a step")
    p.add_argument("--token-ms", type=float, default=0.05, help="modelled cost of a token")
    p.add_argument("--window", type=int, default=1024, help="Gemma-3-like sliding window")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    p.add_argument("--no-simulated", action="store_true", help="only the real replicas")
    p.add_argument("--real", action="store_true", help="also real replicas (minutes)")
    p.add_argument("--real-scales", nargs="+", default=["2x16", "4x32"], metavar="RxS")
    p.add_argument(
        "--real-layouts", nargs="+", default=["full", "gemma-3-like", "bamba-like"],
        choices=("full", "gemma-3-like", "bamba-like"),
    )  # fmt: skip
    p.add_argument("--real-turns", type=int, default=4)
    p.add_argument("--real-system", type=int, default=512, help="system prompt tokens")
    p.add_argument("--real-user", type=int, default=48, help="user message tokens")
    p.add_argument("--real-reply", type=int, default=16, help="reply tokens")
    p.add_argument("--real-kv-memory", default="2MiB", help="KV memory of a real replica")
    p.add_argument("--real-seeds", type=int, default=1, help="seeds of the real runs")
    p.add_argument(
        "--real-policies", nargs="+", choices=list(REAL_POLICIES), metavar="POLICY",
        help=f"the real runs' policies (default: all of {', '.join(REAL_POLICIES)})",
    )  # fmt: skip
    p.add_argument(
        "--smg", action=argparse.BooleanOptionalAction, default=True,
        help="SGLang's model gateway too (installed under ~/.cache/hybridkv-peers)",
    )  # fmt: skip
    add_json_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.scales, args.seeds, args.turns = ["2x8", "4x12"], args.seeds[:1], 3
        args.system_tokens, args.user_tokens, args.reply_tokens = 256, (16, 48), (16, 48)
        args.window, args.think_ms = 128, 200.0
    return args


if __name__ == "__main__":
    main()
