"""``--config FILE``: flags from a YAML file, as ``vllm serve --config`` reads them.

The file maps long flag names (``port``, ``max-num-seqs`` or ``max_num_seqs``) to
values; they are read as if given on the command line right after the subcommand, so a
flag given there too wins::

    # serve.yaml                         hybridkv serve --config serve.yaml --port 9000
    model: smollm2-135m                  serves smollm2-135m on port 9000, with
    port: 8000                           prefix caching off and two layer policies
    enable-prefix-caching: false
    layer-policy:
      - full_attention=sliding_window:window=1024
      - sliding_attention=sliding_window:window=512

``true`` is the bare flag, ``false`` its ``--no-`` form (or nothing, for a flag that has
none), a list repeats the flag once per item.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybridkv.serving.cli.flags.values import UsageError


def expand_config(argv: Sequence[str], negatable: frozenset[str] = frozenset()) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's flags, placed right after
    the subcommand (``argv[0]``).

    Args:
        argv: The command line after ``hybridkv``.
        negatable: Flags (``--enable-prefix-caching``) whose ``false`` is ``--no-...``.

    Raises:
        UsageError: the file is missing, not YAML, or not a mapping of flag names.
    """
    argv = list(argv)
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    rest: list[str] = []
    path: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise UsageError("--config needs a FILE")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    assert path is not None
    flags = _flags(Path(path), negatable)
    return [*rest[:1], *flags, *rest[1:]]


def _flags(path: Path, negatable: frozenset[str]) -> list[str]:
    try:
        import yaml
    except ImportError:
        raise UsageError("--config reads YAML: pip install pyyaml (or 'hybridkv[serve]')") from None

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--config {str(path)!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise UsageError(f"--config {str(path)!r} is not YAML: {problem}{where}") from None
    if data is None:
        return []
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise UsageError(f"--config {str(path)!r} must map flag names to values")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + key.strip().lstrip("-").replace("_", "-")
        if flag == "--config":
            raise UsageError(f"--config {str(path)!r} names another --config")
        if value is True:
            out.append(flag)
        elif value is False:
            if flag in negatable:
                out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        elif value is not None:
            out += [flag, str(value)]
    return out
