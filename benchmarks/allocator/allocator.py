"""Allocator cost per engine step: recorded traces and generated workloads, replayed.

A trace (format "kvcm-trace/1", see ``shared/traces/README.md``) records every call an
engine made to its KV cache allocator. The replay makes the same calls on hybridkv's
``KVCacheManager``, timing each step (``perf_counter_ns`` around that step's operations
only), and reports where its answers (hits, pages, refusals) differ from the recorded ones.
With ``--reference-src DIR`` (a vLLM source tree loaded by ``common/vllm_source.py``, which needs
msgspec; see ``common/vllm_reference.py``) vLLM's own KVCacheManager replays the same steps in
lockstep, so both run under the same load.

Without ``--trace`` it replays ``shared/traces`` and generated workloads: 64/256/1024
concurrent requests, full attention and a Gemma-3-like 5:1 sliding-window:full layout, with
and without shared prefixes, and 8x longer contexts. Its ``held`` and ``changed`` columns
show that a decode step costs what changes (pages taken, returned, cached), not what is held:
a decode inside its current block takes no page at all.

    python -m benchmarks.allocator.allocator [--quick] [--reference-src DIR]
    python -m benchmarks.allocator.allocator --trace FILE [--reference-src DIR]
    python -m benchmarks.allocator.allocator --hash-bench

The last line is one JSON object: ``step_us_median``, ``decode_step_us_median``,
``decode_us_per_request``, ``peak_blocks_used`` (and ``ratio``, ours over vLLM's).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.allocator.workloads import LAYOUTS, Op, Trace, decode_only, generate
from hybridkv.memory import BlockHasher, KVCacheManager, hash_names
from hybridkv.policies import FullAttention, MemoryPolicy, SlidingWindow

TRACE_DIR = Path(__file__).resolve().parents[3] / "shared" / "traces"


class _Request:
    __slots__ = ("all_token_ids", "extra_keys", "request_id")

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id, self.all_token_ids = request_id, tokens
        self.extra_keys: tuple[object, ...] = ()


class OursAllocator:
    """hybridkv's KVCacheManager behind the replay's verbs (the reference has the same)."""

    name = "hybridkv"

    def __init__(self, groups: list[dict[str, Any]], num_blocks: int, block_size: int, **kw: Any):
        policies: list[MemoryPolicy] = [
            FullAttention() if g["type"] == "full" else SlidingWindow(window=g["sliding_window"])
            for g in groups
        ]
        self.manager = KVCacheManager(policies, num_blocks, block_size, hash_name=kw["hash_name"])
        self.requests: dict[int, _Request] = {}
        self._hits: dict[int, Any] = {}

    def add(self, index: int, prompt: list[int]) -> None:
        self.requests[index] = _Request(str(index), prompt)

    def step_starts(self) -> None:
        pass

    def lookup(self, index: int) -> int:
        hit = self._hits[index] = self.manager.lookup(self.requests[index])
        return hit.num_tokens

    def admit(self, index: int, num_new: int, use_hit: bool) -> Any:
        hit = self._hits.pop(index)
        return self.manager.allocate(self.requests[index], num_new, hit if use_hit else None)

    def extend(self, index: int, num_new: int) -> Any:
        return self.manager.allocate(self.requests[index], num_new)

    def spare_chunk(self, index: int, num_new: int, at_least: int) -> int:
        """The engine planner's prefill chunk (``KVCacheManager.spare_chunk``), for the
        request's next allocation (a first one resumes from its looked-up hit)."""
        request = self.requests[index]
        return self.manager.spare_chunk(request, num_new, self._hits.get(index), at_least=at_least)

    def append(self, index: int, token: int) -> None:
        self.requests[index].all_token_ids.append(token)

    def free(self, index: int, preempted: bool) -> None:
        self.manager.free(str(index))
        if not preempted:
            del self.requests[index]

    @staticmethod
    def num_new_pages(result: Any) -> int:
        return sum(map(len, result))

    def num_table_entries(self, index: int) -> int:
        return sum(map(len, self.manager.block_tables(str(index))))

    def num_blocks_used(self) -> int:
        return self.manager.num_usable_blocks - self.manager.num_free_blocks


class Replay:
    """One allocator following a trace. Positions are kept per request, so a divergence
    (another hit, a refusal) never makes the replay ask for the same slots twice."""

    def __init__(self, trace: Trace, alloc: Any) -> None:
        self.trace, self.alloc = trace, alloc
        n = len(trace.prompts)
        self.pos = [0] * n  # tokens this allocator holds slots for
        self.tpos = [0] * n  # tokens the trace says are computed
        self.running = [False] * n
        self.ngen = [0] * n
        self.step_ns: list[int] = []
        self.used: list[int] = []
        self.changed: list[int] = []
        self.hit_tokens = 0
        self.divergences: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def step(self, k: int, ops: list[Op]) -> None:
        alloc, pos, tpos, running = self.alloc, self.pos, self.tpos, self.running
        outputs, ngen, results = self.trace.outputs, self.ngen, []
        for op in ops:  # requests come into being on arrival, untimed
            i = op[1]
            if op[0] in "Aa" and i not in alloc.requests:
                sampled = range(outputs[i][0], outputs[i][0] + ngen[i])
                alloc.add(i, self.trace.prompt(i) + list(sampled))
        t0 = time.perf_counter_ns()
        alloc.step_starts()
        for op in ops:
            kind, i = op[0], op[1]
            if kind == "S":
                alloc.append(i, outputs[i][0] + ngen[i])
                ngen[i] += 1
                continue
            if kind == "P" or kind == "F":
                if running[i]:
                    alloc.free(i, kind == "P")
                elif kind == "F":
                    alloc.requests.pop(i, None)
                running[i], pos[i], tpos[i] = False, 0, 0
                continue
            # "A"/"a" admit up to hit + n tokens, "D"/"d" extend by n; capitals succeeded.
            target = op[2] + op[3] if kind in "Aa" else tpos[i] + op[2]
            if kind == "A" or kind == "D":
                tpos[i] = target
            if kind in "Aa" and not running[i]:
                hit = alloc.lookup(i)
                use = hit < target  # a hit past this chunk's end is not used
                new = alloc.admit(i, target - hit if use else target, use)
                if new is not None:
                    running[i], pos[i] = True, target
                results.append(("admit", op, hit, target, new))
            elif not running[i] or pos[i] >= target:
                results.append(("skipped" if not running[i] else "credit", op, 0, 0, ()))
            else:
                start, new = pos[i], alloc.extend(i, target - pos[i])
                if new is not None:
                    pos[i] = target
                elif kind == "D":  # refused where the recorder succeeded: drop it
                    alloc.free(i, True)
                    running[i] = False
                results.append(("extend", op, start, target, new))
        self.step_ns.append(time.perf_counter_ns() - t0)
        self._check(k, results)

    def _check(self, k: int, results: list[tuple[str, Op, int, int, Any]]) -> None:
        """Compare with the recorded answers and count pages (outside the timed region)."""
        alloc, note, num_new, num_filled = self.alloc, self._note, 0, 0
        bs, num_groups = self.trace.config["block_size"], len(self.trace.config["groups"])
        for tag, op, hit, end, new in results:
            pages = alloc.num_new_pages(new) if new is not None else 0
            num_new += pages
            if new is not None:  # blocks that filled up: hashed and cached in every group
                num_filled += (end // bs - hit // bs) * num_groups
            if tag == "skipped" or tag == "credit":
                note(tag, k, op, "")
            elif new is None:
                if op[0] in "AD":
                    note("refused_" + ("admission" if op[0] == "A" else "extension"), k, op, "")
            elif op[0] in "ad":
                note("served_where_refused", k, op, "")
            elif tag == "admit":
                self.hit_tokens += hit
                if hit != op[2]:
                    note("hit", k, op, f"hit {hit}")
                if op[4] is not None and self.running[op[1]]:
                    entries = alloc.num_table_entries(op[1])
                    if entries != op[4]:
                        note("table_entries", k, op, f"entries {entries}")
            elif op[0] == "D" and op[3] is not None and pages != op[3]:
                note("new_pages", k, op, f"new pages {pages}")
        used = alloc.num_blocks_used()
        before = self.used[-1] if self.used else 0
        # Pages taken, returned, or cached (a full block becomes findable).
        self.changed.append(num_new + max(0, before + num_new - used) + num_filled)
        self.used.append(used)

    def _note(self, kind: str, k: int, op: Op, detail: str) -> None:
        self.divergences[kind] += 1
        self.examples.setdefault(kind, f"step {k} {op} {detail}".strip())

    def stats(self, decode_mask: list[bool], decodes: list[int]) -> dict[str, Any]:
        us = [ns / 1000 for ns in self.step_ns]
        rows = [
            (t, n, c, u)
            for t, d, n, c, u in zip(us, decode_mask, decodes, self.changed, self.used, strict=True)
            if d and n
        ]
        med = statistics.median
        out = {"steps": len(us), "step_us_median": round(med(us), 2)}
        if rows:
            out.update(
                decode_step_us_median=round(med(r[0] for r in rows), 2),
                decode_us_per_request=round(med(r[0] / r[1] for r in rows), 3),
                pages_held_median=med(r[3] for r in rows),
                pages_changed_mean=round(statistics.fmean(r[2] for r in rows), 1),
            )
        out.update(
            peak_blocks_used=max(self.used, default=0),
            prefix_hit_tokens=self.hit_tokens,
            divergences=dict(self.divergences),
            examples=self.examples,
        )
        return out


def replay(trace: Trace, reference: Any, max_steps: int | None) -> dict[str, Any]:
    """Replay ``trace`` through ours and the reference in lockstep, alternating who goes
    first, so that both see the same machine load."""
    cfg = trace.config
    kw = {
        "max_model_len": cfg.get("max_model_len", 1 << 20),
        "hash_name": cfg.get("hash", "sha256"),
        "reserve_full_isl": cfg.get("reserve_full_isl", True),
    }
    args = (cfg["groups"], cfg["num_blocks"], cfg["block_size"])
    replays = [Replay(trace, OursAllocator(*args, **kw))]
    if reference is not None:
        from benchmarks.common.vllm_reference import ReferenceAllocator

        replays.append(Replay(trace, ReferenceAllocator(reference, *args, **kw)))
    steps = trace.steps[:max_steps]
    gc.collect()
    gc.freeze()
    for k, ops in enumerate(steps):
        for r in replays if k % 2 == 0 else replays[::-1]:
            r.step(k, ops)
    gc.unfreeze()
    mask = [decode_only(ops) for ops in steps]
    decodes = [sum(1 for op in ops if op[0] == "D") for ops in steps]
    out = {"trace": trace.name, "recorded": trace.summary}
    out.update((r.alloc.name, r.stats(mask, decodes)) for r in replays)
    if reference is not None:
        a, b = out["hybridkv"], out["vllm"]
        keys = ("step_us_median", "decode_step_us_median", "decode_us_per_request")
        out["ratio"] = {k: round(a[k] / b[k], 3) if a.get(k) and b.get(k) else None for k in keys}
    return out


def hash_bench(reference: Any) -> dict[str, float]:
    """Microseconds per 16-token block for each hash of our BlockHasher (best of 9)."""
    tokens, out = list(range(1_000, 1_000 + 16 * 4096)), {}

    def best(run: Any) -> float:
        times = []
        for _ in range(9):
            t0 = time.perf_counter_ns()
            run()
            times.append((time.perf_counter_ns() - t0) / 1000 / 4096)
        return round(min(times), 3)

    for name in hash_names():
        hasher = BlockHasher(16, name)
        out[name] = best(lambda h=hasher: h.extend([], h.root(()), tokens, len(tokens)))
    if reference is not None:  # vLLM's own chained hash (pickle + sha256), for comparison
        utils, fn = reference.kv_utils, reference.hashing.get_hash_fn_by_name("sha256")
        utils.init_none_hash(fn)

        def chain() -> None:
            parent = None
            for s in range(0, len(tokens), 16):
                parent = utils.hash_block_tokens(fn, parent, tokens[s : s + 16])

        out["vllm_sha256"] = best(chain)
    return out


COLUMNS = (  # header, result key, format
    ("steps", "steps", "5"),
    ("us/step", "step_us_median", "9.1f"),
    ("us/decode", "decode_step_us_median", "9.1f"),
    ("us/req", "decode_us_per_request", "7.3f"),
    ("held", "pages_held_median", "7.0f"),
    ("changed", "pages_changed_mean", "7.1f"),
    ("peak", "peak_blocks_used", "7"),
)
LEGEND = """\
us/step, us/decode: median wall microseconds a step, over all and over decode-only steps
us/req: the same per decoding request (median over decode-only steps)
held: pages in use (median), changed: pages taken, returned or cached a step (mean), over
decode-only steps; peak: most pages in use; div: answers that differ from the recorded"""


def print_result(res: dict[str, Any]) -> None:
    """One row per allocator, then its divergences (the first example of each kind)."""
    for name in ("hybridkv", "vllm"):
        if name in res:
            s = res[name]
            cells = " ".join(format(s.get(key) or 0, ">" + fmt) for _, key, fmt in COLUMNS)
            row = f"{res['trace'] + ' ' + name:<37} {cells} {sum(s['divergences'].values()):>4}"
            if name == "vllm":
                row += f" {res['ratio']['decode_us_per_request'] or 0:>9.3f}"
            print(row)
            for kind, example in s["examples"].items():
                print(f"    {s['divergences'][kind]} x {kind}: first at {example}")


def main() -> None:
    args = parse_args()
    reference = None
    if args.reference_src:
        import benchmarks.common.vllm_reference as _vllm_reference

        reference = _vllm_reference.load(args.reference_src)
        print(f"reference: vLLM {reference.version} KVCacheManager from {args.reference_src}")
    if args.hash_bench:
        res = hash_bench(reference)
        for name, us in res.items():
            print(f"{name:<12} {us:>7.3f} us per 16-token block")
        print(json.dumps({"hash_us_per_block": res}))
        return
    paths = [Path(p) for p in args.trace] or sorted(Path(args.trace_dir).glob("*.json"))
    print(LEGEND)
    header = " ".join(format(h, ">" + fmt.split(".")[0]) for h, _, fmt in COLUMNS)
    print(f"{'workload allocator':<37} {header}  div" + (" ours/vllm" if reference else ""))
    results = []
    for path in paths:
        res = replay(Trace.load(path), reference, 200 if args.quick else None)
        print_result(res)
        rec, ours = res["recorded"], res["hybridkv"]
        print(
            f"    recorded peak {rec.get('peak_blocks_used')} hits {rec.get('prefix_hit_tokens')}"
            f"; replayed peak {ours['peak_blocks_used']} hits {ours['prefix_hit_tokens']}"
        )
        results.append(res)
    if not args.trace:
        sizes = (64, 256) if args.quick else (64, 256, 1024)
        cases = [(lay, n, sh, 512) for lay in LAYOUTS for n in sizes for sh in (False, True)]
        cases += [(lay, 64, False, 4096) for lay in LAYOUTS]  # 8x the context
        for case in cases:
            res = replay(generate(*case), reference, None)
            print_result(res)
            results.append(res)
    summary: dict[str, Any] = {}
    if len(results) == 1:
        summary.update(results[0]["hybridkv"], ratio=results[0].get("ratio"))
        del summary["examples"]
    else:
        summary["results"] = {r["trace"]: {k: r[k] for k in r if k != "recorded"} for r in results}
    if reference is not None:
        ratios = [r["ratio"]["decode_us_per_request"] for r in results]
        summary["max_ratio_decode_us_per_request"] = max(filter(None, ratios), default=None)
        summary["reference"] = f"vLLM {reference.version}"
    print(json.dumps(summary, separators=(",", ":")))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", action="append", default=[], help="a kvcm-trace/1 file")
    p.add_argument("--trace-dir", default=str(TRACE_DIR), help="traces replayed by default")
    p.add_argument("--reference-src", help="vLLM source tree (holding vllm/) to compare")
    p.add_argument("--quick", action="store_true", help="200 steps a trace, fewer workloads")
    p.add_argument("--hash-bench", action="store_true", help="per-block hashing cost")
    return p.parse_args()


if __name__ == "__main__":
    main()
