"""The family registry: every module of models/families is found by its model_type, reads
configs without torch, and refuses what it cannot run by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridkv.models.checkpoint import Checkpoint
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import MODULES, family_for, runnable_model_types
from hybridkv.models.specs import layer_specs_from_config

FAMILIES = Path(__file__).resolve().parents[2] / "models" / "families"


def test_every_family_module_is_registered_under_its_model_types() -> None:
    """``ls models/families`` and the registry agree, both ways."""
    modules = {p.stem for p in FAMILIES.glob("*.py")} - {"__init__", "common"}
    assert set(MODULES.values()) == modules
    for model_type, module in MODULES.items():
        family = family_for(model_type)
        assert family is not None
        assert model_type in family.model_types + family.sized_types, module


def test_families_read_configs_without_torch() -> None:
    """``hybridkv plan`` sizes every family without loading torch."""
    code = (
        "import sys\n"
        "from hybridkv.models.families import MODULES, family_for\n"
        "[family_for(t) for t in MODULES]\n"
        "from hybridkv.models.published_shapes import BUILTIN_CONFIGS\n"
        "from hybridkv.models.specs import layer_specs_from_config\n"
        "[layer_specs_from_config(c) for c in BUILTIN_CONFIGS.values()]\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def _folder_of(tiny_models: Any, name: str, tmp_path: Path, **fields: Any) -> Path:
    """A copy of the tiny checkpoint with config fields changed."""
    folder = tmp_path / name
    shutil.copytree(tiny_models[name].path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


@pytest.mark.parametrize("model_type", ["rwkv", "mixtral", "gemma3", "xlstm"])
def test_a_type_that_does_not_run_is_refused_naming_what_runs(
    model_type: str, tiny_models: Any, tmp_path: Path
) -> None:
    folder = _folder_of(tiny_models, "llama", tmp_path, model_type=model_type)
    with pytest.raises(ModelConfigError, match=f"model_type '{model_type}' is not supported"):
        Checkpoint.open(folder)
    assert runnable_model_types()[:2] == ["llama", "gemma2"]
    assert "qwen3" in runnable_model_types() and "rwkv" not in runnable_model_types()


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("granite_swa", {"layer_rope_theta": [0, 5e3, 6e3, 5e3]}, "bases \\[5000.0, 6000.0\\]"),
        ("granite_swa", {"layer_rope_theta": [0, 5e3]}, "layer_rope_theta has 2 entries"),
        ("phi3", {"rope_parameters": {"rope_type": "su"}}, "rope_type 'su'"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope"}}, "need 'short_factor'"),
        ("mimo_v2_flash", {"n_group": 3}, "not a multiple of n_group=3"),
        ("mimo_v2_flash", {"mlp_layer_types": ["dense"]}, "'mlp_layer_types' must hold 4"),
        ("gemma4", {"use_bidirectional_attention": "all"}, "'all' is not supported"),
        ("gemma4", {"num_kv_shared_layers": 5}, "layer 2 \\(full_attention\\) has no"),
        ("gemma4", {"per_layer_config": {"2": {"sliding_window": 4}}}, "\\['sliding_window'\\]"),
        ("gemma4", {"rope_parameters": {"full_attention": {"rope_type": "x"}}}, "'x' is not"),
    ],
)
def test_config_fields_a_family_cannot_run_are_refused_by_name(
    name: str, fields: dict[str, Any], message: str, tiny_models: Any, tmp_path: Path
) -> None:
    folder = _folder_of(tiny_models, name, tmp_path, **fields)
    with pytest.raises(ModelConfigError, match=message):
        Checkpoint.open(folder)


def test_mimo_hub_window_is_read_as_transformers_reads_it(tiny_models: Any, tmp_path: Path) -> None:
    """MiMo-V2-Flash's hub config names the window ``sliding_window_size`` (previous tokens,
    the query not counted): read as ``sliding_window`` one larger, as transformers does,
    by the loader and by the sizing alike."""
    path = tiny_models["mimo_v2_flash"].path
    config = json.loads((path / "config.json").read_text())
    window = config.pop("sliding_window")
    folder = tmp_path / "hub"
    shutil.copytree(path, folder)
    hub = {**config, "sliding_window_size": window - 1}
    (folder / "config.json").write_text(json.dumps(hub))
    assert Checkpoint.open(folder).config.layers == Checkpoint.open(path).config.layers
    assert layer_specs_from_config(hub) == layer_specs_from_config(
        {**config, "sliding_window": window}
    )
