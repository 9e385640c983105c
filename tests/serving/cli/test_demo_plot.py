"""``--plot`` of demo and bench: the pages per KV group recorded over a run, and drawn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import pytest

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import Engine, EngineConfig, FakeExecutor
from hybridkv.serving.cli.main import main
from hybridkv.serving.cli.workload.plots import PAGES_FORMAT, draw_pages_per_group, group_lines
from hybridkv.serving.cli.workload.run import WorkloadResult, run_workload, synthetic_workload

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VOCAB = 64


pytestmark = pytest.mark.usefixtures("command_isolation")


def _check_outputs(png: Path) -> dict[str, object]:
    """The PNG starts with its signature; the JSON beside it has a series per group."""
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    series = json.loads(png.with_suffix(".json").read_text())
    assert series["format"] == PAGES_FORMAT
    steps = series["steps"]
    assert len(steps) >= 2 and steps == sorted(set(steps))  # one sample per step
    assert [g["group"] for g in series["groups"]] == [0, 1]  # sliding, full
    for group in series["groups"]:
        assert len(group["pages"]) == len(steps)
        assert max(group["pages"]) > 0
    return series


def test_demo_plot_writes_the_chart_and_its_series(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hybridkv demo --plot FILE` saves a PNG at FILE and the series at FILE.json."""
    png = tmp_path / "pages.png"
    # One request: it arrives at the start, so the run never waits for an arrival.
    code = main(["demo", str(tiny_checkpoint), "--requests", "1", "--max-tokens", "6",
                 "--kv-memory", "4MiB", "--block-size", "4", "--plot", str(png)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "pages per group at peak" in captured.out  # the summary is unchanged
    series = _check_outputs(png)
    assert str(series["source"]).startswith("hybridkv demo ")
    assert f"pages per group: {png}" in captured.err


def test_bench_plot_draws_the_hybrid_run(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hybridkv bench --compare-uniform --plot FILE` prints both rows and draws the hybrid
    layout's run (two groups; the uniform layout has one)."""
    png = tmp_path / "bench.png"
    code = main(["bench", str(tiny_checkpoint), "--requests", "3", "--prompt-len", "20",
                 "--output-len", "3", "--compare-uniform", "--kv-memory", "1MiB",
                 "--block-size", "4", "--plot", str(png)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert [line.split()[0] for line in captured.out.splitlines()] == [
        "layout",
        "hybrid",
        "uniform",
    ]
    _check_outputs(png)


def test_plot_without_matplotlib_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without matplotlib, --plot fails before any model loads, naming the bench extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    code = main(["bench", "no-such-model", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "hybridkv[bench]" in err and "matplotlib" in err


@pytest.mark.parametrize("name", ["missing/pages.png", "pages.json"])
def test_plot_to_an_unusable_file_is_refused_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A --plot file in no folder, or named .json (the series' name), exits 2 at once."""
    code = main(["demo", "no-such-model", "--plot", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--plot" in err


def _fake_run() -> tuple[WorkloadResult, EngineConfig]:
    config = EngineConfig(
        policies=[FullAttention(), SlidingWindow(window=8)],
        num_blocks=128,
        block_size=4,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        vocab_size=VOCAB,
    )
    requests = synthetic_workload(num_requests=6, prompt_len=40, output_len=12, vocab_size=VOCAB)

    async def go() -> WorkloadResult:
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            return await run_workload(engine, requests)

    return anyio.run(go), config


def test_run_workload_records_pages_once_per_step() -> None:
    """On the fake executor: a sample per step, in step order, one count per group; the
    pool is empty at the start and at the end, and a full group outgrows a window one."""
    result, config = _fake_run()
    samples = result.pages
    steps = [s.step for s in samples]
    assert steps == sorted(set(steps)) and len(steps) > 2
    assert all(len(s.blocks_per_group) == len(config.policies) for s in samples)
    assert samples[0].blocks_per_group == (0, 0)
    assert samples[-1].blocks_per_group == (0, 0)
    full, window = (max(s.blocks_per_group[g] for s in samples) for g in (0, 1))
    assert (full, window) == result.peak_blocks_per_group
    assert full > window > 0


def test_draw_merges_identical_groups(tmp_path: Path) -> None:
    """Groups with the same series share a line and a label naming them all."""
    series = {
        "format": PAGES_FORMAT,
        "title": "test",
        "source": "test",
        "block_size": 4,
        "pool_pages": 10,
        "steps": [0, 1, 2],
        "elapsed_s": [0.0, 0.1, 0.2],
        "groups": [
            {"group": g, "policy": p, "num_layers": 1, "pages": pages}
            for g, p, pages in [
                (0, "full", [0, 3, 0]),
                (1, "sliding", [0, 2, 0]),
                (2, "sliding", [0, 2, 0]),
            ]
        ],
    }
    assert group_lines(series) == [
        ("group 0: full, 1 layer", [0, 3, 0]),
        ("groups 1, 2: sliding (1 layer each, the same pages)", [0, 2, 0]),
    ]
    out = draw_pages_per_group(series, tmp_path / "merged.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE
