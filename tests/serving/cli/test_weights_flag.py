"""``--weights`` on the commands: int8 and int4 load and run; ``auto`` resolves per model."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.models.weights.precision import machine_default
from hybridkv.serving.cli.flags.engine import EngineArgs
from hybridkv.serving.cli.loading import _weight_format
from hybridkv.serving.cli.main import main

pytestmark = pytest.mark.usefixtures("command_isolation")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_generate_runs_with_quantised_weights(
    weights: str, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --weights int8|int4` loads the model so and generates."""
    code = main(["generate", str(tiny_checkpoint), "w2 w3 w4", "--max-tokens", "5",
                 "--ignore-eos", "--kv-memory", "1MiB", "--block-size", "4",
                 "--weights", weights])  # fmt: skip
    assert code == 0
    assert "3 prompt tokens, 5 generated (length)" in capsys.readouterr().err


def test_demo_summary_names_the_weights(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's summary line says which weights ran, and when auto chose them."""
    code = main(["demo", str(tiny_checkpoint), "--requests", "2", "--rate", "1000",
                 "--max-tokens", "3", "--kv-memory", "4MiB", "--block-size", "4"])  # fmt: skip
    assert code == 0
    assert "weights dtype (machine default)" in capsys.readouterr().out


def test_auto_is_the_machine_default_for_built_in_models_only() -> None:
    """auto: the machine's format for a built-in model, dtype for a checkpoint folder and
    for several processes; an explicit int8 holds for a pipeline too."""
    auto = EngineArgs()
    assert _weight_format(auto, builtin=True) == machine_default()
    assert _weight_format(auto, builtin=False) == "dtype"
    assert _weight_format(EngineArgs(pipeline_parallel_size=2), builtin=True) == "dtype"
    explicit = EngineArgs(weights="int8", pipeline_parallel_size=2)
    assert _weight_format(explicit, builtin=True) == "int8"
