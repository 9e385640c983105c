"""Converting a model once into a checkpoint folder of the cache: where the cache is, how
a conversion is staged and renamed into place, and how a GGUF file becomes a folder
(transformers reads it). ``builtin_models.py`` and ``gguf_files.py`` convert through it."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.serving.cli.model_errors import CacheDirError

#: Files whose presence marks a finished conversion.
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")

Progress = Callable[[str], None]


def cache_dir() -> Path:
    """Where converted built-in models live: ``$HYBRIDKV_CACHE_DIR``, else the XDG cache."""
    explicit = os.environ.get("HYBRIDKV_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "hybridkv"


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion."""
    return all((folder / name).is_file() for name in _CHECKPOINT_FILES)


def convert_once(
    target: Path, label: str, write: Callable[[Path, Path], None], *, progress: Progress
) -> Path:
    """``target``, a checkpoint folder written once by ``write(scratch, out)`` into a
    staging folder beside it and renamed into place (a reader never sees half of one; of
    two processes converting at once, the first to finish wins)."""
    if is_converted(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheDirError(
            f"cannot create the model cache {str(target.parent)!r} ({exc.strerror}); "
            "set HYBRIDKV_CACHE_DIR to a writable folder"
        ) from None
    started = time.monotonic()
    progress(f"First use of {label}: converting it once into {target} (about a minute)")
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as tmp:
        scratch = Path(tmp)
        staging = scratch / "checkpoint"
        write(scratch, staging)
        if target.exists() and not is_converted(target):
            shutil.rmtree(target)  # a leftover from an older, unfinished layout
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its folder is as good as ours.
            if not is_converted(target):
                raise
    progress(f"Converted {label} in {time.monotonic() - started:.0f} s")
    return target


def gguf_checkpoint(
    gguf: Path, out: Path, *, progress: Progress = stderr_progress, chat_template: str | None = None
) -> None:
    """Write the GGUF file ``gguf`` as a float32 safetensors checkpoint folder ``out``
    (config.json, model.safetensors, tokenizer.json), read and dequantised by
    transformers' GGUF loader; ``chat_template`` where the file names none."""
    import torch
    import transformers

    folder, name = str(gguf.parent), gguf.name
    progress("  [2/4] converting the tokenizer")
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    progress("  [3/4] dequantising the weights")
    lm: Any = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    # The weights are plain float32 now: drop the GGUF marker so the model saves normally.
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.hf_quantizer = None
    lm.is_quantized = False
    progress("  [4/4] writing config.json, model.safetensors, tokenizer.json")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
