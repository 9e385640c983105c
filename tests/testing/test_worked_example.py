"""The testing guide's worked example (docs/examples/test_sink_window.py), run as a user
runs it: a fresh pytest process outside the repository, the fixtures from hybridkv's
plugin (its ``pytest11`` entry point), under anyio's plugin (asyncio and trio) and under
pytest-asyncio; and, with the policy broken, failing where it should."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "test_sink_window.py"

#: An override "for speed" that drops the oldest block the window still reads.
BROKEN = """
    def live_block_spans(self, num_tokens: int, block_size: int) -> tuple[Span, ...]:
        spans = super().live_block_spans(num_tokens, block_size)
        if len(spans) == 2 and spans[1][1] - spans[1][0] > 1:
            return (spans[0], (spans[1][0] + 1, spans[1][1]))
        return spans
"""


def run_example(tmp_path: Path, source: str) -> tuple[int, str]:
    (tmp_path / "test_example.py").write_text(source)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_worked_example_passes_under_anyio_on_asyncio_and_trio(tmp_path: Path) -> None:
    code, out = run_example(tmp_path, EXAMPLE.read_text())
    assert code == 0, out
    assert "4 passed" in out, out


def test_the_worked_example_passes_under_pytest_asyncio(tmp_path: Path) -> None:
    source = EXAMPLE.read_text().replace("@pytest.mark.anyio", "@pytest.mark.asyncio")
    source = re.sub(r'@pytest.mark.parametrize\("anyio_backend".*\n', "", source)
    assert "mark.anyio" not in source and "anyio_backend" not in source
    code, out = run_example(tmp_path, source)
    assert code == 0, out
    assert "3 passed" in out, out


def test_the_worked_example_catches_a_policy_that_drops_a_live_block(tmp_path: Path) -> None:
    """The laws test names the broken method; the engine test fails on the page the
    policy freed while its layers still read it."""
    source = EXAMPLE.read_text()
    anchor = "        return ((0, self.sinks), (start, num_tokens))\n"
    assert anchor in source
    code, out = run_example(tmp_path, source.replace(anchor, anchor + BROKEN))
    assert code == 1, out
    for test in (
        "test_the_policy_keeps_the_allocators_laws",
        "test_the_engine_serves_what_the_policy_keeps[asyncio]",
        "test_the_engine_serves_what_the_policy_keeps[trio]",
    ):
        assert f"FAILED test_example.py::{test}" in out, out
    assert "live_block_spans" in out, out


@pytest.mark.parametrize("name", ["hybridkv_engine", "hybridkv_server", "hybridkv_tiny_model"])
def test_the_plugin_is_loaded_by_its_entry_point(tmp_path: Path, name: str) -> None:
    """Without the plugin the fixtures are unknown: the entry point is what provides them."""
    (tmp_path / "test_fixture.py").write_text(f"def test_it({name}):\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:hybridkv", "test_fixture.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert f"fixture '{name}' not found" in done.stdout + done.stderr
