"""Values of the command line: the usage error, dtypes, and the model a flag names.

Sizes are read by :func:`hybridkv.memory.sizes.parse_size`, the one size grammar.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVError


class UsageError(HybridKVError, ValueError):
    """A command-line value we cannot use (a size, a dtype, a model that is not there)."""


#: Bytes per cached value of each ``--dtype``.
DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2,
    "float8": 1, "fp8": 1,
}  # fmt: skip


def dtype_bytes(name: str) -> int:
    """Bytes per value of a dtype name."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise UsageError(f"dtype {name!r} is unknown; known: {', '.join(DTYPE_BYTES)}") from None


def load_config(model: str) -> tuple[str, dict[str, Any]]:
    """A built-in model name, a config.json, or a folder holding one -> (label, config).

    Raises:
        UsageError: no such model.
        ModelConfigError: the config.json cannot be read as a JSON object.
    """
    from hybridkv.models.published_shapes import BUILTIN_CONFIGS

    if model in BUILTIN_CONFIGS:
        return model, BUILTIN_CONFIGS[model]
    from hybridkv.errors import HybridKVError
    from hybridkv.serving.cli.builtin_models import BUILTIN_MODELS, resolve_model

    if model in BUILTIN_MODELS and not Path(model).exists():
        try:
            model = str(resolve_model(model)[1])  # converted once, on first use
        except HybridKVError as exc:
            raise UsageError(str(exc)) from None
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(
            f"model {model!r} is neither a config.json, a folder with one, nor a built-in "
            f"name ({', '.join([*BUILTIN_CONFIGS, *BUILTIN_MODELS])})"
        )
    from hybridkv.models.hf_config import read_config

    return str(path), read_config(path)


def add_import_argument(parser: argparse._ActionsContainer) -> None:
    """``--import MODULE``, repeatable: ``main`` imports each before the command runs."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, so that the policies it registers (register_policy) "
        "can be named by --layer-policy; repeatable",
    )
