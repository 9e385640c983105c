"""Each family added since the first five, from the command line: ``hybridkv generate``
in-process, and ``hybridkv serve`` in its own process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from model_fixtures import NEW_FAMILIES
from server_process import Server

from hybridkv.serving.cli.main import main
from hybridkv.testing import byte_tokenizer

pytestmark = pytest.mark.usefixtures("command_isolation")


def _folder_of(tiny_models: Any, name: str, tmp_path: Path) -> Path:
    """A copy of the tiny checkpoint with the byte tokenizer (its ASCII ids are in the
    tiny vocabulary)."""
    folder = tmp_path / name
    shutil.copytree(tiny_models[name].path, folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize(
    "name",
    [
        *NEW_FAMILIES,
        "qwen3_next",
        "qwen3_5",
        "lfm2",
        "lfm3",
        "jamba",
        "mamba2",
        "nemotron_h",
        "minimax",
        "falcon_h1",
        "zamba2",
        "kimi_linear",
        "bailing_hybrid",
        "deepseek_v4",
    ],
)
def test_generate_runs_each_new_family(
    name: str, tiny_models: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder_of(tiny_models, name, tmp_path)
    code = main(["generate", str(folder), "a prompt longer than the window", "--max-tokens",
                 "5", "--ignore-eos", "--kv-memory", "1MiB", "--block-size", "4"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert "5 generated (length)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3", "deepseek_v4"])
def test_serve_answers_with_a_new_family(name: str, tiny_models: Any, tmp_path: Path) -> None:
    """``hybridkv serve`` in its own process on Qwen3, on DeepSeek V3 (latent attention)
    and on DeepSeek V4 (a window, compressed entries and their state), answers a
    completion."""
    import httpx

    folder = _folder_of(tiny_models, name, tmp_path)
    server = Server(["serve", str(folder), "--port", "0", "--kv-memory", "1MiB"])
    try:
        body = {"model": name, "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        assert answer.get("usage", {}).get("completion_tokens") == 4, answer
    finally:
        server.stop()


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_generate_serves_a_multimodal_checkpoints_text_only_when_asked(
    name: str, tiny_multimodal: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--text-only`` the command fails naming the flag; with it, it generates."""
    folder = str(tiny_multimodal[name].path)
    args = ["generate", folder, "a prompt longer than the window", "--max-tokens", "4",
            "--ignore-eos", "--kv-memory", "1MiB", "--block-size", "4"]  # fmt: skip
    assert main(args) != 0
    assert "--text-only" in capsys.readouterr().err
    assert main([*args, "--text-only"]) == 0, capsys.readouterr().err
    assert "4 generated (length)" in capsys.readouterr().err
