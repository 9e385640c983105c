"""The import paths of modules that moved in 0.2 still work for one release, each with a
DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from hybridkv.errors.moved import MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_gives_the_new_module_with_a_warning(old: str, new: str) -> None:
    with warnings.catch_warnings():  # the new module's own imports (Ray's) may warn
        warnings.simplefilter("ignore")
        target = importlib.import_module(new)
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    public = [name for name in vars(target) if not name.startswith("_")]
    assert public and all(getattr(module, name) is getattr(target, name) for name in public)


def test_the_old_names_of_modules_that_became_packages_still_import() -> None:
    """serving/metrics.py and cli/workload.py are folders now: their names import from
    the package, as from the module they moved to."""
    from hybridkv.serving.cli.workload import run
    from hybridkv.serving.metrics import prometheus

    with pytest.warns(DeprecationWarning, match="moved to hybridkv.serving.metrics.prometheus"):
        from hybridkv.serving.metrics import ServerMetrics
    assert ServerMetrics is prometheus.ServerMetrics
    with pytest.warns(DeprecationWarning, match="moved to hybridkv.serving.cli.workload.run"):
        from hybridkv.serving.cli.workload import run_workload
    assert run_workload is run.run_workload
    with pytest.raises(ImportError):
        from hybridkv.serving.metrics import no_such_name  # noqa: F401
