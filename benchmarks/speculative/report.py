"""The speculative benchmark's records and its report: a run, a cell of runs, what
each variant's runs come to against plain decoding (``run.py`` measures them), and the
printed table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import attrs

from hybridkv.scheduler import SamplingParams
from hybridkv.scheduler.outputs import SpecDecodeStats
from hybridkv.scheduler.speculation import SpeculativeConfig
from hybridkv.serving.cli.loading import LoadedModel


@attrs.frozen
class Variant:
    """Plain decoding (``spec`` None) or n-gram speculation of ``k`` tokens."""

    name: str
    spec: SpeculativeConfig | None = None

    @property
    def k(self) -> int:
        return self.spec.num_speculative_tokens if self.spec else 0


@attrs.define
class Run:
    """One variant of one cell in one round."""

    seconds: float
    outputs: list[list[int]]
    itls: list[float]  # per request: seconds per token after its first
    steps: int
    spec: SpecDecodeStats | None
    foreign_cores: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


@attrs.define
class Cell:
    """A workload at a batch size: its prompts, and its runs per variant round by round."""

    workload: str
    batch: int
    prompts: list[list[int]]
    params: SamplingParams
    runs: dict[str, list[Run]] = attrs.field(factory=dict)


def copied_share(prompt: list[int], output: list[int], n: int = 4) -> float:
    """The share of ``output``'s ``n``-grams that occur in ``prompt``."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    mine = [tuple(output[i : i + n]) for i in range(len(output) - n + 1)]
    return sum(g in grams for g in mine) / len(mine) if mine else 0.0


def repeated_share(prompt: list[int], output: list[int], n: int = 4) -> float:
    """The share of ``output``'s ``n``-grams that occurred before, in the prompt or
    earlier in the output: what a prompt lookup can find."""
    tokens = prompt + output
    seen = {tuple(tokens[i : i + n]) for i in range(len(prompt) - n + 1)}
    starts = range(max(0, len(prompt) - n + 1), len(tokens) - n + 1)
    found = 0
    for i in starts:  # the n-grams that end in the output
        gram = tuple(tokens[i : i + n])
        found += gram in seen
        seen.add(gram)
    return found / len(starts) if starts else 0.0


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int:
    """The first position where the token lists differ (the shorter length if one is a
    prefix of the other)."""
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return position
    return min(len(ours), len(theirs))


def differences(runs: list[Run], base: list[Run], model: LoadedModel) -> list[dict[str, Any]]:
    """Every request whose tokens in ``runs`` differ from ``base``'s in the same round:
    where, and the text around the first difference."""
    found = []
    for round_, (run, off) in enumerate(zip(runs, base, strict=True)):
        for index, (ours, theirs) in enumerate(zip(run.outputs, off.outputs, strict=True)):
            if ours != theirs:
                at = first_difference(ours, theirs)
                window = slice(max(0, at - 8), at + 8)
                found.append(
                    {
                        "round": round_,
                        "prompt": index,
                        "position": at,
                        "speculative": model.tokenizer.decode(ours[window]),
                        "off": model.tokenizer.decode(theirs[window]),
                    }
                )
    return found


def spread(values: list[float]) -> dict[str, Any]:
    """The median of ``values`` (a ratio per round), their min and max, and themselves."""
    return {
        "ratio": statistics.median(values),
        "ratio_min": min(values),
        "ratio_max": max(values),
        "ratios": values,
    }


def summarise(cell: Cell, variants: list[Variant], model: LoadedModel) -> list[dict[str, Any]]:
    """One row per variant of ``cell``: medians over rounds, ratios to the same round's
    ``off``, acceptance, and whether the greedy tokens equal ``off``'s."""
    base = cell.runs["off"]
    rows = []
    for variant in variants:
        runs = cell.runs[variant.name]
        row: dict[str, Any] = {
            "workload": cell.workload,
            "batch": cell.batch,
            "variant": variant.name,
            "k": variant.k,
            "requests": len(cell.prompts),
            "output_tokens": statistics.median(run.output_tokens for run in runs),
            "out_tok_s": statistics.median(run.tok_s for run in runs),
            **spread([run.tok_s / off.tok_s for run, off in zip(runs, base, strict=True)]),
            "itl_ms": statistics.median(statistics.median(run.itls) * 1e3 for run in runs),
            "ms_per_step": statistics.median(run.seconds / run.steps * 1e3 for run in runs),
            "tokens_per_step": statistics.median(run.output_tokens / run.steps for run in runs),
            "rounds_out_tok_s": [run.tok_s for run in runs],
            "foreign_cores": [run.foreign_cores for run in runs],
        }
        if variant.spec is None:
            pairs = list(zip(cell.prompts, base[0].outputs, strict=True))
            row["copied_4grams"] = statistics.mean(copied_share(p, o) for p, o in pairs)
            row["repeated_4grams"] = statistics.mean(repeated_share(p, o) for p, o in pairs)
        else:
            counts = [run.spec for run in runs if run.spec is not None]
            drafts = sum(c.num_drafts for c in counts)
            proposed = sum(c.num_draft_tokens for c in counts)
            accepted = sum(c.num_accepted_tokens for c in counts)
            mismatches = differences(runs, base, model)
            row |= {
                "lookup_min": variant.spec.prompt_lookup_min,
                "lookup_max": variant.spec.prompt_lookup_max,
                "drafts": drafts,
                "draft_tokens": proposed,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / proposed if proposed else None,
                "accepted_per_draft": accepted / drafts if drafts else None,
                "identical": not mismatches,
                "mismatches": mismatches,
            }
        rows.append(row)
    return rows


def _tok_s(run: tuple[float, list[dict[str, Any]], float]) -> float:
    tokens: int = sum(a["timings"]["predicted_n"] for a in run[1])
    return tokens / run[0]


# -- the report --------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}\n")
    print(
        "| workload | batch | variant | out tok/s | ratio to off: median (min-max) | ITL ms "
        "| accept | tokens/step | identical |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        ratio = f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
        accept, same = "-", "-"
        if row["variant"] != "off":
            rate = row.get("acceptance_rate")
            accept = "-" if rate is None else f"{rate:.2f}"
            same = "yes" if row["identical"] else "NO"
        elif "repeated_4grams" in row:
            accept = f"(repeats {row['repeated_4grams']:.2f})"
        per_step = f"{row['tokens_per_step']:.2f}" if "tokens_per_step" in row else "-"
        print(
            f"| {row['workload']} | {row['batch']} | {row['variant']} | {row['out_tok_s']:.1f} "
            f"| {ratio} | {row['itl_ms']:.1f} | {accept} | {per_step} | {same} |"
        )
