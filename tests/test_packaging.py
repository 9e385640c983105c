"""Packaging: every package folder is installed under hybridkv, and only there."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (
    "errors", "scheduler", "policies", "memory", "kernels",
    "models", "executor", "parallel", "serving", "testing",
)  # fmt: skip


def _pyproject() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_folder_with_an_init_is_listed_as_a_package() -> None:
    """setuptools drops unlisted subpackages silently, so the list must match the tree."""
    setuptools = _pyproject()["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    listed = set(setuptools["packages"])
    found = set()
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join(("hybridkv", folder, *rel)))
    assert found == listed
    assert all(mapping[name] == name.split(".")[1] for name in listed if name.count(".") == 1)


def test_every_package_folder_is_typed() -> None:
    """Each package folder carries py.typed."""
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            assert (init.parent / "py.typed").exists(), init.parent


def test_hybridkv_itself_is_a_namespace() -> None:
    """hybridkv has no __init__.py: the folders are its subpackages."""
    import hybridkv

    assert getattr(hybridkv, "__file__", None) is None


@pytest.mark.parametrize("name", FOLDERS)
def test_bare_folder_names_do_not_import(name: str, tmp_path: Path) -> None:
    """Outside the checkout, `import memory` etc. find nothing of ours: hybridkv installs
    nothing top-level (another distribution may own the name: Hugging Face's `kernels`,
    which transformers requires)."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.find_spec({name!r})\n"
        "print(spec.origin if spec is not None else '')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True
    )
    origin = done.stdout.strip()
    ours = str(ROOT / name)
    assert not origin.startswith(ours), f"a top-level module {name!r} is ours: {origin}"
    if origin:
        from importlib.metadata import packages_distributions

        assert "hybridkv" not in packages_distributions().get(name, []), origin


@pytest.mark.parametrize("name", FOLDERS)
def test_umbrella_names_import(name: str, tmp_path: Path) -> None:
    """Every folder imports as hybridkv.<folder> from anywhere."""
    code = f"import hybridkv.{name}"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)
