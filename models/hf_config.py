"""Reading a Hugging Face config.json: one reader, one error type, messages naming the field.

Every consumer of config.json (the checkpoint loader, the layer specs, ``hybridkv plan``)
reads it through :func:`read_config` and its fields through the typed readers here, so a
bad file fails the same way wherever it is opened: :class:`ModelConfigError`, naming the
file or the field. Torch-free: ``hybridkv plan`` reads configs of models it never loads.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridkv.models.errors import ModelConfigError

_GEMMA: dict[str, Any] = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
}

#: Fields config.json may leave out, as transformers' config classes fill them in.
DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "gemma3": _GEMMA,
}


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a config.json or generation_config.json).

    Raises:
        ModelConfigError: the file cannot be read, is not JSON, or holds no JSON object.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {str(path)!r} as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{str(path)!r} holds a JSON {type(data).__name__}, not an object")
    return data


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's fields, with transformers' defaults for the ones left out.

    A multimodal config (Gemma 3) nests them in ``text_config``; its ``model_type`` is the
    nested one, or the outer one when the nested config names none. Idempotent.
    """
    nested = config.get("text_config")
    given: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
    model_type = str(given.get("model_type") or config.get("model_type") or "")
    return {**DEFAULTS.get(model_type, {}), **given, "model_type": model_type}


def int_field(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``cfg[key]`` as an integer >= 1 (``default`` when absent or null).

    Raises:
        ModelConfigError: absent without a default, or not an integer >= 1.
    """
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ModelConfigError(f"config lacks the field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"config field {key!r} must be an integer >= 1, got {value!r}")
    return value


def float_field(cfg: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """``cfg[key]`` as a float (``default`` when absent or null).

    Raises:
        ModelConfigError: absent without a default, or not a number.
    """
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ModelConfigError(f"config lacks the field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelConfigError(f"config field {key!r} must be a number, got {value!r}")
    return float(value)


def optional_float_field(cfg: Mapping[str, Any], key: str, default: float | None) -> float | None:
    """``cfg[key]`` as a float; None when the file says null, ``default`` when absent."""
    value = cfg.get(key, default)
    return None if value is None else float_field({key: value}, key)


def flag_field(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    """``cfg[key]`` as a bool (``default`` when absent or null).

    Raises:
        ModelConfigError: not a JSON boolean.
    """
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelConfigError(f"config field {key!r} must be true or false, got {value!r}")
    return value


def renamed_fields(cfg: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """``cfg`` with each field of ``names`` that it has copied under its other name
    (theirs -> ours: Mamba's ``state_size`` as Jamba's ``mamba_d_state``)."""
    return {**cfg, **{ours: cfg[theirs] for theirs, ours in names.items() if theirs in cfg}}


def kind_overrides(
    cfg: Mapping[str, Any], kinds: Sequence[str], kind: str, read: Collection[str]
) -> dict[str, Any]:
    """What ``per_layer_config`` (transformers' per-layer overrides, keyed by layer index)
    sets for the layers of ``kind``: one value per field for them all.

    Raises:
        ModelConfigError: an override of a field outside ``read``, or layers of ``kind``
            given differing values.
    """
    per_layer = cfg.get("per_layer_config")
    found: dict[str, Any] = {}
    for index, fields in (per_layer or {}).items():
        unknown = sorted(set(fields) - set(read))
        if unknown:
            raise ModelConfigError(f"per_layer_config sets {unknown}, which are not read")
        if kinds[int(index)] != kind:
            continue
        for key, value in fields.items():
            if found.setdefault(key, value) != value:
                raise ModelConfigError(f"per_layer_config gives {kind} layers differing {key}")
    return found
