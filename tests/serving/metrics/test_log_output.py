"""The command line's log output: one stream, one format (text or JSON) for hybridkv's
events and the standard library's records; the periodic stats line."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from hybridkv.scheduler import Engine, FakeExecutor, SamplingParams, StepBatch, StepResult
from hybridkv.serving.cli.flags.console import SERVER_LOGGERS, configure_logging
from hybridkv.serving.metrics.stats_log import log_stats
from hybridkv.testing import default_config


@pytest.fixture
def logging_as_found() -> Iterator[None]:
    """Undo what configure_logging does to the standard library's loggers."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    servers = {
        n: (logging.getLogger(n).level, logging.getLogger(n).propagate) for n in SERVER_LOGGERS
    }
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    for name, (level, propagate) in servers.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).propagate = propagate


def test_json_lines_carry_both_libraries(
    capsys: pytest.CaptureFixture[str], logging_as_found: None
) -> None:
    """A structlog event and a uvicorn access record are both one JSON object a line."""
    from hybridkv.errors.events import get_logger

    configure_logging("info", "json")
    get_logger("hybridkv.test").info("request_finished", finish_reason="length")
    logging.getLogger("uvicorn.access").info('127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200')
    logging.getLogger("transformers").info("third parties stay at warning")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == [
        "request_finished",
        '127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200',
    ]
    assert lines[0]["finish_reason"] == "length"
    assert {line["level"] for line in lines} == {"info"}


def test_text_lines_share_one_format(
    capsys: pytest.CaptureFixture[str], logging_as_found: None
) -> None:
    from hybridkv.errors.events import get_logger

    configure_logging("warning", "text")
    get_logger("hybridkv.test").warning("kv_tier_unavailable", tier="redis")
    logging.getLogger("uvicorn.error").warning("listener failed")
    logging.getLogger("uvicorn.access").info("an access line below --log-level")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert "[warning  ] kv_tier_unavailable" in err[0] and "tier=redis" in err[0]
    assert "[warning  ] listener failed" in err[1]


def _fail_with_a_prompt_in_locals() -> None:
    prompt = "the user's private prompt"
    raise ValueError(f"a failure of {len(prompt)} characters")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_tracebacks_carry_no_local_variables(
    fmt: str, capsys: pytest.CaptureFixture[str], logging_as_found: None
) -> None:
    """A logged exception (ours, or a server's 500) shows its frames but not their local
    variables, which would write a request's prompt into the log."""
    from hybridkv.errors.events import get_logger

    configure_logging("info", fmt)
    for logger in (get_logger("hybridkv.test"), logging.getLogger("uvicorn.error")):
        try:
            _fail_with_a_prompt_in_locals()
        except ValueError:
            logger.exception("request_failed")
    err = capsys.readouterr().err
    assert err.count("a failure of 25 characters") == 2
    assert "private prompt" not in err


class HeldExecutor(FakeExecutor):
    """The fake, whose steps wait until the test lets them go (``release``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def execute(self, batch: StepBatch) -> StepResult:
        assert self.release.wait(30), "the test never released the steps"
        return super().execute(batch)


def test_the_stats_line_comes_while_requests_run() -> None:
    """Every interval while the engine is busy (its step held here), one engine_stats
    event with its queues, pool use and rates."""
    from structlog.testing import capture_logs

    config = default_config()
    logged = threading.Event()

    def watch(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        if event["event"] == "engine_stats":
            logged.set()
        return event

    async def main() -> list[dict[str, Any]]:
        with capture_logs(processors=[watch]) as logs:
            executor = HeldExecutor.for_config(config)
            async with Engine(config, executor) as engine:
                stream = engine.generate([2, 3, 4], SamplingParams(max_tokens=2))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(log_stats, engine, 0.01)
                    # Woken by the line itself; 30 s bounds a stats task that never logs.
                    assert await anyio.to_thread.run_sync(logged.wait, 30)
                    tg.cancel_scope.cancel()
                executor.release.set()
                async with stream:
                    async for _ in stream:
                        pass
        return [e for e in logs if e["event"] == "engine_stats"]

    lines = anyio.run(main)
    assert lines[0]["running"] + lines[0]["waiting"] == 1
    assert set(lines[0]) >= {"kv_usage", "pages_per_group", "prefix_hit_rate", "tokens_per_s"}
