"""A multi-token prediction layer for a tiny checkpoint, in its family's layout.

The tests of speculative method ``mtp`` give a tiny random checkpoint (``tiny_models``)
the MTP layer its family's real checkpoints ship, under the names those use
(``models/shapes/mtp.py``): a block copied from the decoder's last layer of the block's
kind, norms copied from that layer's input norm, a random projection.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybridkv.models.checkpoint import Checkpoint


def add_mtp_layer(folder: Path, *, seed: int = 0) -> Path:
    """Write one MTP layer for the checkpoint in ``folder`` into ``folder/mtp.safetensors``
    and count it in config.json where the family's config counts them; returns ``folder``.

    Raises:
        ValueError: the checkpoint's family has no MTP layers.
    """
    checkpoint = Checkpoint.open(folder)
    shape, config = checkpoint.family.mtp, checkpoint.config
    if shape is None:
        raise ValueError(f"{config.model_type} checkpoints have no MTP layers")
    weights = load_file(str(folder / "model.safetensors"))
    block = _layer(weights, shape.template(config.layers))
    # The MLP of the first dense layer where the block's is dense, else of the last layer
    # (DeepSeek V4's first layers route by token id; an MTP block does not).
    mlp = checkpoint.family.decoder.mlp_name or "mlp"
    dense = [k for k in weights if k.endswith(f".{mlp}.gate_proj.weight")]
    source = int(dense[0].split(".")[2]) if shape.dense else config.num_layers - 1
    block = {k: v for k, v in block.items() if not k.startswith(f"{mlp}.")}
    block |= {k: v for k, v in _layer(weights, source).items() if k.startswith(f"{mlp}.")}
    width = config.hidden_size
    norm = next(v for k, v in block.items() if k.endswith("norm.weight") and v.shape == (width,))
    generator = torch.Generator().manual_seed(seed)
    proj = torch.randn(width, 2 * width, generator=generator) * (2 * width) ** -0.5
    parts = {"enorm": norm, "hnorm": norm.flip(0), "eh_proj": proj}
    if shape.layout == "mtp":
        out = {f"mtp.layers.0.{k}": v for k, v in block.items()}
        names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc"}
        out |= {f"mtp.{names[k]}.weight": v for k, v in parts.items()}
        out["mtp.norm.weight"] = norm.roll(1)
    elif shape.layout == "indexed":  # DeepSeek V4: a projection each, its own stream sum
        out = {f"mtp.0.{k}": v for k, v in block.items()}
        parts |= {"e_proj": proj[:, :width], "h_proj": proj[:, width:], "norm": norm.roll(1)}
        del parts["eh_proj"]
        out |= {f"mtp.0.{k}.weight": v for k, v in parts.items()}
        out |= {
            f"mtp.0.hc_head_{p}": weights[f"model.hc_head.hc_{p}"] for p in ("fn", "base", "scale")
        }
    else:
        if shape.layout == "after":
            prefix = f"model.layers.{config.num_layers}."
            final = "shared_head.norm"
        else:
            prefix = "model.mtp.layers.0."
            final = "final_layernorm"
            renames = {ours: theirs for theirs, ours in shape.block_renames.items()}
            block = {_renamed(k, renames): v for k, v in block.items()}
        out = {prefix + k: v for k, v in block.items()}
        out |= {f"{prefix}{k}.weight": v for k, v in parts.items()}
        out[f"{prefix}{final}.weight"] = norm.roll(1)
    save_file({k: v.clone() for k, v in out.items()}, str(folder / "mtp.safetensors"))
    config_file = folder / "config.json"
    hf = json.loads(config_file.read_text())
    if shape.count_fields:
        hf[shape.count_fields[0]] = 1
    config_file.write_text(json.dumps(hf, indent=2))
    return folder


def save_agreeing_mtp(
    folder: Path, *, num_layers: int = 4, hidden_size: int = 64, seed: int = 0
) -> Path:
    """A Qwen3.5-shaped hybrid whose MTP layer proposes what it will emit, mostly: the
    benchmark's and the acceptance tests' model.

    One full attention layer, then ``num_layers - 1`` Gated DeltaNet layers whose outputs
    (mixer and MLP) are scaled down 50 times, so the model computes nearly what its first
    layer alone computes; every token embedding has unit RMS. Its MTP layer's block is
    that first layer, its projection keeps the embedding of the token after each position
    and drops the hidden state (the embedding norm a unit scale), its final norm the
    model's: at position q it computes what the first layer computes at q + 1, so it
    names the token after that, as the model does where the DeltaNet layers do not tip
    the argmax.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from hybridkv.testing.tiny_families import COMMON
    from hybridkv.testing.tiny_models import save_redrawn
    from hybridkv.testing.tiny_state_families import qwen3_next_fields

    fields = {**qwen3_next_fields(), "num_hidden_layers": num_layers}
    fields |= {
        "hidden_size": hidden_size,
        "intermediate_size": COMMON["intermediate_size"] * hidden_size // 64,
    }
    fields["layer_types"] = ["full_attention"] + ["linear_attention"] * (num_layers - 1)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields))
    with torch.no_grad():
        save_redrawn(model, folder, seed=seed)
        embed = model.model.embed_tokens.weight
        embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
        for layer in model.model.layers[1:]:
            layer.linear_attn.out_proj.weight /= 50.0
            layer.mlp.down_proj.weight /= 50.0
        model.save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    first = {
        k[len("model.layers.0.") :]: v
        for k, v in weights.items()
        if k.startswith("model.layers.0.")
    }
    width = hidden_size
    proj = torch.zeros(width, 2 * width)
    proj[:, :width] = torch.eye(width)
    out = {f"mtp.layers.0.{k}": v.clone() for k, v in first.items()}
    out |= {
        "mtp.fc.weight": proj,
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(width),  # 1 + 0: a unit scale
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(width),
        "mtp.norm.weight": weights["model.norm.weight"].clone(),
    }
    save_file(out, str(folder / "mtp.safetensors"))
    return folder


def _layer(weights: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """Decoder layer ``index``'s tensors, named within the layer."""
    prefix = f"model.layers.{index}."
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def _renamed(name: str, renames: dict[str, str]) -> str:
    for ours, theirs in renames.items():
        name = name.replace(ours, theirs)
    return name


__all__ = ["add_mtp_layer", "save_agreeing_mtp"]
