"""The batched draw against one ``torch.multinomial`` per request, on Gemma 3's vocabulary.

Rows of random logits (262,144 wide, scaled like a small model's), per sampling setting:

    per-row     filter_logits (full sort for top-p), softmax, torch.multinomial, per row
                (the sampler before the batched draw)
    batched     executor/draw.py: one pass for temperature and min-p, top-k/top-p from
                candidates, one inverse-CDF draw for all rows

Both run in the same process, interleaved, CPU time of one thread, median of
``--repeats``; the ratio is batched / per-row.

    python -m benchmarks.decode.sampler [--rows 8] [--repeats 5]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hybridkv.executor.draw import draw, filter_logits
from hybridkv.scheduler.params import SamplingParams

VOCAB = 262_144
SETTINGS = {
    "temperature 1": SamplingParams(),
    "top_k 64, top_p 0.95": SamplingParams(top_k=64, top_p=0.95),
    "top_p 0.9": SamplingParams(top_p=0.9),
    "min_p 0.05": SamplingParams(min_p=0.05),
}


def per_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> None:
    for row in logits:
        probs = filter_logits(row, params).softmax(-1)
        torch.multinomial(probs, 1, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    # A peaked distribution, as a language model's: a few tokens hold most of the mass.
    logits = torch.randn(args.rows, VOCAB, generator=generator) * 2.5
    result = {}
    print(f"{'setting':22s} {'per-row ms':>10s} {'batched ms':>10s} {'ratio':>6s}  (per row)")
    for name, params in SETTINGS.items():
        times: dict[str, list[float]] = {"per_row": [], "batched": []}
        for _ in range(args.repeats):
            begin = time.process_time()
            per_row(logits, params, generator)
            times["per_row"].append(time.process_time() - begin)
            uniforms = torch.rand(args.rows, generator=generator, dtype=torch.float64)
            begin = time.process_time()
            draw(logits, [params] * args.rows, uniforms)
            times["batched"].append(time.process_time() - begin)
        old, new = (statistics.median(times[k]) * 1e3 / args.rows for k in times)
        result[name] = {"per_row_ms": old, "batched_ms": new, "ratio": new / old}
        print(f"{name:22s} {old:10.2f} {new:10.2f} {new / old:6.2f}")
    print(json.dumps({"rows": args.rows, "vocab": VOCAB, "settings": result}))


if __name__ == "__main__":
    main()
