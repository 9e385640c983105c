"""Checkpoint folders: safetensors only, shards, tied embeddings, tokenizer, end tokens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.models.checkpoint import Checkpoint
from hybridkv.models.errors import CheckpointError, ModelConfigError


def test_pickle_only_folder_is_refused(tiny_models, tmp_path):
    """A folder with pytorch_model.bin and no safetensors is refused, never unpickled."""
    shutil.copy(tiny_models["llama"].path / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="safetensors"):
        ModelExecutor.from_pretrained(tmp_path, LoadOptions(kv_cache_bytes=1 << 20))


def test_missing_config_is_refused(tmp_path):
    """A folder without config.json is named in the error."""
    with pytest.raises(CheckpointError, match=r"config\.json"):
        Checkpoint.open(tmp_path)


def test_sharded_checkpoint_loads_every_shard(tiny_models, tmp_path):
    """Weights split over several safetensors shards load to the same tensors."""
    reference = tiny_models["gemma3"].reference
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    whole = Checkpoint.open(tiny_models["gemma3"].path).load_weights(torch.float32, "cpu")
    sharded = Checkpoint.open(tmp_path).load_weights(torch.float32, "cpu")
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_tied_embeddings_share_one_tensor(tiny_models):
    """Gemma's LM head is the embedding matrix itself, not a copy."""
    executor = ModelExecutor.from_pretrained(
        tiny_models["gemma2"].path, LoadOptions(kv_cache_bytes=1 << 20)
    )
    model = executor.model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_llama_reads_its_own_head(tiny_models):
    """Llama with untied embeddings loads lm_head.weight from the checkpoint."""
    executor = ModelExecutor.from_pretrained(
        tiny_models["llama"].path, LoadOptions(kv_cache_bytes=1 << 20)
    )
    model = executor.model
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tokenizer_json_is_loaded_when_present(tiny_models, tmp_path):
    """A folder with tokenizer.json gets a tokenizers.Tokenizer; one without gets None."""
    shutil.copytree(tiny_models["llama"].path, tmp_path, dirs_exist_ok=True)
    assert Checkpoint.open(tmp_path).load_tokenizer() is None
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = ModelExecutor.from_pretrained(tmp_path, LoadOptions(kv_cache_bytes=1 << 20)).tokenizer
    assert loaded.encode("hello world").ids == [1, 2]


def test_generation_config_adds_end_tokens(tiny_models, tmp_path):
    """End tokens of generation_config.json join those of config.json."""
    shutil.copytree(tiny_models["gemma3"].path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert Checkpoint.open(tmp_path).eos_token_ids == (1, 106)


def test_unreadable_config_is_a_model_config_error(tmp_path):
    """config.json that is not JSON is refused as every reader refuses it, naming the file."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"config\.json' as JSON"):
        Checkpoint.open(tmp_path)


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq"])
def test_a_quantised_checkpoint_is_refused_by_its_method(tiny_models, tmp_path, method):
    """Block-scaled FP8 and the rest but MXFP4 (``tests/models/weights/test_mxfp4.py``) are
    refused naming the method, not loaded as if their tensors were the weights."""
    shutil.copytree(tiny_models["llama"].path, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "weight_block_size": [128, 128]}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=f"quant_method '{method}'"):
        Checkpoint.open(tmp_path / "q")


@pytest.mark.parametrize(
    ("family", "stored", "ours"),
    [
        ("deepseek_v3", "model.layers.61.eh_proj.weight", "mtp.0.proj.weight"),
        ("deepseek_v3", "model.layers.61.shared_head.norm.weight", "mtp.0.final_norm.weight"),
        ("deepseek_v3", "model.layers.61.shared_head.head.weight", ""),  # the model's head
        ("deepseek_v3", "model.layers.61.embed_tokens.weight", ""),
        ("deepseek_v3", "model.layers.61.mlp.experts.7.up_proj.weight",
         "mtp.0.block.mlp.experts.7.up_proj.weight"),
        ("deepseek_v3", "model.layers.60.eh_proj.weight", None),  # a decoder layer's name
        ("deepseek_v3", "model.layers.62.enorm.weight", "mtp.1.embed_norm.weight"),
        ("bailing_hybrid", "model.layers.61.final_layernorm.weight", "mtp.0.final_norm.weight"),
        ("qwen3_next", "mtp.fc.weight", "mtp.0.proj.weight"),
        ("qwen3_next", "mtp.pre_fc_norm_hidden.weight", "mtp.0.hidden_norm.weight"),
        ("qwen3_next", "mtp.norm.weight", "mtp.0.final_norm.weight"),
        ("qwen3_next", "mtp.layers.0.input_layernorm.weight",
         "mtp.0.block.input_layernorm.weight"),
        ("qwen3_next", "model.norm.weight", None),
        ("mimo_v2_flash", "model.mtp.layers.0.pre_mlp_layernorm.weight",
         "mtp.0.block.post_attention_layernorm.weight"),
        ("mimo_v2_flash", "model.mtp.layers.0.final_layernorm.weight", "mtp.0.final_norm.weight"),
        ("deepseek_v4", "mtp.0.e_proj.weight", "mtp.0.embed_proj.weight"),
        ("deepseek_v4", "mtp.0.h_proj.weight", "mtp.0.hidden_proj.weight"),
        ("deepseek_v4", "mtp.0.hc_head_fn", "mtp.0.hc_head.hc_fn"),
        ("deepseek_v4", "mtp.0.norm.weight", "mtp.0.final_norm.weight"),
        ("deepseek_v4", "mtp.0.attn.wkv.weight", "mtp.0.block.attn.wkv.weight"),
        ("deepseek_v4", "model.layers.0.attn.wkv.weight", None),
    ],
)  # fmt: skip
def test_mtp_tensors_map_to_our_modules_from_the_names_real_checkpoints_use(
    family: str, stored: str, ours: str | None
) -> None:
    """The names of the real checkpoints' MTP layers (DeepSeek V3 and Ling after their 61
    decoder layers, Qwen3-Next's under ``mtp.``, MiMo-V2-Flash's under ``model.mtp``,
    DeepSeek V4's under ``mtp.{i}.``)."""
    from hybridkv.models.families import family_for

    shape = family_for(family).mtp
    assert shape is not None and shape.our_name(stored, 61) == ours


def test_only_the_first_mtp_layer_is_read_and_none_without_mtp(tiny_models, tmp_path):
    """A checkpoint's MTP tensors load with ``mtp=True`` (its first layer's: it proposes
    every token), and are left unread without it, as are a second layer's."""
    from hybridkv.testing.tiny_mtp import add_mtp_layer

    folder = tmp_path / "v3"
    shutil.copytree(tiny_models["deepseek_v3"].path, folder)
    add_mtp_layer(folder)
    with_mtp = Checkpoint.open(folder, mtp=True)
    names = with_mtp.weight_names()
    assert "mtp.0.proj.weight" in names and "mtp.0.block.input_layernorm.weight" in names
    assert with_mtp.config.mtp_layers[0].name == "mtp.0.self_attn"
    assert not any(n.startswith("mtp.") for n in Checkpoint.open(folder).weight_names())
    assert with_mtp._name(f"model.layers.{with_mtp.config.num_layers + 1}.enorm.weight") is None
