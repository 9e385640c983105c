"""Checkpoints by hub name (``hybridkv serve Qwen/Qwen3-0.6B``), through huggingface_hub.

A name of the form ``org/name`` that is not a folder here resolves to a snapshot in the
local hub cache first (``HF_HOME``, ``HF_HUB_CACHE``), at ``--revision`` (a branch, tag
or commit; the default branch when not given). Only when the cache lacks it, and
``HF_HUB_OFFLINE`` is not set, is it downloaded, with huggingface_hub's progress bars;
only the files a checkpoint folder needs are fetched (config, weights, tokenizer, chat
template). huggingface_hub reads its environment variables when it is first imported.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridkv.serving.cli.model_errors import MissingExtraError, ModelNotFoundError

#: The files of a checkpoint folder (the rest of a repository, other weight formats and
#: framework files among them, is left on the hub).
CHECKPOINT_PATTERNS = (
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.jinja",
)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_name(model: str) -> bool:
    """Whether ``model`` reads as a hub repository id (``org/name``)."""
    return _REPO_ID.fullmatch(model) is not None and ".." not in model


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The folder of ``repo_id`` at ``revision``: from the cache, else downloaded.

    Raises:
        ModelNotFoundError: not in the cache while offline, or not on the hub.
        MissingExtraError: huggingface_hub is not installed.
    """
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise MissingExtraError(
            f"{repo_id!r} is a hub name; loading it needs huggingface_hub "
            "(pip install 'hybridkv[serve]')"
        ) from None
    where = repo_id + (f" at revision {revision!r}" if revision else "")
    patterns = list(CHECKPOINT_PATTERNS)
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=patterns, local_files_only=True
            )
        )
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"{where} is not in the hub cache ({constants.HF_HUB_CACHE}) and "
                "HF_HUB_OFFLINE is set"
            ) from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise ModelNotFoundError(f"{where} could not be fetched from the hub: {first}") from None


__all__ = ["CHECKPOINT_PATTERNS", "hub_snapshot", "is_hub_name"]
