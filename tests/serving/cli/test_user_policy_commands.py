"""A user's memory policy on the command line: by ``--import MODULE`` and by an installed
package's ``hybridkv.policies`` entry point; ``hybridkv policies`` lists what is there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridkv.serving.cli.main import main

POLICY_SOURCE = textwrap.dedent(
    """
    from typing import ClassVar

    import attrs

    from hybridkv.policies import MemoryPolicy, Span, register_policy
    from hybridkv.policies.base import positive


    @attrs.frozen
    class {cls}(MemoryPolicy):
        \"\"\"The first ``sinks`` tokens and the last ``window``.\"\"\"

        name: ClassVar[str] = "{name}"
        sinks: int = attrs.field(validator=positive)
        window: int = attrs.field(validator=positive)

        def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
            start = max(0, num_tokens - self.window + 1)
            if start <= self.sinks:
                return ((0, num_tokens),) if num_tokens else ()
            return ((0, self.sinks), (start, num_tokens))
    """
)


def run(*argv: str, path: Path) -> subprocess.CompletedProcess[str]:
    """The command line in a fresh interpreter with ``path`` on its import path (entry
    points are read once per process)."""
    code = "import sys; from hybridkv.serving.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        env={**os.environ, "PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_an_imported_module_names_its_policy_on_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--import MODULE`` registers the module's policy before ``--layer-policy`` is read."""
    source = POLICY_SOURCE.format(cls="ImportedSinks", name="imported_sinks")
    (tmp_path / "my_policies.py").write_text(source + "\nregister_policy(ImportedSinks)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = [
        "--import",
        "my_policies",
        "--layer-policy",
        "full_attention=imported_sinks:sinks=4,window=64",
    ]
    assert main(["plan", "gemma3-like", "--kv-memory", "1GiB", *flags]) == 0
    assert "imported_sinks" in capsys.readouterr().out
    assert main(["policies", "--import", "my_policies"]) == 0
    assert "imported_sinks(sinks, window)" in capsys.readouterr().out


def test_a_module_that_does_not_import_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An ``--import`` of a missing module exits 2 naming it."""
    assert main(["policies", "--import", "no_such_policies_module"]) == 2
    assert "--import no_such_policies_module" in capsys.readouterr().err


def _install(site: Path, module: str, source: str, entry: str) -> None:
    """A package as pip leaves one: the module and its dist-info with entry points."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[hybridkv.policies]\n{entry}\n")


def test_an_installed_entry_point_is_listed_and_named(tmp_path: Path) -> None:
    """A package's ``hybridkv.policies`` entry point is found without any import flag."""
    source = POLICY_SOURCE.format(cls="InstalledSinks", name="installed_sinks")
    _install(tmp_path, "sink_policies", source, "installed_sinks = sink_policies:InstalledSinks")
    listed = run("policies", path=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "installed_sinks(sinks, window)  sink_policies:" in listed.stdout
    flag = "full_attention=installed_sinks:sinks=4,window=64"
    planned = run(
        "plan", "gemma3-like", "--kv-memory", "1GiB", "--layer-policy", flag, path=tmp_path
    )
    assert planned.returncode == 0, planned.stderr
    assert "installed_sinks" in planned.stdout


def test_an_entry_point_that_is_not_a_policy_is_named(tmp_path: Path) -> None:
    """An entry point naming something else is a one-line error naming the entry point."""
    _install(tmp_path, "not_policies", "Thing = 42\n", "thing = not_policies:Thing")
    listed = run("policies", path=tmp_path)
    assert listed.returncode == 2
    assert "entry point 'thing' (not_policies:Thing) is 42, not a MemoryPolicy" in listed.stderr
