"""``--kv-events-config`` on ``hybridkv serve``: vLLM's JSON, refused early when wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.serving.cli.main import main

pytestmark = pytest.mark.usefixtures("command_isolation")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (('{"enable_kv_cache_events": true, "topics": "x"}',), "unknown keys topics"),
        (('{"enable_kv_cache_events": true, "publisher": "nats"}',), "publisher must be"),
        (('{"publisher": "zmq"}',), "enable_kv_cache_events false"),
        (('{"enable_kv_cache_events": true}', "--no-prefix-caching"), "--no-prefix-caching"),
    ],
)
def test_bad_kv_events_config_is_a_one_line_error(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    """A config that cannot be served exits 2 naming the key (or both flags) before the
    model loads or a port is opened."""
    args = ["serve", str(tiny_checkpoint), "--port", "0", "--kv-events-config", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "--kv-events-config" in err
    assert "loading" not in err
