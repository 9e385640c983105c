"""TorchThread: an executor's torch work runs on one long-lived thread."""

from __future__ import annotations

import threading

import pytest

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.torch_thread import TorchThread


def test_calls_run_on_one_other_thread() -> None:
    """Every call runs on the same worker thread, not the caller's."""
    worker = TorchThread()
    try:
        first = worker.run(threading.get_ident)
        assert first == worker.run(threading.get_ident) != threading.get_ident()
    finally:
        worker.close()


def test_exception_is_raised_in_the_caller() -> None:
    """An exception on the worker reaches the caller unchanged."""
    worker = TorchThread()

    def fail() -> None:
        raise ValueError("boom")

    try:
        with pytest.raises(ValueError, match="boom"):
            worker.run(fail)
    finally:
        worker.close()


def test_after_close_calls_run_inline() -> None:
    """A closed TorchThread runs calls on the caller's thread."""
    worker = TorchThread()
    worker.close()
    assert worker.run(threading.get_ident) == threading.get_ident()


def test_submitted_calls_run_in_order_without_waiting() -> None:
    """submit returns a future at once; queued calls run one at a time, in order."""
    worker = TorchThread()
    gate, order = threading.Event(), []
    try:
        first = worker.submit(gate.wait, 10)
        later = [worker.submit(order.append, i) for i in range(3)]
        assert not first.done()
        gate.set()
        for future in later:
            future.result(timeout=10)
        assert order == [0, 1, 2]
    finally:
        worker.close()


def test_submit_after_close_runs_inline_and_keeps_the_error() -> None:
    """A closed TorchThread's submit runs the call now; its exception is in the future."""
    worker = TorchThread()
    worker.close()
    assert worker.submit(threading.get_ident).result() == threading.get_ident()
    failed = worker.submit(int, "not a number")
    assert isinstance(failed.exception(), ValueError)


def test_executors_can_share_one_thread(tiny_models) -> None:
    """Two executors loaded with the same TorchThread run their torch work on it."""
    from hybridkv.executor.model_executor import ModelExecutor

    thread = TorchThread(1)
    executors = [
        ModelExecutor.from_pretrained(
            tiny_models[name].path, LoadOptions(kv_cache_bytes=1 << 20), torch_thread=thread
        )
        for name in ("llama", "gemma3")
    ]
    try:
        assert all(e.torch_thread is thread for e in executors)
        names = {e.torch_thread.run(lambda: threading.current_thread().name) for e in executors}
        assert len(names) == 1 and names != {threading.current_thread().name}
    finally:
        for executor in executors:
            executor.close()
