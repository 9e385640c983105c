"""The library prints nothing unless the application configures logging; configured,
its events reach the standard-library loggers of their modules, or structlog's pipeline."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import structlog

from hybridkv.errors.events import get_logger

RUN = textwrap.dedent(
    """
    import anyio
    {setup}
    from hybridkv.policies import FullAttention, SlidingWindow
    from hybridkv.scheduler import Engine, EngineConfig, FakeExecutor, SamplingParams

    async def main():
        config = EngineConfig(
            policies=[FullAttention(), SlidingWindow(window=8)], num_blocks=64, block_size=4,
            max_model_len=64,
        )
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=3)):
                pass

    anyio.run(main)
    """
)


def run(setup: str) -> subprocess.CompletedProcess[str]:
    code = RUN.format(setup=setup)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )


def test_an_unconfigured_library_prints_nothing() -> None:
    """Requests served, steps logged at debug, and not one character on stdout or stderr."""
    done = run("")
    assert (done.stdout, done.stderr) == ("", "")


def test_standard_library_logging_gets_the_events_by_module() -> None:
    """``logging.basicConfig`` shows hybridkv's events on its modules' loggers, by level."""
    done = run(
        "import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')"
    )
    lines = done.stderr.splitlines()
    finished = [line for line in lines if " request_finished " in line]
    assert finished and finished[0].startswith("hybridkv.scheduler.core request_finished ")
    assert "finish_reason='length'" in finished[0] and "request_id=" in finished[0]
    assert not any(" step " in line for line in lines)  # the per-step event is debug


def test_a_structlog_configuration_is_followed() -> None:
    """An application that configured structlog gets the events through it."""
    log = get_logger("hybridkv.test")
    with structlog.testing.capture_logs() as events:
        log.bind(request_id="r1").info("request_admitted", num_prompt_tokens=3)
    assert events == [
        {
            "event": "request_admitted",
            "request_id": "r1",
            "num_prompt_tokens": 3,
            "log_level": "info",
        }
    ]


def test_records_carry_the_fields(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without structlog configured, a record's message holds the event and its fields."""
    monkeypatch.setattr(structlog, "is_configured", lambda: False)
    with caplog.at_level("WARNING", logger="hybridkv.test"):
        get_logger("hybridkv.test").warning("kv_tier_unavailable", tier="redis")
    (record,) = caplog.records
    assert (record.name, record.levelname) == ("hybridkv.test", "WARNING")
    assert record.getMessage() == "kv_tier_unavailable tier='redis'"
    assert record.msg.fields == {"tier": "redis"}
