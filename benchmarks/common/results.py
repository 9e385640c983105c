"""``--json FILE`` of the benchmark scripts: their results, and the command that made them.

``benchmarks/common/plot.py`` draws the docs' figures from these files (``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """``--json FILE``: also write the printed results as one JSON object."""
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the results (the numbers printed) to FILE as JSON",
    )


def command_line(argv: list[str] | None = None) -> str:
    """``python -m benchmarks.FAMILY.NAME ARGS``, the ``--json`` option left out."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.startswith("benchmarks."):
        script = f"-m {spec.name}"
    else:  # run by its path
        path = Path(argv[0]).resolve()
        script = f"-m benchmarks.{path.parent.name}.{path.stem}"
    args, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json="):
            args.append(arg)
    return " ".join(["python", script, *args])


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    """Write ``results`` with the command that made them, if ``path`` is given."""
    if path is None:
        return
    out = {"command": command_line(), **results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
