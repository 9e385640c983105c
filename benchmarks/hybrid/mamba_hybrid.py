"""Mamba2 hybrids: prefix hits on a chat, bytes per request, and the scan's prefill speed.

Three measurements, side by side in one run:

1. **Prefix hit rate on a multi-turn chat.** ``--sessions`` chats of ``--turns`` turns,
   each with its own system prompt; turn t's prompt is the conversation so far (the
   previous replies as generated) plus a new message. Turns are served round-robin, at
   most ``--in-flight`` at once, through the engine core and the fake executor, which
   checks the state-page contract on every step (a hit on a page without its boundary's
   checkpoint would fail the run). Layouts: the groups the planner makes for a
   Bamba-like model (10 mamba groups of 3 layers, 1 full-attention group) against the
   same model as full attention (one group), at the block sizes given. The pool holds
   the sessions' working set (every session at its longest, ``num_blocks_needed``) over
   an occupancy. Printed: cached prompt tokens over prompt tokens of turns 2 and later.
2. **KV + state bytes per request** of Bamba-like and Granite-4.0-H-like layouts
   (bfloat16 K/V, float32 state) at 1k, 8k and 32k tokens: the planner's layout (pages
   per request times the bytes of a page id over every slot, padding included)
   against the uniform layout (every layer keeps a page per block: K/V, or a state).
3. **Prefill tokens/s** of a tiny random Bamba checkpoint (float32, CPU): hybridkv's
   executor (paged attention, the SSD scan with a checkpoint at every block boundary)
   against transformers' torch path on the same folder, one prompt per call, the ratio
   of the medians of ``--repeats`` runs and its spread.

    python -m benchmarks.hybrid.mamba_hybrid [--repeats N] [--skip-speed]

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import statistics
import tempfile
import time
from typing import Any

import structlog

from hybridkv.executor.load_options import LoadOptions
from hybridkv.memory import KVCacheManager
from hybridkv.memory.layout_planner import describe, plan_layout
from hybridkv.models.published_shapes import BUILTIN_CONFIGS
from hybridkv.models.specs import layer_specs_from_config
from hybridkv.policies import FullAttention, MemoryPolicy
from hybridkv.policies.base import cdiv
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor

VOCAB = 32000
GiB = 1 << 30


# -- 1. prefix hits on a chat --------------------------------------------------------


def bamba_groups(block_size: int) -> list[MemoryPolicy]:
    """The group policies the planner gives the Bamba-like config."""
    specs = layer_specs_from_config(BUILTIN_CONFIGS["bamba-like"])
    return list(plan_layout(specs, 64 * GiB, block_size).policies)


class Chat:
    """One session: a system prompt and a new message per turn; replies join the history."""

    def __init__(self, rng: random.Random, args: argparse.Namespace) -> None:
        def tokens(n: int) -> list[int]:
            return [rng.randrange(1, VOCAB) for _ in range(n)]

        self.history = tokens(args.system_tokens)
        self.messages = [tokens(rng.randint(*args.user_tokens)) for _ in range(args.turns)]
        self.reply_lens = [rng.randint(*args.reply_tokens) for _ in range(args.turns)]
        self.turn = 0

    def longest(self) -> int:
        """Tokens of the last turn: every message and reply."""
        return len(self.history) + sum(map(len, self.messages)) + sum(self.reply_lens)


def chat_hit_rate(
    policies: list[MemoryPolicy], block_size: int, occupancy: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Serve every session's turns round-robin; the hit rate of turns 2 and later."""
    rng = random.Random(args.seed)
    chats = [Chat(rng, args) for _ in range(args.sessions)]
    probe = KVCacheManager(policies, 2, block_size)
    working_set = sum(probe.num_blocks_needed(c.longest()) for c in chats)
    config = EngineConfig(
        policies=policies,
        num_blocks=round(working_set / occupancy) + 1,
        block_size=block_size,
        max_model_len=max(c.longest() for c in chats) + 1,
        max_num_batched_tokens=args.budget,
        vocab_size=VOCAB,
    )
    core = EngineCore(config)
    fake = FakeExecutor.for_config(config)
    queue, running = list(chats), {}
    ids = itertools.count()
    hits = prompts = 0
    while queue or running:
        while queue and len(running) < args.in_flight:
            chat = queue.pop(0)
            prompt = chat.history + chat.messages[chat.turn]
            sink = CollectingSink()
            params = SamplingParams(max_tokens=chat.reply_lens[chat.turn], ignore_eos=True)
            core.add_request(prompt, params, sink, request_id=str(next(ids)))
            running[id(sink)] = (chat, prompt, sink)
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
        core.flush()
        for key, (chat, prompt, sink) in list(running.items()):
            if not sink.is_closed:
                continue
            del running[key]
            if chat.turn > 0:
                hits += sink.items[0].num_cached_tokens
                prompts += len(prompt)
            chat.history = prompt + [t for out in sink.items for t in out.new_token_ids]
            chat.turn += 1
            if chat.turn < args.turns:
                queue.append(chat)
    return {
        "hit_rate": round(hits / max(prompts, 1), 3),
        "num_blocks": config.num_blocks,
        "preemptions": core.stats().num_preemptions,
    }


# -- 2. bytes per request ------------------------------------------------------------


def bytes_per_request(name: str, tokens: int, block_size: int) -> dict[str, Any]:
    """KV + state bytes one request of ``tokens`` holds at its peak, hybrid and uniform."""
    specs = layer_specs_from_config(BUILTIN_CONFIGS[name])
    plan = plan_layout(specs, 64 * GiB, block_size)
    report = describe(plan, specs, tokens)
    page_id_bytes = sum(report.stage_slots) * plan.block_bytes
    bs = plan.block_size
    uniform = cdiv(tokens, bs) * sum(s.block_bytes(bs) for s in specs)
    hybrid = report.blocks_per_request * page_id_bytes
    return {
        "block_size": bs,
        "hybrid_bytes": hybrid,
        "uniform_bytes": uniform,
        "ratio": round(uniform / hybrid, 2),
        "padding_fraction": round(report.padding_fraction, 3),
    }


# -- 3. prefill speed ----------------------------------------------------------------


def prefill_speed(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of one prefill, hybridkv against transformers, on one tiny checkpoint."""
    import torch
    from transformers import BambaConfig, BambaForCausalLM

    from hybridkv.executor.model_executor import ModelExecutor
    from hybridkv.scheduler.batch import StepBatch, StepRequest

    torch.manual_seed(0)
    config = BambaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, attn_layer_indices=[2],
        mamba_n_heads=8, mamba_d_state=32, mamba_n_groups=1, mamba_expand=2,
        mamba_chunk_size=64, max_position_embeddings=8192,
    )  # fmt: skip
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        reference = BambaForCausalLM(config).eval()
        reference.save_pretrained(folder)
        executor = ModelExecutor.from_pretrained(
            folder, LoadOptions(kv_cache_bytes=256 << 20, block_size=args.speed_block_size)
        )
        bs, num_blocks = executor.plan.block_size, executor.plan.num_blocks
        for length in args.prompt_lengths:
            ids = torch.randint(3, 1024, (length,)).tolist()
            tables = [list(range(1, cdiv(length, bs) + 1))] * len(executor.plan.groups)
            assert cdiv(length, bs) < num_blocks, "the speed pool is too small"
            batch = StepBatch(
                (
                    StepRequest(
                        request_id="p", token_ids=ids, start_position=0,
                        block_tables=tables, sample=True,
                        params=SamplingParams(temperature=0.0), output_index=0,
                    ),
                )
            )  # fmt: skip

            def ours(batch: StepBatch = batch) -> None:
                executor.execute(batch)

            def theirs(ids: list[int] = ids) -> None:
                with torch.inference_mode():
                    reference(input_ids=torch.tensor([ids]), use_cache=False)

            times = {"hybridkv": [], "transformers": []}
            for fn in (ours, theirs):
                fn()  # warm-up
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                for label, fn in (("hybridkv", ours), ("transformers", theirs)):
                    t0 = time.perf_counter()
                    fn()
                    times[label].append(time.perf_counter() - t0)
            ratios = [t / o for o, t in zip(times["hybridkv"], times["transformers"], strict=True)]
            out[str(length)] = {
                "hybridkv_tok_s": round(length / statistics.median(times["hybridkv"])),
                "transformers_tok_s": round(length / statistics.median(times["transformers"])),
                "ratio_median": round(statistics.median(ratios), 2),
                "ratio_min": round(min(ratios), 2),
                "ratio_max": round(max(ratios), 2),
            }
        out["block_size"] = bs
        executor.close()
    return out


def main() -> None:
    args = parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results: dict[str, Any] = {"chat": {}, "bytes": {}, "speed": None}
    print(
        f"1. chat: {args.sessions} sessions x {args.turns} turns round-robin, "
        f"{args.in_flight} in flight, system {args.system_tokens}, messages "
        f"{args.user_tokens[0]}-{args.user_tokens[1]}, replies {args.reply_tokens[0]}-"
        f"{args.reply_tokens[1]}, {args.budget} tokens a step; prefix hit rate of turns 2+"
    )
    head = f"{'layout':<28}{'block':>6}" + "".join(f"{o:>9}" for o in args.occupancy)
    print(head)
    for block_size in args.block_sizes:
        layouts = {
            "full attention": [FullAttention()],
            "bamba-like (10 mamba, 1 full)": bamba_groups(block_size),
        }
        for label, policies in layouts.items():
            row = {str(o): chat_hit_rate(policies, block_size, o, args) for o in args.occupancy}
            results["chat"][f"{label}, bs {block_size}"] = row
            cells = "".join(f"{row[str(o)]['hit_rate']:>9.3f}" for o in args.occupancy)
            print(f"{label:<28}{block_size:>6}{cells}")
    print("\n2. KV + state bytes per request (bf16 K/V, float32 state), hybrid vs uniform")
    print(f"{'model':<20}{'tokens':>8}{'block':>7}{'hybrid MiB':>12}{'uniform MiB':>13}  ratio")
    for name in ("bamba-like", "granite-4.0-h-like"):
        for tokens in (1024, 8192, 32768):
            row = bytes_per_request(name, tokens, 16)
            results["bytes"][f"{name}, {tokens}"] = row
            print(
                f"{name:<20}{tokens:>8}{row['block_size']:>7}"
                f"{row['hybrid_bytes'] / 2**20:>12.1f}{row['uniform_bytes'] / 2**20:>13.1f}"
                f"{row['ratio']:>7.1f}x"
            )
    if not args.skip_speed:
        speed = prefill_speed(args)
        results["speed"] = speed
        print(
            f"\n3. prefill of a tiny Bamba (float32, CPU, block {speed['block_size']}), "
            f"median of {args.repeats} runs; ratio = hybridkv tok/s over transformers'"
        )
        print(f"{'tokens':>8}{'hybridkv':>11}{'transformers':>14}{'ratio':>8}  spread")
        for length in args.prompt_lengths:
            r = speed[str(length)]
            print(
                f"{length:>8}{r['hybridkv_tok_s']:>11}{r['transformers_tok_s']:>14}"
                f"{r['ratio_median']:>7.2f}x  {r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
            )
    print(json.dumps(results, separators=(",", ":")))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--occupancy", type=float, nargs="+", default=[0.5, 1.0, 1.25, 1.5, 2.0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--user-tokens", type=int, nargs=2, default=(20, 80), metavar=("MIN", "MAX"))
    p.add_argument("--reply-tokens", type=int, nargs=2, default=(30, 120), metavar=("MIN", "MAX"))
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--budget", type=int, default=512, help="tokens a step (prefill chunk)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--speed-block-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-speed", action="store_true", help="only the allocator parts")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    main()
