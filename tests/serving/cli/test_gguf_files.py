"""A GGUF file as the model: converted once into the cache by transformers' GGUF reader,
then served as its family with the original checkpoint's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_samples import write_gguf
from model_fixtures import TinyModel

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.serving.cli.builtin_models import resolve_model
from hybridkv.serving.cli.main import main

pytestmark = pytest.mark.usefixtures("command_isolation")


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gguf_file_serves_the_checkpoints_logits(
    arch: str, tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """Converted on first use (and not again), then a prompt and decode steps give the
    logits and greedy tokens of the checkpoint the file was written from."""
    gguf, hf = write_gguf(arch, tmp_path)
    said: list[str] = []
    name, folder = resolve_model(str(gguf), progress=said.append)
    assert name == gguf.name and any("converting it once" in line for line in said)
    again: list[str] = []
    assert resolve_model(str(gguf), progress=again.append) == (name, folder) and not again
    executor = ModelExecutor.from_pretrained(
        folder, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    driver = drive(executor)
    driver.add("a", prompt_of(23, 1))
    driver.run(5)
    check_reference(TinyModel.load(arch, hf), driver, "a")


def test_generate_takes_a_gguf_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf, _ = write_gguf("qwen3", tmp_path)
    args = ["generate", str(gguf), "hello there", "--max-tokens", "4", "--ignore-eos",
            "--kv-memory", "1MiB", "--block-size", "4"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    assert "4 generated (length)" in capsys.readouterr().err
