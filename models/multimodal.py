"""The text model of a multimodal checkpoint (Gemma 3, Llama 4, Mistral 3 ...): its
``text_config`` read as the text family's config, its language model's tensors under
the names a text checkpoint gives them, the vision tower and projector left unread.

Served only when asked for (``--text-only``): a checkpoint with a ``vision_config``
otherwise is refused at load, naming the flag, so that no one mistakes it for a server of
images.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.errors import ModelConfigError

#: The prefixes multimodal checkpoints give their language model's tensors -> a text
#: checkpoint's (transformers 4's layout, then 5's).
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
    ("mtp.", "mtp."),  # Qwen3.5's multi-token prediction layers, beside the text model
)


def is_multimodal(hf: Mapping[str, Any]) -> bool:
    """Whether the config has a vision (or audio) tower beside its text model."""
    return any(hf.get(key) is not None for key in ("vision_config", "audio_config"))


def text_model_config(hf: Mapping[str, Any], *, text_only: bool) -> Mapping[str, Any]:
    """``hf`` itself for a text model; a multimodal one's ``text_config`` where
    ``text_only``.

    Raises:
        ModelConfigError: a multimodal config without ``text_only``, or one without a
            ``text_config``.
    """
    if not is_multimodal(hf):
        return hf
    model_type = hf.get("model_type")
    if not text_only:
        raise ModelConfigError(
            f"model_type {model_type!r} has a vision tower (vision_config); only its text "
            "model runs here: pass --text-only to serve it, without images"
        )
    nested = hf.get("text_config")
    if not isinstance(nested, Mapping) or not nested.get("model_type"):
        raise ModelConfigError(f"model_type {model_type!r} has no text_config with a model_type")
    # The outer config may say whether the head reuses the embedding (Gemma 3's does).
    tied = {k: hf[k] for k in ("tie_word_embeddings",) if hf.get(k) is not None}
    return {**tied, **nested}


def text_weight_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor ``name`` as the text model's, or None for a tensor
    of the vision tower, the projector or anything else beside the language model."""
    for theirs, ours in _TEXT_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return None
