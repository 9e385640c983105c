"""The README's code examples run as written."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_embedding_example_runs(tmp_path: Path) -> None:
    """The engine example streams tokens and prints stats."""
    (block,) = [b for b in _python_blocks() if "FakeExecutor" in b]
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "FinishReason.LENGTH" in done.stdout or "length" in done.stdout


def test_the_policy_example_defines_a_working_policy(tmp_path: Path) -> None:
    """The SinkWindow example registers and answers its hook."""
    (block,) = [b for b in _python_blocks() if "class SinkWindow" in b]
    check = (
        "\nfrom hybridkv.policies import make_policy\n"
        "p = make_policy('sink_window', sinks=4, window=5)\n"
        "assert p.live_spans(20) == ((0, 4), (16, 20)), p.live_spans(20)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", block + check], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("marker", ["serve_http", "ModelExecutor.from_pretrained"])
def test_the_model_examples_name_real_functions(marker: str) -> None:
    """The examples that need a real model compile, and every name they import exists."""
    (block,) = [b for b in _python_blocks() if marker in b]
    compile(block, "README.md", "exec")
    imports = "\n".join(line for line in block.splitlines() if line.startswith(("from", "import")))
    exec(imports, {})


def test_the_model_example_prints_the_text_of_what_it_generates(
    tmp_path: Path, tiny_models: Any
) -> None:
    """The real-model example, on a tiny checkpoint with a byte-level tokenizer, prints
    the decode of what it generated, streamed without a broken character."""
    from hybridkv.testing import byte_tokenizer

    model = tiny_models["llama"]
    folder = tmp_path / "model"
    shutil.copytree(model.path, folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    (block,) = [b for b in _python_blocks() if "ModelExecutor.from_pretrained" in b]
    block = block.replace('"path/to/checkpoint"', repr(str(folder)))
    block = block.replace("kv_cache_bytes=2 << 30", "kv_cache_bytes=1 << 20")
    # Record the ids as they stream, and print them after the text, on stderr.
    push = "print(text.push(out.new_token_ids)"
    assert push in block
    block = "IDS = []\n" + block.replace(push, "IDS.extend(out.new_token_ids); " + push)
    block += "\nimport sys; print(IDS, file=sys.stderr)\n"
    done = subprocess.run(  # bytes: text mode would turn a generated "\r" into "\n"
        [sys.executable, "-c", block],
        cwd=tmp_path,
        capture_output=True,
        timeout=300,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    ids = ast.literal_eval(stderr.strip().splitlines()[-1])  # the list printed last
    assert 1 <= len(ids) <= 32  # the random model may sample its end-of-sequence token
    assert done.stdout.decode() == byte_tokenizer().decode(ids) + "\n"


def test_the_readme_is_one_page_with_working_links() -> None:
    """At most 12 KiB; every relative link names a file of the repository."""
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        assert "://" not in link, link
        assert (README.parent / link).exists(), link
