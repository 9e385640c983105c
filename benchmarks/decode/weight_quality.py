"""Quality of each weight mode against float32 on the built-in model, over a fixed text.

For every position of the text, the next-token distribution of each mode is compared
with float32's, as llama.cpp's perplexity tool does with ``--kl-divergence``:

    mean KL     mean over positions of KL(p_float32 || p_mode), in nats
    KL p99      its 99th percentile
    agree       share of positions whose argmax (the greedy token) is float32's
    ppl         perplexity of the text under the mode

The text runs 16 tokens a step through the executor (``--chunk``), so the quantised
layers use the weight-only kernels a decode step uses (bfloat16 activations); ``--chunk
512`` measures the expanded weights of long prefill chunks instead. The goal (issue
15): mean KL <= 0.01 for bfloat16, <= 0.05 for int8 and int4.

    python -m benchmarks.decode.weight_quality [--modes bfloat16 int8 int4] [--threads 2]
        [--chunk 16]
                                        [--head rescored|stored|four-bit]

``--head`` picks the LM head of the quantised modes: ``rescored`` (what they load: a
4-bit pass, its best candidates exact, ``models/weights/rescored_head.py``), ``stored`` (the head
as stored, int8 for the built-in model) or ``four-bit`` (the 4-bit pass alone).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks.common.weight_modes import MODES, all_logits, builtin_folder, load
from hybridkv.models.weights.rescored_head import RescoredHead

BOUNDS = {"bfloat16": 0.01, "int8": 0.05, "int4": 0.05}

# A fixed English text (written for this benchmark), about 600 tokens.
TEXT = """\
The lighthouse stood at the end of a long spit of sand, and for most of the year the only
people who walked out to it were the keeper and the woman who brought his groceries on
Thursdays. In the summer the beach filled with families, but they rarely went past the
last of the dunes, where the wind picked up and the sand began to sting. The keeper liked
it that way. He had come to the coast after thirty years of teaching mathematics in a
city school, and he still thought of the light as a kind of proof: a statement made once
every ten seconds, the same every time, true whether or not anybody was looking.

His days had a shape. In the morning he climbed the hundred and twelve steps to clean the
lens, checked the clockwork that turned it, and wrote the weather in a ledger that nobody
read. After lunch he repaired whatever the salt had eaten that week: a hinge, a window
frame, the cable of the radio aerial. In the evening he lit the lamp, although for years
the lamp had lit itself, and sat by the window with a book until the first ship passed.

One winter a storm took out the power line from the village. The backup generator ran for
two days and then stopped, and the keeper found himself turning the lens by hand, an hour
at a time, through the night. He counted the seconds under his breath. At dawn the woman
with the groceries came early, on foot, carrying a thermos of coffee and a spare battery
for the radio, and she took the next hour while he slept on the floor of the watch room.
They kept it up for three nights until the line was repaired. Neither of them said much
about it afterwards, but on Thursdays she stayed a little longer, and he started reading
the ledger aloud to her: wind from the north-west, visibility good, one ship, all well.

Engineers will tell you that a system is only as reliable as its least reliable part, and
that redundancy is the cheapest kind of insurance. Sailors will tell you that a light is
only useful if it is where the chart says it is. The keeper would have agreed with both,
and added a third rule of his own: that the work which matters most is usually the work
that nobody notices until it stops. He wrote that on the first page of a new ledger the
spring he retired, and left it on the desk for whoever came next.
"""


def kl_stats(reference: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """KL(reference || other) per row, greedy agreement and perplexity, from logits."""
    log_p, log_q = reference.log_softmax(-1), other.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    nll = -log_q.gather(1, targets.unsqueeze(-1)).squeeze(-1)
    return {
        "mean_kl": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "agree": float((reference.argmax(-1) == other.argmax(-1)).float().mean()),
        "ppl": float(nll.mean().exp()),
    }


HEADS = ("rescored", "stored", "four-bit")


def use_head(model: torch.nn.Module, head: str) -> None:
    """Replace a rescored LM head by the head it wraps (``stored``) or its 4-bit pass."""
    rescored = getattr(model, "lm_head", None)
    if head == "rescored" or not isinstance(rescored, RescoredHead):
        return
    model.lm_head = rescored.head if head == "stored" else rescored.coarse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES)[1:], default=list(MODES)[1:])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=16, help="tokens a step")
    parser.add_argument("--head", choices=HEADS, default="rescored")
    args = parser.parse_args()
    folder = builtin_folder()
    torch.set_grad_enabled(False)
    results: dict[str, Any] = {}
    reference: torch.Tensor | None = None
    tokens: list[int] = []
    for mode in ["float32", *args.modes]:
        executor = load(folder, mode, threads=args.threads)
        use_head(executor.model, args.head)
        if not tokens:
            assert executor.tokenizer is not None
            tokens = executor.tokenizer.encode(TEXT).ids  # type: ignore[attr-defined]
        logits = all_logits(executor, tokens, chunk=args.chunk)[:-1]
        executor.close()
        del executor
        if reference is None:
            reference = logits
        targets = torch.tensor(tokens[1:])
        stats = kl_stats(reference, logits, targets)
        stats["bound"] = BOUNDS.get(mode)
        stats["within"] = stats["bound"] is None or stats["mean_kl"] <= stats["bound"]
        results[mode] = stats
        print(
            f"{mode:9s} mean KL {stats['mean_kl']:.5f}  KL p99 {stats['kl_p99']:.4f}  "
            f"agree {stats['agree']:.3f}  ppl {stats['ppl']:.3f}"
            + ("" if stats["bound"] is None else f"  bound {stats['bound']} ok={stats['within']}"),
            flush=True,
        )
    print(json.dumps({"tokens": len(tokens), "head": args.head, "modes": results}))


if __name__ == "__main__":
    main()
