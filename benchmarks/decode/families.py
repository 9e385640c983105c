"""The decode step of the new attention families at their published widths, against
transformers' ``generate`` on the same random weights.

Each model is a few layers of its published shape (random weights, ``--dtype``):

  qwen3-0.6b       Qwen3-0.6B's widths (hidden 1,024, 16 heads, 8 KV heads of 128, MLP
                   3,072, vocabulary 151,936, tied head), 4 of its 28 layers
  gpt-oss-20b      gpt-oss-20b's widths (hidden 2,880, 64 heads, 8 KV heads of 64, 32
                   experts of 2,880, four a token, sinks, vocabulary 201,088), 2 of its 24
                   layers (one sliding, one full)
  deepseek-v3      DeepSeek V3's first 2 of 61 layers (hidden 7,168, latent attention of 128
                   heads over a 576-value latent, dense MLPs of 18,432, vocabulary 129,280)
  kimi-linear-48b  Kimi-Linear-48B-A3B's widths, 2 of its 27 layers: Kimi Delta Attention
                   (32 heads of 128) with a dense MLP, latent attention without rope with
                   256 experts of 1,024 (eight a token) beside a shared one
  deepseek-v4      DeepSeek V4-Flash's widths, 2 of its 43 layers (one CSA, one HCA: 64
                   heads reading one 512-value vector a token, a window of 128 beside
                   compressed entries, an indexer of 64 heads keeping 512), hidden 4,096 in
                   four hyper-connection streams, 16 of its 256 experts of 2,048 (six a
                   token; the first layer's by token id) beside a shared one

For batch 1 and 8 (``--batches``), prompts of ``--context`` tokens, then ``--steps``
decode steps. Ours: ``ModelExecutor.execute`` one decode step at a time (no engine, no
event loop), each step timed. transformers: ``generate`` greedy to ``--steps`` + 4 new
tokens and to 4, the difference divided by ``--steps`` (the prefill and the first tokens
cancel). Three repeats, alternating the two, each system's median over them with the
spread; the ratio is transformers' time per step over ours.

    python -m benchmarks.decode.families [--models qwen3-0.6b ...] [--quick]

Memory: gpt-oss's two layers hold 3.2 GB of experts in bfloat16, loaded twice (ours and
transformers'), 11 GB in all. The last line printed is one JSON object. Results: the
section "Decode step of the new families against transformers" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.weight_modes import Sequence, step_batch
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler import SamplingParams

#: transformers config class and fields of each model.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": (
        "Qwen3Config",
        {
            "vocab_size": 151_936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "tie_word_embeddings": True,
        },
    ),
    "gpt-oss-20b": (
        "GptOssConfig",
        {
            "vocab_size": 201_088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 2,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
        },
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        {"num_hidden_layers": 2},  # the rest transformers' defaults: V3's widths
    ),
    "kimi-linear-48b": (
        "KimiLinearConfig",
        {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "mlp_layer_types": ["dense", "sparse"],
        },
    ),
    "deepseek-v4": (
        "DeepseekV4Config",
        {  # the rest transformers' defaults: V4-Flash's widths
            "num_hidden_layers": 2,
            "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
            "mlp_layer_types": ["hash_moe", "moe"],
            "n_routed_experts": 16,
        },
    ),
}
_WARM = 4  # tokens transformers generates in both runs, so the difference is decode only


def _checkpoint(name: str, folder: Path, dtype: torch.dtype) -> Path:
    import transformers

    class_name, fields = MODELS[name]
    config = getattr(transformers, class_name)(**fields, pad_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    return folder


def _ours(executor: ModelExecutor, prompts: list[list[int]], steps: int) -> list[float]:
    """Seconds of each decode step of ``prompts`` together."""
    kv = KVCacheManager.for_pool(executor.plan.pool)
    context = len(prompts[0])
    seqs = [
        Sequence(f"r{i}-{time.monotonic_ns()}", p + [p[0]] * (steps + 1))
        for i, p in enumerate(prompts)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    executor.execute(step_batch(kv, seqs, 0, context, greedy))
    times = []
    for step in range(steps):
        batch = step_batch(kv, seqs, context + step, 1, greedy)
        begin = time.perf_counter()
        executor.execute(batch)
        times.append(time.perf_counter() - begin)
    for seq in seqs:
        kv.free(seq.request_id)
    return times


def _theirs(model: Any, prompts: list[list[int]], steps: int) -> float:
    """Seconds per decode step of ``generate`` on ``prompts`` (see the module)."""
    ids = torch.tensor(prompts)

    def run(new: int) -> float:
        begin = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - begin

    return (run(_WARM + steps) - run(_WARM)) / steps


def measure(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both systems on ``name`` at each batch size."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = _checkpoint(name, Path(folder), dtype)
        options = LoadOptions(kv_cache_bytes=64 << 20, block_size=16, dtype=dtype)
        executor = ModelExecutor.from_pretrained(path, options)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    vocab = executor.config.vocab_size
    for batch in args.batches:
        generator = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, vocab, (batch, args.context), generator=generator).tolist()
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(statistics.median(_ours(executor, prompts, args.steps)))
            theirs.append(_theirs(reference, prompts, args.steps))
        row = {
            "model": name,
            "batch": batch,
            "ours_ms": statistics.median(ours) * 1e3,
            "ours_spread_ms": (max(ours) - min(ours)) * 1e3,
            "transformers_ms": statistics.median(theirs) * 1e3,
            "transformers_spread_ms": (max(theirs) - min(theirs)) * 1e3,
        }
        row["speedup"] = row["transformers_ms"] / row["ours_ms"]
        print(
            f"{name:12s} batch {batch:2d}  ours {row['ours_ms']:8.1f} ms "
            f"(spread {row['ours_spread_ms']:.1f})  transformers {row['transformers_ms']:8.1f} "
            f"ms (spread {row['transformers_spread_ms']:.1f})  {row['speedup']:.2f}x"
        )
        rows.append(row)
    executor.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats, args.context = 4, 1, 32
    rows = [row for name in args.models for row in measure(name, args)]
    print(json.dumps({"dtype": args.dtype, "context": args.context, "rows": rows}))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
