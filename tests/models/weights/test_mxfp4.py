"""MXFP4 checkpoints (gpt-oss's experts as the hub ships them): dequantised at load to
what transformers dequantises them to, and served with its logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_fixtures import TinyModel
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.models.checkpoint import Checkpoint
from hybridkv.models.weights import mxfp4


def _packed(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 blocks and scales of a tensor stored as ``[..., rows, groups * 32]``,
    scales near 2^-3 (the tiny weights' range)."""
    *lead, rows, width = shape
    blocks = torch.randint(0, 256, (*lead, rows, width // 32, 16), generator=generator)
    scales = torch.randint(122, 126, (*lead, rows, width // 32), generator=generator)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_dequantised_values_are_transformers():
    """Every nibble value, both nibbles of a byte, a scale per group of 32."""
    generator = torch.Generator().manual_seed(0)
    blocks, scales = _packed((3, 40, 64), generator)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float32), expected)


def test_a_blocks_tensor_without_its_scales_is_refused():
    with pytest.raises(ValueError, match="without their pair"):
        mxfp4.dequantize_all({"w_blocks": torch.zeros(1, 1, 16, dtype=torch.uint8)}, torch.float32)


def _mxfp4_folders(tiny: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The tiny gpt-oss with its experts replaced by random MXFP4 tensors (as the hub
    ships them), and the same model with those experts dequantised by transformers."""
    quantised, reference = tmp_path / "mxfp4", tmp_path / "reference"
    shutil.copytree(tiny, quantised)
    shutil.copytree(tiny, reference)
    weights = load_file(tiny / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = weights.pop(name).transpose(1, 2)  # [experts, rows, inputs]
        blocks, scales = _packed(tuple(stored.shape), generator)
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    save_file(weights, quantised / "model.safetensors")
    dequantised = {
        n[: -len("_blocks")]: convert_moe_packed_tensors(
            t, weights[n.replace("_blocks", "_scales")]
        )
        for n, t in weights.items()
        if n.endswith("_blocks")
    }
    plain = {n: t for n, t in weights.items() if not n.endswith(("_blocks", "_scales"))}
    save_file(
        {**plain, **{n: t.float() for n, t in dequantised.items()}}, reference / "model.safetensors"
    )
    config = json.loads((quantised / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (quantised / "config.json").write_text(json.dumps(config))
    return quantised, reference


def test_an_mxfp4_gpt_oss_serves_transformers_logits(
    tiny_models, tmp_path, drive, prompt_of, check_reference
):
    """Its experts load as transformers dequantises them, and a prompt past the sliding
    window then decode steps give transformers' logits and greedy tokens."""
    quantised, reference_folder = _mxfp4_folders(tiny_models["gpt_oss"].path, tmp_path)
    assert Checkpoint.open(quantised).quant_method == "mxfp4"
    loaded = Checkpoint.open(quantised).load_weights(torch.float32, "cpu")
    for name, tensor in load_file(reference_folder / "model.safetensors").items():
        assert torch.equal(loaded[name], tensor.float()), name
    executor = ModelExecutor.from_pretrained(
        quantised, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    driver = drive(executor)
    driver.add("a", prompt_of(23, 1))
    driver.run(6)
    check_reference(TinyModel.load("gpt_oss", reference_folder), driver, "a")
