"""The short text ``make gpu-check`` prints last and writes to ``summary.txt``: what ran,
what failed, and the attention rows against the goals (decode at >= 40% of HBM
bandwidth, paged attention within 1.2x of contiguous SDPA)."""

from __future__ import annotations

from typing import Any

HBM_GOAL, RATIO_GOAL = 0.40, 1.2


def summary(result: dict[str, Any]) -> str:
    device = result["device"]
    lines = [
        f"hybridkv gpu-check{' (dry run, CPU)' if result['dry_run'] else ''}: {device['name']}, "
        f"torch {device['torch_version']}, CUDA {device['cuda_version']}",
        f"copy bandwidth {device['copy_bandwidth'] / 1e9:.0f} GB/s (read + write)"
        + (
            f", published HBM {device['nominal_bandwidth'] / 1e9:.0f} GB/s"
            if device["nominal_bandwidth"]
            else ""
        ),
    ]
    lines.append(
        "grouped_mm (the MoE path): "
        + ", ".join(f"{dtype} {verdict}" for dtype, verdict in result["grouped_mm"].items())
    )
    for name, render in (
        ("tests", _tests),
        ("attention", _attention),
        ("state", _state),
        ("engine", _engine),
        ("families", _families),
    ):
        section = result[name]
        if "error" in section:
            lines.append(f"{name}: FAILED to run: {section['error']}")
        else:
            lines += render(section["result"])
    return "\n".join(lines)


def _tests(r: dict[str, Any]) -> list[str]:
    ran = r.get("tests", 0) - r.get("skipped", 0)
    bad = r.get("failures", 0) + r.get("errors", 0)
    lines = [f"cuda tests: {ran - bad} passed, {bad} failed, {r.get('skipped', 0)} skipped"]
    return lines + [f"  failed: {name}" for name in r["failed_tests"]]


def _attention(r: dict[str, Any]) -> list[str]:
    lines = ["attention, bf16, GQA 8:1, block 16 (ms; paged/contiguous; GB/s and share of HBM):"]
    decodes = [row for row in r["rows"] if row["mode"] == "decode"]
    for row in r["rows"]:
        head = (
            f"  {row['mode']:<7} B={row['batch']:<3} ctx={row['context']:<6} D={row['head_dim']:<4}"
        )
        if "error" in row:
            lines.append(f"{head} error {row['error']}")
            continue
        cells = f"paged {row['paged_ms']['median']:.3f} contig {row['contiguous_ms']['median']:.3f}"
        if "flex_paged_ms" in row:
            cells += f" flex {row['flex_paged_ms']['median']:.3f}"
        if "flash_attn_ms" in row:
            cells += f" flash {row['flash_attn_ms']['median']:.3f}"
        cells += f" ratio {row['paged_over_contiguous']:.2f}"
        if "kv_gathered_over_contiguous" in row:
            cells += f" (K+V gathered {row['kv_gathered_over_contiguous']:.2f})"
        if row["mode"] == "decode":
            share = row.get("paged_of_hbm", row["paged_of_copy_bw"])
            cells += f" {row['paged_gbps']:.0f} GB/s ({share:.0%})"
        else:
            cells += f" {row['paged_tflops']:.0f} TFLOP/s"
        lines.append(f"{head} {cells}")
    if r["skipped"]:
        lines.append(f"  {len(r['skipped'])} rows skipped (time budget)")
    lines.append(f"  flash_attn: {r['flash_attn'] or 'not installed'}")
    timed = [row for row in decodes if "error" not in row]
    if timed:
        shares = [row.get("paged_of_hbm", row["paged_of_copy_bw"]) for row in timed]
        ratios = [row["paged_over_contiguous"] for row in timed]
        lines.append(
            f"  goals: decode >= {HBM_GOAL:.0%} of HBM in {sum(s >= HBM_GOAL for s in shares)}"
            f" of {len(timed)} rows (best {max(shares):.0%}); paged <= {RATIO_GOAL}x contiguous"
            f" in {sum(x <= RATIO_GOAL for x in ratios)} of {len(timed)} (median "
            f"{sorted(ratios)[len(ratios) // 2]:.2f})"
        )
    return lines


def _state(r: dict[str, Any]) -> list[str]:
    lines = []
    for dtype, s in r.items():
        err = s["relative_error_vs_cpu"]
        lines.append(
            f"mamba2 {dtype}: vs CPU rel. error prefill {err['prefill']:.1e} decode "
            f"{err['decode']:.1e}; prefill {s['prefill_tokens_per_s']} tok/s, decode batch "
            f"{s['shape']['decode_batch']} {s['decode_ms']['median']:.3f} ms "
            f"({s['decode_gbps']} GB/s, {s['decode_of_copy_bw']:.0%} of copy)"
        )
    return lines


def _engine(r: dict[str, Any]) -> list[str]:
    gib = 1 << 30
    peak = r["max_allocated_bytes"]
    memory = f"forecast {r['forecast_bytes'] / gib:.2f} GiB (weights + KV pool)"
    if peak is not None:
        memory += f", after load {r['allocated_after_load_bytes'] / gib:.2f}, peak {peak / gib:.2f}"
    syncs = r["host_syncs_over_16_steps_by_line"]
    waits = (
        "not counted on the CPU"
        if syncs is None
        else (", ".join(f"{line} x{n}" for line, n in syncs.items()) or "none")
    )
    return [
        f"engine: {r['requests']} requests x ({r['prompt_tokens']} + {r['max_tokens']}) tokens:"
        f" {r['output_tokens_per_s']} output tok/s ({r['seconds']} s); {memory}",
        f"  host syncs over 16 steps of 8 requests: {waits}",
    ]


def _families(r: dict[str, Any]) -> list[str]:
    verdicts = [f"{name} {'ok' if v['passed'] else 'FAILED'}" for name, v in r.items()]
    failed = [f"  {name}: {v}" for name, v in r.items() if not v["passed"]]
    return ["families on the device vs CPU tokens: " + ", ".join(verdicts), *failed]
