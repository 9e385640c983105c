"""A Hugging Face checkpoint folder: config.json, safetensors weights, tokenizer.json.

Weights are read from safetensors only; a folder holding only pickled weights
(``pytorch_model.bin``) is refused rather than unpickled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from hybridkv.models import multimodal
from hybridkv.models.config import ModelConfig, eos_ids
from hybridkv.models.errors import CheckpointError, ModelConfigError
from hybridkv.models.families import (
    Family,
    RowScale,
    mtp_specs,
    normalized,
    our_name,
    running_family,
)
from hybridkv.models.hf_config import read_config
from hybridkv.models.specs import PolicyChoices
from hybridkv.models.weights import mxfp4

_T = TypeVar("_T")


def _read_index(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path.name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name} must hold a JSON object, got {type(data).__name__}")
    return data


def _quant_method(hf: dict[str, Any]) -> str | None:
    """The checkpoint's ``quantization_config`` method: None, or ``mxfp4`` (gpt-oss's
    experts, dequantised at load: ``models/weights/mxfp4.py``). Any other (FP8 blocks,
    GPTQ, AWQ, ...) is refused by name: its tensors are not the weights the layers take.

    Raises:
        ModelConfigError: naming the method.
    """
    quantized = hf.get("quantization_config")
    if quantized is None:
        return None
    method = quantized.get("quant_method") if isinstance(quantized, dict) else None
    if method == "mxfp4":
        return "mxfp4"
    raise ModelConfigError(
        f"quantization_config (quant_method {method!r}) is not supported: load the "
        "checkpoint's unquantised release; --weights int8 or int4 quantises it at load"
    )


#: A decoder layer's tensors, and its index.
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@attrs.frozen
class Checkpoint:
    """An opened checkpoint folder: its parsed config; weights load on demand.

    Attributes:
        path: The folder.
        config: The parsed model config, its layer specs included.
        family: The model family that reads it.
        eos_token_ids: End tokens of config.json and generation_config.json together.
        quant_method: ``mxfp4`` where some tensors are stored so (dequantised at load).
        text_of_multimodal: The text model of a multimodal checkpoint: its tensors are
            read under a text model's names, the others left out.
        scales: The family's multipliers folded into the weights at load
            (``Family.scales``), per ending of a tensor name.
        aliases: Per prefix of tensors the checkpoint holds once for several layers, the
            prefix it holds them under (``Family.shared_weights``).
    """

    path: Path
    config: ModelConfig
    family: Family
    eos_token_ids: tuple[int, ...]
    quant_method: str | None = None
    text_of_multimodal: bool = False
    scales: Mapping[str, tuple[RowScale, ...]] = attrs.field(factory=dict)
    aliases: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        dtype_bytes: int = 2,
        policies: PolicyChoices | None = None,
        text_only: bool = False,
        mtp: bool = False,
    ) -> Checkpoint:
        """Read and check ``path``/config.json (and generation_config.json if present).

        config.json is read and parsed here once; everything else reads the result.

        Args:
            path: The checkpoint folder.
            dtype_bytes: Bytes per cached K/V value, for the layer specs.
            policies: Per layer kind, the memory policy its layers keep and attend instead
                of the config's (see ``hybridkv.models.specs``).
            text_only: A multimodal checkpoint's text model is read (``multimodal.py``).
            mtp: Read its multi-token prediction layers too (``config.mtp_layers``), the
                speculative proposer of ``--speculative-config '{"method": "mtp"}'``.

        Raises:
            CheckpointError: no config.json.
            ModelConfigError: unreadable JSON, an unsupported architecture or config
                value, a policy chosen for a layer kind the model does not have, or a
                multimodal checkpoint without ``text_only``, or ``mtp`` for a checkpoint
                without MTP layers.
            PolicyError: a chosen policy that is not a MemoryPolicy.
        """
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{folder} has no config.json")
        outer = read_config(config_file)
        method = _quant_method(outer)
        hf = dict(multimodal.text_model_config(outer, text_only=text_only))
        family = running_family(str(hf.get("model_type")))
        assert family.parse is not None, "a family that runs parses"
        hf = dict(normalized(family, hf))
        config = family.parse(hf, dtype_bytes=dtype_bytes, policies=policies)
        if mtp:
            config = attrs.evolve(config, mtp_layers=mtp_specs(family, hf, config.layers))
        eos = list(config.eos_token_ids)
        generation_file = folder / "generation_config.json"
        if generation_file.is_file():
            extra = eos_ids(read_config(generation_file).get("eos_token_id"))
            eos += [t for t in extra if t not in eos]
        multimodal_names = multimodal.is_multimodal(outer)
        scales = {} if family.scales is None else family.scales(hf)
        aliases = {} if family.shared_weights is None else family.shared_weights(hf)
        return cls(folder, config, family, tuple(eos), method, multimodal_names, scales, aliases)

    def weight_files(self) -> list[Path]:
        """The safetensors files of the checkpoint.

        Raises:
            CheckpointError: none (pickled weights are never loaded).
        """
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_index(index).get("weight_map", {})
            return [self.path / name for name in sorted(set(weight_map.values()))]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.path} holds no *.safetensors weights; pickled checkpoints "
                "(pytorch_model.bin) are not loaded, convert them to safetensors"
            )
        return files

    def weight_names(self) -> set[str]:
        """The names of every tensor of the checkpoint (read from the file headers)."""
        names: set[str] = set()
        for file in self.weight_files():
            with safe_open(file, framework="pt", device="cpu") as handle:
                names.update(n for n in map(self._name, handle.keys()) if n is not None)
        return names | set(_aliased(dict.fromkeys(names), self.aliases))  # where absent

    def _name(self, stored: str) -> str | None:
        """A stored tensor's name as the model registers it (the family's renames applied);
        None for one it does not read (a vision tower's; one under the family's ``unread``
        prefixes, such as Qwen3-Next's MTP layers; a layer past ``num_hidden_layers``, as
        DeepSeek V3 and Ling store theirs)."""
        name = multimodal.text_weight_name(stored) if self.text_of_multimodal else stored
        if name is None or name.startswith(self.family.unread):
            return None
        mtp = self.family.mtp
        ours = None if mtp is None else mtp.our_name(name, self.config.num_layers)
        if ours is not None:  # an MTP layer's: read where they are loaded (not a copy)
            loaded = ours and int(ours.split(".")[1]) < len(self.config.mtp_layers)
            return our_name(self.family, ours) if loaded else None
        past = _LAYER.match(name)  # DeepSeek's and Ling's MTP layers, after the decoder
        if past is not None and int(past.group(1)) >= self.config.num_layers:
            return None
        return our_name(self.family, name)

    def load_weights(
        self,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        keep: Callable[[str], bool] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, floating ones cast to ``dtype``, on ``device``.

        Args:
            dtype: The dtype of floating tensors.
            device: Where to put them.
            keep: Loads only the tensors whose name it accepts (a pipeline stage's); all
                when None.
        """
        weights: dict[str, torch.Tensor] = {}
        for file in self.weight_files():
            with safe_open(file, framework="pt", device=str(device)) as handle:
                for stored in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    name = self._name(stored)
                    if name is None or (keep is not None and not keep(name)):
                        continue
                    tensor = _scaled(handle.get_tensor(stored), name, self.scales)
                    weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        shared = _aliased(weights, self.aliases)
        weights = {n: t for n, t in shared.items() if keep is None or keep(n)} | weights
        return weights if self.quant_method is None else mxfp4.dequantize_all(weights, dtype)

    def load_tokenizer(self) -> Tokenizer | None:
        """The folder's ``tokenizer.json``, or None when it has none."""
        file = self.path / "tokenizer.json"
        return Tokenizer.from_file(str(file)) if file.is_file() else None


def _scaled(
    tensor: torch.Tensor, name: str, scales: Mapping[str, tuple[RowScale, ...]]
) -> torch.Tensor:
    """``tensor`` with the runs of rows ``scales`` names for ``name`` multiplied, in
    float32 (before the cast to the model's dtype)."""
    runs = next((runs for end, runs in scales.items() if name.endswith(end)), ())
    if not runs:
        return tensor
    out = tensor.float()  # a copy where it is not float32 already
    if out is tensor:
        out = tensor.clone()
    for start, stop, factor in runs:
        out[start:stop] *= factor
    return out


def _aliased(tensors: Mapping[str, _T], aliases: Mapping[str, str]) -> dict[str, _T]:
    """``tensors`` under each alias of ``aliases`` (reader prefix -> the prefix held),
    the same objects: a part serving several layers is held once. (A checkpoint that
    holds a reader's tensors too, as ``save_pretrained`` writes them, keeps its own.)"""
    return {
        reader + name[len(held) :]: tensor
        for reader, held in aliases.items()
        for name, tensor in tensors.items()
        if name.startswith(held)
    }
