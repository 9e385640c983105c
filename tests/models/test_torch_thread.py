"""TorchThread: an executor's torch work runs on one long-lived thread."""

from __future__ import annotations

import threading

import pytest

from hybridkv.models.torch_thread import TorchThread


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
