"""``--pipeline-parallel-size``, ``--context-parallel-size`` and ``--tensor-parallel-size``
on the commands: stage, context and tensor processes started by the command or by torchrun
give the text one process gives; impossible settings are one-line errors."""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from hybridkv.serving.cli.loading import close_pipelines
from hybridkv.serving.cli.main import main

VOCAB = 64
GENERATE = ["w2 w3 w4 w5", "--max-tokens", "6", "--ignore-eos", "--kv-memory", "1MiB",
            "--block-size", "4", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def three_layer_checkpoint(make_tiny_checkpoint: Callable[..., Path]) -> Path:
    """A random three-layer Gemma 3 (sliding, sliding, full) with a word tokenizer."""
    s, f = "sliding_attention", "full_attention"
    return make_tiny_checkpoint([s, s, f], 512, VOCAB)


@pytest.fixture(autouse=True)
def _isolate() -> Iterator[None]:
    """One torch thread; stop the pipeline a command left; undo the commands' logging."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    close_pipelines()
    torch.set_num_threads(threads)
    structlog.reset_defaults()


def _generate(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["generate", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("num_stages", ["2", "3"])
def test_generate_with_stages_prints_what_one_process_prints(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str], num_stages: str
) -> None:
    """`generate -pp N` streams the text one process streams; the workers are stopped."""
    model = str(three_layer_checkpoint)
    expected = _generate(capsys, model, *GENERATE)
    assert _generate(capsys, model, *GENERATE, "--pipeline-parallel-size", num_stages) == expected
    close_pipelines()
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_generate_with_context_ranks_prints_what_one_process_prints(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate -cp 2 --kv-interleave block` streams one process's text; ranks stopped."""
    model = str(three_layer_checkpoint)
    prompt = ["w2 w3 w4 w5 w6 w7 w8", *GENERATE[1:]]
    expected = _generate(capsys, model, *prompt)
    got = _generate(capsys, model, *prompt, "-cp", "2", "--kv-interleave", "block")
    assert got == expected
    close_pipelines()
    assert not multiprocessing.active_children()


def test_generate_with_tensor_ranks_prints_what_one_process_prints(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate -tp 2` streams one process's text; the tensor rank is stopped."""
    model = str(three_layer_checkpoint)
    expected = _generate(capsys, model, *GENERATE)
    assert _generate(capsys, model, *GENERATE, "--tensor-parallel-size", "2") == expected
    close_pipelines()
    assert not multiprocessing.active_children()


def test_tensor_ranks_a_model_cannot_share_are_a_one_line_error(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-tp 3` of a model with 2 query heads: exit 2, the value named, no process."""
    code = main(["generate", str(three_layer_checkpoint), *GENERATE, "-tp", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "tensor_parallel_size=3 does not divide num_attention_heads=2 of" in err
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("flag", ["-tp", "-pp", "-cp"])
def test_quantised_weights_over_several_processes_print_what_one_process_prints(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """`--weights int8` with `-tp 2`, `-pp 2` or `-cp 2`: one int8 process's text (the
    tensor ranks cut the quantised layers, each row keeping its whole row's scale)."""
    model = str(three_layer_checkpoint)
    int8 = [*GENERATE, "--weights", "int8"]
    expected = _generate(capsys, model, *int8)
    assert _generate(capsys, model, *int8, flag, "2") == expected
    close_pipelines()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("flag", ["-tp", "-pp"])
def test_offload_over_several_processes_prints_what_one_process_prints(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str], flag: str, redis_server: Any
) -> None:
    """`--kv-offload` with `-tp 2` (a host tier) or `-pp 2` (Redis too: the full-attention
    layer is on stage 1, which rank 0 can look up only there; the pipeline then keeps one
    step in flight): every rank saves its share; the text is one process's."""
    model = str(three_layer_checkpoint)
    expected = _generate(capsys, model, *GENERATE)
    tiers = ["--kv-offload", "host:4MiB"]
    tiers += ["--kv-offload", redis_server.url] if flag == "-pp" else []
    offload = [*GENERATE, *tiers, "--kv-offload-interval", "4"]
    assert _generate(capsys, model, *offload, flag, "2") == expected
    close_pipelines()
    assert not multiprocessing.active_children()


def test_a_host_tier_a_pipeline_cannot_look_up_is_a_one_line_error(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-pp 2 --kv-offload host:...` where the full-attention group lies on stage 1 only:
    exit 2 naming the group, the stage and the way out, before any worker starts."""
    argv = [*GENERATE, "--kv-offload", "host:4MiB", "-pp", "2"]
    code = main(["generate", str(three_layer_checkpoint), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert "KV group 2 (full_attention) has no layer on stage 0" in err
    assert "add a redis:// tier" in err
    assert not multiprocessing.active_children()


def test_more_stages_than_layers_is_a_one_line_error(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four stages of a three-layer model: exit 2, the reason on one line, no process."""
    code = main(["generate", str(three_layer_checkpoint), *GENERATE, "-pp", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "pipeline_parallel_size=4 exceeds the model's 3 layers" in err
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    "flag", ["--pipeline-parallel-size", "--context-parallel-size", "--tensor-parallel-size"]
)
def test_a_non_positive_size_is_refused(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    """`-pp 0`, `-cp 0` or `-tp 0` is a usage error naming the flag."""
    code = main(["generate", "no-such-model", "w2", flag, "0"])
    assert code == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-pp", "-tp", pytest.param("-cp", marks=pytest.mark.slow)])
def test_generate_under_torchrun(
    three_layer_checkpoint: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """torchrun starts both ranks (two stages, two context ranks or two tensor ranks):
    rank 0 prints the text one process prints."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    hybridkv = shutil.which("hybridkv", path=str(Path(sys.executable).parent))
    assert torchrun and hybridkv
    model = str(three_layer_checkpoint)
    expected = _generate(capsys, model, *GENERATE)
    done = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--no-python", hybridkv, "generate", model,
         *GENERATE, flag, "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == expected
