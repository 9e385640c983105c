"""``hybridkv plan``: the KV layout of a model in a memory budget, beside a uniform one."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from hybridkv.memory.sizes import parse_size
from hybridkv.serving.cli.flags.values import UsageError, dtype_bytes, load_config

if TYPE_CHECKING:
    from hybridkv.memory.layout import AttentionSpec, LayerSpec, LayoutPlan, ModelLayer
    from hybridkv.memory.layout_planner import PlanReport
    from hybridkv.models.shapes.state import StateShape

_T = TypeVar("_T")


def split_stages(names: Sequence[_T], num_stages: int) -> list[list[_T]]:
    """Contiguous stages of near-equal layer counts, earlier stages taking the remainder."""
    if num_stages < 1:
        raise UsageError(f"--pp-stages must be >= 1, got {num_stages}")
    base, extra = divmod(len(names), num_stages)
    stages, start = [], 0
    for i in range(num_stages):
        stop = start + base + (1 if i < extra else 0)
        stages.append(list(names[start:stop]))
        start = stop
    return stages


def register_plan(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hybridkv plan MODEL --kv-memory SIZE``."""
    parser = subparsers.add_parser(
        "plan",
        help="print the KV layout of a model in a memory budget",
        description="Print the KV cache groups, page size and pool size a model gets in a "
        "KV memory budget, and what a uniform (all full attention) allocator would fit.",
    )
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="config.json, a folder with one, or a built-in name (published shapes: "
        "llama-like, qwen3-8b-like, gemma3-like, bamba-like, ...; a name it does not know "
        "is answered with the list)",
    )
    parser.add_argument(
        "--kv-memory", required=True, metavar="SIZE", help="KV memory per device: 2GiB, 1e9"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the KV cache")
    parser.add_argument("--pp-stages", type=int, default=1, help="pipeline stages")
    parser.add_argument(
        "--context-parallel-size",
        "-cp",
        type=int,
        default=1,
        metavar="N",
        help="context-parallel ranks sharing each request's pages, each with --kv-memory",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks, each holding its share of every layer's KV heads "
        "in --kv-memory of its own",
    )
    parser.add_argument(
        "--request-tokens",
        type=int,
        default=4096,
        metavar="L",
        help="tokens per request (prompt and output) in the capacity table",
    )
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="speculative decoding as serve takes it; with method mtp the checkpoint's "
        "MTP layer's memory is planned in the pool too",
    )
    from hybridkv.serving.cli.flags.engine import add_layer_policy_argument

    add_layer_policy_argument(parser)
    parser.set_defaults(handler=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Plan the layout and print it."""
    from hybridkv.memory.layout import (
        AttentionSpec,
        NoCacheSpec,
        StateSpec,
        cached_layers,
        owns_pages,
    )
    from hybridkv.memory.layout_planner import describe, plan_layout
    from hybridkv.models.specs import layer_specs_from_config, tensor_rank_spec
    from hybridkv.policies import CompressedEntries
    from hybridkv.serving.cli.flags.engine import parse_layer_policies

    budget = parse_size(args.kv_memory)
    if args.request_tokens < 1:
        raise UsageError(f"--request-tokens must be >= 1, got {args.request_tokens}")
    label, config = load_config(args.model)
    policies = dict(parse_layer_policies(args.layer_policies))
    layers = layer_specs_from_config(config, dtype_bytes(args.dtype), policies=policies)
    mtp = _mtp_specs(config, layers, args.speculative_config)
    specs = cached_layers([*layers, *mtp])
    tp = args.tensor_parallel_size
    if tp < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {tp}")
    one_process, mamba = specs, _state_shape(config)
    specs = [tensor_rank_spec(s, tp, mamba) for s in specs]
    cuts = split_stages(layers, args.pp_stages)
    cuts[-1] = [*cuts[-1], *mtp]  # the MTP layer runs after the last stage's
    stages = [[s.name for s in cached_layers(stage)] for stage in cuts]
    plan = plan_layout(specs, budget, args.block_size, stages=stages)
    report = describe(plan, specs, args.request_tokens)
    summary = ", ".join(f"{p.num_layers} {p.policy}" for p in report.policies)
    raised = plan.block_size != args.block_size
    readers = sum(1 for s in specs if not owns_pages(s))
    shared = f"; {readers} more read an earlier layer's" if readers else ""
    cacheless = sum(1 for s in layers if isinstance(s, NoCacheSpec))
    if cacheless:
        shared += f"; {cacheless} more keep nothing"
    besides = [s.beside for s in layers if isinstance(s, AttentionSpec) and s.beside is not None]
    states = sum(1 for s in besides if isinstance(s, StateSpec))
    if states:
        shared += f"; {states} layers hold a K/V and a state each"
    latent = [s for s in layers if isinstance(s, AttentionSpec) and s.latent]
    indexed = [s for s in besides if isinstance(s, AttentionSpec)]
    entries = [s for s in indexed if isinstance(s.policy, CompressedEntries)]
    if latent:
        what = "one vector a token read as key and value" if entries else "latent attention"
        shared += f"; {what}: {latent[0].head_dim} values a token and layer"
    if entries:
        widths = "/".join(str(w) for w in sorted({s.head_dim for s in entries}))
        shared += f", and compressed entries of {widths} values in {len(entries)}"
    elif indexed:
        shared += f", and {indexed[0].head_dim} of an indexer's keys in {len(indexed)}"
    kept = len(specs) - readers
    if mtp:
        shared += "; the last its MTP layer (speculative method mtp)"
    print(f"model   {label}: {kept} KV layers ({summary or 'attention-free'}{shared})")
    print(
        f"budget  {_bytes(budget)} per device, {args.dtype}, block size {plan.block_size}"
        + (f" (raised from {args.block_size} so a page holds a state)" if raised else "")
        + (f", state pages of {plan.state_span} K/V pages" if plan.state_span > 1 else "")
    )
    if plan.groups:
        print("\n".join(format_plan(plan, report)))
        if tp > 1:
            print("\n".join(format_tensor(one_process, mamba, budget, args, tp)))
        if args.context_parallel_size > 1:
            print(
                "\n".join(
                    format_context(plan, specs, args.request_tokens, args.context_parallel_size)
                )
            )
    else:
        print("no KV cache: the model has no attention or state layers")
    return 0


def _mtp_specs(
    config: dict[str, Any], layers: Sequence[ModelLayer], speculative: str | None
) -> tuple[AttentionSpec, ...]:
    """The spec of the checkpoint's first MTP layer where ``--speculative-config`` names
    method mtp, else none.

    Raises:
        UsageError: a bad ``--speculative-config``.
        ModelConfigError: method mtp for a model without MTP layers.
    """
    from hybridkv.models.families import family_for, mtp_specs
    from hybridkv.serving.cli.flags.speculative import speculative_config

    spec = speculative_config(speculative)
    if spec is None or spec.method != "mtp":
        return ()
    return mtp_specs(family_for(str(config.get("model_type"))), config, layers)


def format_plan(plan: LayoutPlan, report: PlanReport) -> list[str]:
    """The tables of a plan with KV groups: groups, policies, stages, capacity, padding."""
    out = [
        f"pool    {_count(len(plan.groups), 'group')}, "
        f"{_count(plan.group_size, 'slot')} per device, "
        f"{plan.num_blocks} pages (the null page included)",
        *_page_lines(plan, report),
        "",
    ]
    slot_bytes = sum(report.stage_slots) * plan.block_bytes
    out += _table(
        ["group", "policy", "layers", "pages/request", "page", "padding/page"],
        [[g.group_id, g.policy, g.num_layers, g.blocks_per_request,
          "state" if g.page_ids > 1 else "K/V",
          _share(g.padding_bytes_per_block, slot_bytes * g.page_ids)] for g in report.groups],
    )  # fmt: skip
    total = report.blocks_per_request
    out.append("")
    out += _table(
        ["policy", "groups", "layers", "pages/request", "share of page ids"],
        [[p.policy, p.num_groups, p.num_layers, p.blocks_per_request,
          f"{p.page_ids_per_request / total:.1%}"] for p in report.policies],
    )  # fmt: skip
    if len(plan.stages) > 1:
        out.append("")
        out += _table(
            ["stage", "layers", "slots"],
            [[i, len(names), num] for i, (names, num)
             in enumerate(zip(plan.stages, report.stage_slots, strict=True))],
        )  # fmt: skip
    n = report.request_tokens
    hybrid, uniform = report.max_requests, report.uniform_max_requests
    tokens = (None if hybrid is None else hybrid * n, None if uniform is None else uniform * n)
    out.append("")
    out += _table(
        ["capacity", "hybrid", "uniform", "gain"],
        [
            ["blocks", plan.num_blocks, plan.uniform_num_blocks, ""],
            [f"requests of {n} tokens", hybrid, uniform, _gain(hybrid, uniform)],
            ["tokens that fit", *tokens, _gain(*tokens)],
            ["longest request", report.max_request_tokens, report.uniform_max_request_tokens,
             _gain(report.max_request_tokens, report.uniform_max_request_tokens)],
        ],
    )  # fmt: skip
    where = "over all stages" if len(plan.stages) > 1 else "in the pool"
    return [
        *out,
        "",
        f"padding {report.padding_fraction:.1%} of the bytes held by requests of {n} tokens; "
        f"at most {_bytes(plan.padding_bytes)} {where}",
        "uniform: one group of every layer as full attention, in the same bytes",
    ]


def _page_lines(plan: LayoutPlan, report: PlanReport) -> list[str]:
    """The two page sizes (in one slot), the bytes each kind takes per request
    (over every slot) and its padding."""
    slot_bytes = sum(report.stage_slots) * plan.block_bytes
    kinds = [("K/V", [g for g in report.groups if not g.keeps_state])]
    kinds.append(("state", [g for g in report.groups if g.keeps_state]))
    out = []
    for name, groups in kinds:
        if not groups:
            continue
        ids = groups[0].page_ids
        size = f"{_bytes(plan.block_bytes * ids)}"  # in one slot
        if name == "K/V":
            size += f" ({plan.block_size} tokens)"
        elif ids > 1:
            size += f" ({ids} K/V pages)"
        held = sum(g.blocks_per_request * g.page_ids for g in groups) * slot_bytes
        padding = sum(g.blocks_per_request * g.padding_bytes_per_block for g in groups)
        out.append(
            f"{name:<7} page {size}; requests of {report.request_tokens} tokens hold "
            f"{_bytes(held)} each, {_share(padding, held)} padding"
        )
    return out


def format_context(
    plan: LayoutPlan, specs: Sequence[LayerSpec], request_tokens: int, cp: int
) -> list[str]:
    """Capacity with ``cp`` context-parallel ranks, each with the plan's memory: the engine
    counts virtual blocks of ``block_size * cp`` tokens, as many as one rank has pages."""
    import attrs

    from hybridkv.memory.layout_planner import describe

    if cp < 1:
        raise UsageError(f"--context-parallel-size must be >= 1, got {cp}")
    rows = []
    for ranks in sorted({1, cp}):
        virtual = attrs.evolve(plan, block_size=plan.block_size * ranks)
        report = describe(virtual, specs, request_tokens)
        rows.append([ranks, virtual.block_size, report.max_request_tokens, report.max_requests])
    return [
        "",
        f"context parallelism: {cp} ranks, {_bytes(plan.budget_bytes)} of KV each",
        *_table(
            ["ranks", "tokens/block", "longest request", f"requests of {request_tokens} tokens"],
            rows,
        ),
    ]


def _state_shape(config: dict[str, Any]) -> StateShape | None:
    """The state mixer's shape of a config with state layers (Bamba, Qwen3-Next ...)."""
    from hybridkv.models.families import family_for, normalized
    from hybridkv.models.hf_config import text_config

    cfg = text_config(config)
    family = family_for(str(cfg.get("model_type")))
    if family is None or family.state_shape is None:
        return None
    return family.state_shape(normalized(family, cfg))


def format_tensor(
    specs: Sequence[LayerSpec],
    mamba: StateShape | None,
    budget: int,
    args: argparse.Namespace,
    tp: int,
) -> list[str]:
    """Per-rank KV bytes and capacity with ``tp`` tensor ranks, each with ``budget``,
    beside one process with the same budget."""
    from hybridkv.memory.layout import AttentionSpec
    from hybridkv.memory.layout_planner import describe, plan_layout
    from hybridkv.models.specs import tensor_rank_spec

    rows = []
    for ranks in (1, tp):
        held = [tensor_rank_spec(s, ranks, mamba) for s in specs]
        plan = plan_layout(held, budget, args.block_size, stages=[[s.name for s in held]])
        report = describe(plan, held, args.request_tokens)
        kv_heads = sorted({s.num_kv_heads for s in held if isinstance(s, AttentionSpec)})
        token = sum(_token_bytes(s) for s in held if isinstance(s, AttentionSpec))
        rows.append(
            [ranks, "/".join(map(str, kv_heads)) or "-", _bytes(token), plan.num_blocks,
             report.max_request_tokens, report.max_requests]
        )  # fmt: skip
    return [
        "",
        f"tensor parallelism: {tp} ranks, {_bytes(budget)} of KV each",
        *_table(
            ["ranks", "KV heads/rank", "KV bytes/token/rank", "pages", "longest request",
             f"requests of {args.request_tokens} tokens"],
            rows,
        ),
    ]  # fmt: skip


def _table(header: list[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [header] + [["unbounded" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in cells]  # fmt: skip


def _bytes(num: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= size:
            return f"{num / size:.2f} {unit}"
    return f"{num} B"


def _count(num: int, noun: str) -> str:
    return f"{num} {noun}" if num == 1 else f"{num} {noun}s"


def _share(part: int, whole: int) -> str:
    return f"{_bytes(part)} ({part / whole:.1%})" if part else "0 B"


def _gain(hybrid: int | None, uniform: int | None) -> str:
    if hybrid is None or uniform is None:
        return ""
    return f"{hybrid / uniform:.2f}x" if uniform else "inf"


def _token_bytes(spec: AttentionSpec) -> int:
    """Bytes a token's keys and values take in ``spec``'s layer where they are kept (an
    entry's share, where one entry stands for ``rate`` tokens)."""
    from hybridkv.policies import CompressedEntries

    tokens = spec.policy.rate if isinstance(spec.policy, CompressedEntries) else 1
    return spec.block_bytes(tokens) // tokens
