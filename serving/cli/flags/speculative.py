"""``--speculative-config`` as vLLM reads it: a JSON object of vLLM's keys, checked
against the other flags (``hybridkv.scheduler.speculation`` has the keys and values)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.scheduler.speculation import SpeculativeConfig


def speculative_config(
    text: str | None, context_parallel_size: int = 1, num_ranks: int = 1
) -> SpeculativeConfig | None:
    """``--speculative-config`` as vLLM reads it (a JSON object), or None.

    Raises:
        UsageError: not a JSON object, a key or value it refuses (named), context
            parallelism beside it, or a draft model or method mtp beside several
            processes.
    """
    import json

    from hybridkv.scheduler.speculation import SpeculativeConfig, SpeculativeConfigError
    from hybridkv.serving.cli.flags.values import UsageError

    if text is None:
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise UsageError("--speculative-config must be a JSON object")
    try:
        config = SpeculativeConfig.from_mapping(fields)
    except SpeculativeConfigError as exc:
        raise UsageError(f"--speculative-config: {exc}") from None
    if num_ranks > 1 and config.method in ("draft_model", "mtp"):
        what = "a draft model" if config.method == "draft_model" else "method mtp"
        raise UsageError(
            f"--speculative-config: {what} beside pipeline, context- or "
            "tensor-parallel processes is not built; use ngram (prompt lookup)"
        )
    if context_parallel_size > 1:
        raise UsageError("--speculative-config with --context-parallel-size: not built")
    return config


__all__ = ["speculative_config"]
