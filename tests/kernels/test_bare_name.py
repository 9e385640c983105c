"""kernels/ under its bare name (repository root on sys.path, hybridkv not importable).

Hugging Face's `kernels` package has the same name, and transformers imports it (a
requirement since transformers 5.25; before, a probe imported whatever
find_spec("kernels") found). From a checkout the bare name finds this folder first: it must
become the installed package where there is one, and an empty module that a probe reads
as "not installed" where there is none, never crash transformers.
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


#: Site-packages off the path: as if Hugging Face's `kernels` were not installed.
_NOTHING_INSTALLED = """\
sys.path = [p for p in sys.path if "-packages" not in p]
"""


def _run(code: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + prelude + code],
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
""",
        _NOTHING_INSTALLED,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("kernels") is None, reason="Hugging Face's kernels not installed"
)
def test_bare_kernels_becomes_the_installed_package() -> None:
    done = _run(
        """\
import os
import kernels
assert not kernels.__file__.startswith(os.path.join(os.getcwd(), "kernels")), kernels.__file__
assert sys.modules["kernels"] is kernels
from kernels import get_kernel  # noqa: F401
"""
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_transformers_imports_from_the_checkout_root() -> None:
    """transformers.integrations.hub_kernels imports `kernels` (the installed package, or
    probes for it) and must carry on from a checkout's root."""
    done = _run(
        """\
import os
import transformers.integrations.hub_kernels
from transformers.utils import is_kernels_available
import kernels
installed = not kernels.__file__.startswith(os.path.join(os.getcwd(), "kernels"))
assert is_kernels_available() is installed, (is_kernels_available(), kernels.__file__)
"""
    )
    assert done.returncode == 0, done.stderr
