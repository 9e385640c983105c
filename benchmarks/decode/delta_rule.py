"""The gated delta rule's kernels against transformers' torch forms, at Qwen3-Next's head
shapes (32 value heads, keys and values of 128), on this CPU, in one run.

Rows:
  prefill L     ``delta_rule_states`` over one request of L tokens (chunks of 64), the
                state kept where a prefill under the default state policy writes it (at
                16, 32, 64 ... tokens, doubling, and at the end)
                vs ``torch_chunk_gated_delta_rule`` (chunks of 64, the final state only)
  ... every     the same with the state kept at every 16-token block end (a policy
                with ``checkpoint_every=1``)
  decode B      ``delta_rule_decode``: one token for each of B requests
                vs ``torch_recurrent_gated_delta_rule`` on the same batch

Each pair runs interleaved ``--repeats`` times; the report is the median time of each and
the ratio ours / theirs, with its spread (min-max of the per-repeat ratios). Inputs are
float32 (the state always is); queries and keys unit length, decays and rates random.

    python -m benchmarks.decode.delta_rule --repeats 7 [--threads 1 --clock process]
        [--json FILE]

Results: docs/benchmarks.md, section "The gated delta rule against transformers' torch
forms".
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common.results import add_json_argument, write_json
from hybridkv.kernels.delta_rule import delta_rule_decode, delta_rule_states

HEADS, KEY, VALUE, BLOCK = 32, 128, 128, 16


def _inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    q = F.normalize(torch.randn(batch, length, HEADS, KEY, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, length, HEADS, KEY, generator=gen), dim=-1)
    v = torch.randn(batch, length, HEADS, VALUE, generator=gen)
    g = -torch.rand(batch, length, HEADS, generator=gen) * 0.1
    beta = torch.rand(batch, length, HEADS, generator=gen)
    state = torch.randn(batch, HEADS, KEY, VALUE, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _time(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return clock() - start


def _pair(
    ours: Callable[[], object],
    theirs: Callable[[], object],
    repeats: int,
    clock: Callable[[], float],
) -> dict[str, float]:
    ours(), theirs()  # warm
    mine, other = [], []
    for _ in range(repeats):
        mine.append(_time(ours, clock))
        other.append(_time(theirs, clock))
    ratios = [a / b for a, b in zip(mine, other, strict=True)]
    return {
        "ours_ms": round(1000 * statistics.median(mine), 3),
        "transformers_ms": round(1000 * statistics.median(other), 3),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
    }


def main(argv: list[str] | None = None) -> int:
    from transformers.models.qwen3_next import modeling_qwen3_next as reference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--clock", choices=("wall", "process"), default="wall",
        help="process: this process's CPU time (steadier on a shared machine, one thread)",
    )  # fmt: skip
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--decode", type=int, nargs="+", default=[1, 8])
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = reference.torch_chunk_gated_delta_rule
    step = reference.torch_recurrent_gated_delta_rule
    clock = time.process_time if args.clock == "process" else time.perf_counter
    rows = {}
    with torch.inference_mode():
        for length in args.prefill:
            q, k, v, g, beta, state = _inputs(1, length)
            theirs = functools.partial(
                chunk, q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True
            )
            doubling = [BLOCK << i for i in range(length.bit_length()) if BLOCK << i < length]
            every = [*range(BLOCK, length, BLOCK), length]
            for label, counts in (("", [*doubling, length]), (" every", every)):
                ours = functools.partial(
                    delta_rule_states, q[0], k[0], v[0], g[0], beta[0], state[0], counts
                )
                rows[f"prefill {length}{label}"] = _pair(ours, theirs, args.repeats, clock)
        for batch in args.decode:
            q, k, v, g, beta, state = _inputs(batch, 1)
            ours = functools.partial(
                delta_rule_decode, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state
            )
            theirs = functools.partial(
                step, q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True
            )
            rows[f"decode {batch}"] = _pair(ours, theirs, args.repeats, clock)
    print(f"threads {torch.get_num_threads()}, {args.clock} clock, {HEADS} heads of "
          f"{KEY} x {VALUE}, float32")  # fmt: skip
    print(f"{'row':20} {'ours ms':>9} {'transformers ms':>16} {'ratio':>7} {'(min-max)':>14}")
    for name, row in rows.items():
        spread = f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}"
        print(f"{name:20} {row['ours_ms']:>9.2f} {row['transformers_ms']:>16.2f} "
              f"{row['ratio']:>7.2f} {spread:>14}")  # fmt: skip
    write_json(args.json, {"threads": torch.get_num_threads(), "clock": args.clock, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
