"""The benchmark scripts, imported as ``python -m`` imports them from the repository root:
this folder's package would otherwise stand for ``benchmarks`` (``tests/benchmarks``), and
a module-level import breaks under xdist."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

#: The repository root.
ROOT = Path(__file__).resolve().parents[1]


def benchmark_module(name: str) -> ModuleType:
    """``name`` (``benchmarks.hybrid.frontier_fit``) imported from the root, ``sys.path``
    left as it was."""
    path = list(sys.path)
    try:
        sys.path.insert(0, str(ROOT))
        return importlib.import_module(name)
    finally:
        sys.path[:] = path
