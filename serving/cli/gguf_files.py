"""A GGUF file given as the model (``hybridkv serve model.gguf``): converted once into a
checkpoint folder of the cache, then loaded as any checkpoint.

transformers reads the file (its GGUF loader: the architectures it maps, among them
``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``phi3``, ``gpt_oss``,
``gemma2`` and ``gemma3``), dequantises every tensor to float32 and converts the tokenizer;
the folder is keyed by the file's path, size and modification time, so a changed file is
converted again. The family that runs the folder is then the one its ``model_type``
names, refused by name where none does.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from hybridkv.serving.cli.conversion import (
    Progress,
    cache_dir,
    convert_once,
    gguf_checkpoint,
)
from hybridkv.serving.cli.model_errors import MissingExtraError


def gguf_folder(path: Path, *, progress: Progress) -> Path:
    """The checkpoint folder of the GGUF file ``path``, converting it on first use.

    Raises:
        MissingExtraError: transformers, gguf or accelerate is not installed.
        CacheDirError: the cache cannot be created.
    """
    missing = [n for n in ("transformers", "gguf", "accelerate") if not importlib.util.find_spec(n)]
    if missing:
        raise MissingExtraError(
            f"reading the GGUF file {str(path)!r} needs the packages {', '.join(missing)}; "
            "install them with: pip install 'hybridkv[demo]'"
        )
    stat = path.resolve().stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    target = cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:16]}"

    def write(scratch: Path, out: Path) -> None:
        progress("  [1/4] reading the GGUF file")
        gguf_checkpoint(path, out, progress=progress)

    return convert_once(target, path.name, write, progress=progress)
