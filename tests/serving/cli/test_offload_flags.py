"""``--kv-offload`` on the model-running commands, and the offload metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hybridkv.memory.offload import OffloadStats
from hybridkv.serving.cli.main import main
from hybridkv.serving.metrics.prometheus import OffloadCollector

VOCAB = 64


pytestmark = pytest.mark.usefixtures("command_isolation")


def _generate(checkpoint: Path, *extra: str) -> list[str]:
    return ["generate", str(checkpoint), "w2 w3 w4 " * 5, "--max-tokens", "5", "--ignore-eos",
            "--kv-memory", "1MiB", "--block-size", "4", *extra]  # fmt: skip


def test_generate_with_a_host_tier_prints_the_same_text(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--kv-offload host:SIZE` changes nothing in the output."""
    assert main(_generate(tiny_checkpoint)) == 0
    plain = capsys.readouterr().out
    flags = ("--kv-offload", "host:16MiB", "--kv-offload-interval", "8")
    assert main(_generate(tiny_checkpoint, *flags)) == 0
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--kv-offload", "disk:/tmp"), "expected host:SIZE"),
        (("--kv-offload", "host:lots"), "size 'lots' is not a non-negative number"),
        (("--kv-offload", "host:1e9", "--kv-offload-interval", "6"), "multiple of the block"),
        (("--kv-offload", "host:1MiB", "--kv-offload-interval", "6"), "multiple of the block"),
        (("--kv-offload", "host:1MiB", "--no-prefix-caching"), "needs prefix caching"),
    ],
)
def test_bad_offload_flags_are_one_line_errors(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    """A tier value or interval that cannot work exits 2 naming the problem. (Offload
    beside tensor, pipeline and context ranks runs: ``test_pipeline_commands.py``.)"""
    assert main(_generate(tiny_checkpoint, *flags)) == 2
    assert message in capsys.readouterr().err


def test_offload_counters_are_exported() -> None:
    """Hit tokens per tier, bytes and blocks moved, failures and dropped saves."""
    stats = OffloadStats(hit_tokens={"host": 64, "redis": 16}, num_loaded_bytes=4096)
    stats.num_failed_blocks = 2
    registry = CollectorRegistry()
    registry.register(OffloadCollector(stats))
    text = generate_latest(registry).decode()
    assert 'hybridkv_kv_offload_hit_tokens_total{tier="host"} 64.0' in text
    assert 'hybridkv_kv_offload_hit_tokens_total{tier="redis"} 16.0' in text
    assert "hybridkv_kv_offload_loaded_bytes_total 4096.0" in text
    assert "hybridkv_kv_offload_failed_loads_total 2.0" in text
    assert "hybridkv_kv_offload_dropped_saves_total 0.0" in text
