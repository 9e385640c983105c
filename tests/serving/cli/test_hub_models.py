"""A checkpoint by hub name: resolved from a hub cache the test lays out offline
(``HF_HOME``, ``HF_HUB_OFFLINE=1``), as huggingface_hub writes one, in a fresh
interpreter (huggingface_hub reads its environment when first imported)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridkv.serving.cli.hub import is_hub_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_MAIN = "import sys; from hybridkv.serving.cli.main import main; sys.exit(main())"


@pytest.fixture
def hub_home(tmp_path: Path, tiny_checkpoint: Path) -> Path:
    """An HF_HOME whose hub cache holds ``acme/tiny`` at COMMIT, the main branch."""
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny"
    shutil.copytree(tiny_checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hf"


def _hybridkv(hub_home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", _MAIN, *argv], env=env, capture_output=True, text=True, timeout=300
    )


def test_generate_loads_a_hub_name_from_the_cache(hub_home: Path) -> None:
    done = _hybridkv(hub_home, "generate", "acme/tiny", "w2 w3 w4", "--max-tokens", "5",
                     "--ignore-eos", "--kv-memory", "1MiB", "--block-size", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 5
    snapshot = hub_home / "hub" / "models--acme--tiny" / "snapshots" / COMMIT
    assert f"loading acme/tiny from {snapshot}" in done.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["acme/missing", "w2"], "acme/missing is not in the hub cache"),
        (["acme/tiny", "w2", "--revision", "v9"], "acme/tiny at revision 'v9' is not in the hub"),
    ],
)
def test_a_name_the_cache_lacks_offline_is_one_line_naming_it(
    hub_home: Path, argv: list[str], said: str
) -> None:
    done = _hybridkv(hub_home, "generate", *argv, "--max-tokens", "1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "HF_HUB_OFFLINE is set" in lines[0]


def test_hub_names_are_org_slash_name() -> None:
    assert is_hub_name("Qwen/Qwen3-0.6B") and is_hub_name("openai/gpt-oss-20b")
    assert not is_hub_name("gemma-3-270m") and not is_hub_name("a/b/c")
    assert not is_hub_name("../x") and not is_hub_name("/abs/path")


def test_serve_answers_from_a_hub_name_in_the_cache(tmp_path: Path, tiny_models: Any) -> None:
    """``hybridkv serve Qwen/Qwen3-0.6B`` in its own process, offline, from a hub cache
    holding a tiny Qwen3 under that name: it answers a completion with that model name."""
    import httpx
    from server_process import Server

    from hybridkv.testing import byte_tokenizer

    repo = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-0.6B"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(tiny_models["qwen3"].path, snapshot)
    byte_tokenizer().save(str(snapshot / "tokenizer.json"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    server = Server(["serve", "Qwen/Qwen3-0.6B", "--port", "0", "--kv-memory", "1MiB"], env=env)
    try:
        body = {"model": "Qwen/Qwen3-0.6B", "prompt": "hello there", "max_tokens": 3,
                "ignore_eos": True}  # fmt: skip
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        assert answer.get("usage", {}).get("completion_tokens") == 3, answer
        assert answer["model"] == "Qwen/Qwen3-0.6B"
    finally:
        server.stop()
