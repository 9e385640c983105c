"""The ``hybridkv`` command line.

Each subcommand is a registrar: a function that adds one parser to the subparsers and
sets its ``handler`` default to a function ``(args) -> exit code``. Add a subcommand by
writing ``register(subparsers)`` in its own module and naming it in :data:`SUBCOMMANDS`;
keep heavy imports (torch, models, the HTTP stack) inside the handler so that
``hybridkv --help`` and ``hybridkv plan`` stay fast.

Errors of the library (:class:`HybridKVError`,
:class:`~hybridkv.serving.cli.flags.values.UsageError` among them) print one line on
stderr and exit with status 2, without a traceback.

SIGTERM stops a command as Ctrl-C does (a ``KeyboardInterrupt``), so that the servers
stop what they started (workers, replicas) either way. A ``hybridkv`` process started
by another with :data:`~hybridkv.parallel.parent_watch.PARENT_PID_VARIABLE` set (a
replica of ``serve -dp``) stops the same way when that parent is gone.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.serving.cli.flags.config_file import expand_config

#: Subcommand name -> ``"module:function"`` of its registrar, in ``--help`` order.
SUBCOMMANDS: dict[str, str] = {
    "demo": "hybridkv.serving.cli.demo:register_demo",
    "serve": "hybridkv.serving.cli.serve:register_serve",
    "route": "hybridkv.serving.cli.route:register_route",
    "generate": "hybridkv.serving.cli.serve:register_generate",
    "plan": "hybridkv.serving.cli.plan:register_plan",
    "bench": "hybridkv.serving.cli.demo:register_bench",
    "policies": "hybridkv.serving.cli.policies:register_policies",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (the console script exits with it)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(argv, _negatable(parser))
    except HybridKVError as exc:
        print(f"hybridkv: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args.command_line = argv  # as parsed, --config expanded (serve -dp starts replicas of it)
    handler: Callable[[argparse.Namespace], int] = args.handler
    previous = _interrupt_on_sigterm()
    try:
        from hybridkv.parallel.parent_watch import watch_parent_from_environment

        watch_parent_from_environment(grace_s=STOP_GRACE_S)
        import_modules(getattr(args, "imports", []))
        from hybridkv.serving.cli.loading import pipeline_worker_status

        status = pipeline_worker_status(args)  # under torchrun, ranks > 0 serve a stage
        if status is not None:
            return status
        return handler(args)
    except HybridKVError as exc:
        print(f"hybridkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:
        # A task group (the engine's) wraps what its body raised; unwrap our errors.
        errors, rest = group.split(HybridKVError)
        if errors is None or rest is not None:
            raise
        # Requests failing alike (a bench where every prompt is too long) print one line.
        for message in dict.fromkeys(str(error) for error in _leaves(errors)):
            print(f"hybridkv {args.command}: error: {message}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


#: Seconds a command has to stop after SIGTERM or its parent's end: then it is killed.
STOP_GRACE_S = 8.0


def _interrupt_on_sigterm() -> Any:
    """Make SIGTERM raise KeyboardInterrupt (in the main thread only: elsewhere, as a
    command run from a test's thread, it is left alone); the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def import_modules(names: Sequence[str]) -> None:
    """Import each ``--import`` module (a user's policies register themselves).

    Raises:
        UsageError: a module that cannot be imported, naming it and why.
    """
    from hybridkv.serving.cli.flags.values import UsageError

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise UsageError(f"--import {name}: {exc}") from None


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _negatable(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The long flags of every subcommand that have a ``--no-`` form."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for inner in sub._actions:
                    if isinstance(inner, argparse.BooleanOptionalAction):
                        out.update(o for o in inner.option_strings if not o.startswith("--no-"))
    return frozenset(out)


def build_parser() -> argparse.ArgumentParser:
    """The parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="hybridkv", description="An async LLM serving core with hybrid KV memory."
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {_version()}")
    parser.epilog = "COMMAND --config FILE reads flags from a YAML file (as vllm serve does)."
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for target in SUBCOMMANDS.values():
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)(subparsers)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridkv")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
