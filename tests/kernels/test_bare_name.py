"""kernels/ under its bare name (repository root on sys.path, hybridkv not importable).

transformers probes for Hugging Face's `kernels` package by importing whatever
find_spec("kernels") finds; from a checkout that is this folder. It must come back as an
empty module that the probe reads as "not installed", not crash transformers.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Run from the repository root (python -c puts the working directory first on sys.path) with
# hybridkv made unimportable, as in a clone that was never installed.
_PRELUDE = """\
import sys
sys.modules["hybridkv"] = None
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_bare_kernels_is_an_empty_module_pointing_at_hybridkv() -> None:
    done = _run(
        """\
import os
import kernels
assert os.path.dirname(kernels.__file__) == os.path.join(os.getcwd(), "kernels"), kernels.__file__
assert not hasattr(kernels, "__version__")
assert not hasattr(kernels, "paged_attention")
try:
    kernels.paged_attention
except AttributeError as e:
    assert "hybridkv.kernels" in str(e), e
else:
    raise AssertionError("kernels.paged_attention resolved")
try:
    from kernels import paged_attention  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("from kernels import paged_attention worked")
"""
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_transformers_kernels_probe_treats_the_folder_as_absent() -> None:
    """transformers.integrations.hub_kernels runs is_kernels_available() on import; it imports
    the bare `kernels` (import_utils._is_package_available) and must carry on."""
    done = _run(
        """\
import os
import transformers.integrations.hub_kernels
from transformers.utils import is_kernels_available
assert is_kernels_available() is False
probed = sys.modules.get("kernels")
assert probed is not None, "the probe did not import the bare kernels folder"
assert os.path.dirname(probed.__file__) == os.path.join(os.getcwd(), "kernels"), probed.__file__
"""
    )
    assert done.returncode == 0, done.stderr
