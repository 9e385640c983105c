"""``hybridkv policies``: the memory policies ``--layer-policy`` can name, and their
parameters (the built-ins, ``--import`` modules' and installed packages' entry points)."""

from __future__ import annotations

import argparse
import inspect

from hybridkv.serving.cli.flags.values import add_import_argument


def register_policies(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hybridkv policies``."""
    parser = subparsers.add_parser(
        "policies",
        help="list the memory policies --layer-policy can name",
        description="List the registered memory policies: built-in, from --import modules "
        "and from installed packages' hybridkv.policies entry points.",
    )
    add_import_argument(parser)
    parser.set_defaults(handler=run_policies)


def run_policies(args: argparse.Namespace) -> int:
    """Print one line per policy: name, parameters, where it comes from, what it keeps."""
    from hybridkv.policies import policy_classes

    rows = []
    for name, cls in policy_classes().items():
        params = ", ".join(
            p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
            for p in inspect.signature(cls).parameters.values()
        )
        summary = (inspect.getdoc(cls) or "").split("\n", 1)[0]
        rows.append((f"{name}({params})", cls.__module__, summary))
    width = max(len(row[0]) for row in rows)
    for call, module, summary in rows:
        print(f"{call.ljust(width)}  {module}: {summary}".rstrip())
    return 0
