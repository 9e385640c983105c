"""Tiny checkpoints with an MTP layer, and transformers' MTP layer over them as the
reference the MTP proposer is compared with.

``MtpCheckpoint.make`` copies a tiny checkpoint of ``tiny_models`` and gives it one MTP
layer in its family's layout (``hybridkv.testing.tiny_mtp``). The reference is
transformers' ``MtpModel`` (the layer behind ``generate(use_mtp=True)``) on a float32
eager copy of the model, its weights those of the checkpoint's MTP layer; its proposals
are recomputed from the whole sequence every time, the k-th reading the (k-1)-th's
output and token, as the checkpoints run their layer recurrently.

transformers has no MTP layer for DeepSeek V4 (its residual streams, its separate
projections): there the reference is our executor over the whole sequence in one step,
without a cache, which checks the paging, the chunks and the hits of the incremental
runs, not the layer's arithmetic.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file

from hybridkv.models.checkpoint import Checkpoint
from hybridkv.testing.tiny_mtp import add_mtp_layer

#: The families whose checkpoints ship MTP layers that run here.
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "deepseek_v3", "deepseek_v32", "mimo_v2_flash")
MTP_FAMILIES += ("bailing_hybrid", "deepseek_v4")
#: The families whose MTP layer transformers builds (``MtpModel``).
TRANSFORMERS_MTP = tuple(f for f in MTP_FAMILIES if f != "deepseek_v4")
#: Our names of the parts beside the block -> transformers' ``MtpLayer``'s.
_PARTS = {
    "embed_norm": "enorm",
    "hidden_norm": "hnorm",
    "proj": "eh_proj",
    "final_norm": "post_norm",
}


@attrs.frozen
class MtpCheckpoint:
    """A tiny checkpoint with one MTP layer, and transformers' model and MTP layer."""

    path: Path
    main: Any
    mtp: Any
    _whole: dict[int, Any] = attrs.field(factory=dict)

    @classmethod
    def make(cls, source: Path, folder: Path) -> MtpCheckpoint:
        """Copy the checkpoint at ``source`` into ``folder`` with an MTP layer."""
        import transformers
        from transformers.modeling_layers import MtpModel

        shutil.copytree(source, folder)
        add_mtp_layer(folder)
        checkpoint = Checkpoint.open(folder, mtp=True)
        shape, config = checkpoint.family.mtp, checkpoint.config
        assert shape is not None
        if config.model_type not in TRANSFORMERS_MTP:
            return cls(folder, None, None)
        main = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager", dtype=torch.float32
        ).eval()
        text = main.config.get_text_config()
        text.num_mtp_layers = 1  # what transformers' MTP model is built from
        kind = str(config.mtp_layers[0].kind)
        if getattr(text, "layer_types", None) is not None:
            text.mtp_layer_types = [kind]
        if getattr(text, "mlp_layer_types", None) is not None:
            text.mtp_mlp_layer_types = ["dense" if shape.dense else "sparse"]
        mtp = MtpModel(main, 1).eval()
        template = shape.template(config.layers)
        # transformers builds the block as layer 0 of the config (dense where a tiny
        # config's first layer is); its MLP is the checkpoint's, as in the real ones.
        block = mtp.layers[0].mtp_block
        mlp_from = 0 if shape.dense else template
        block.mlp = copy.deepcopy(main.model.layers[mlp_from].mlp)
        ours = {
            name: tensor
            for name, tensor in _our_tensors(checkpoint).items()
            if name.split(".")[2] in _PARTS
        }
        with torch.no_grad():
            state = main.model.layers[template].state_dict()
            block.load_state_dict(
                {k: v for k, v in state.items() if not k.startswith("mlp.")}, strict=False
            )
            for name, tensor in ours.items():
                getattr(mtp.layers[0], _PARTS[name.split(".")[2]]).weight.copy_(tensor)
        return cls(folder, main, mtp)

    def proposals(self, tokens: Sequence[int], k: int) -> list[int]:
        """The ``k`` tokens the MTP layer proposes after ``tokens`` (the target computed
        every one but the last, the model's greedy token)."""
        if self.mtp is None:
            return self._in_one_step(tokens, k)
        ids = torch.tensor([list(tokens)])
        with torch.no_grad():
            out = self.main(input_ids=ids[:, :-1], output_hidden_states=True)
            hidden, inputs, proposed = out.hidden_states[-1], ids[:, 1:], []
            for _ in range(k):
                positions = torch.arange(1, inputs.shape[1] + 1)[None]
                rows = self.mtp.forward_layer(0, hidden, positions, None, input_ids=inputs)
                token = self.mtp._project_to_logits(rows[:, -1]).argmax(-1)
                proposed.append(int(token))
                hidden = torch.cat([hidden, rows[:, -1:]], dim=1)
                inputs = torch.cat([inputs, token[None]], dim=1)
        return proposed

    def _in_one_step(self, tokens: Sequence[int], k: int) -> list[int]:
        """Our executor's proposals after one step over all of ``tokens`` but the last,
        on a pool without a prefix cache."""
        from hybridkv.executor.load_options import LoadOptions
        from hybridkv.executor.model_executor import ModelExecutor
        from hybridkv.memory.manager import KVCacheManager
        from hybridkv.scheduler.batch import StepBatch, StepRequest
        from hybridkv.scheduler.params import SamplingParams

        if k not in self._whole:
            options = LoadOptions(kv_cache_bytes=1 << 20, block_size=4, mtp_proposals=k)
            executor = ModelExecutor.from_pretrained(self.path, options)
            self._whole[k] = (
                executor,
                KVCacheManager.for_pool(executor.pool, enable_prefix_caching=False),
            )
        executor, kv = self._whole[k]
        request = _Request("whole", list(tokens[:-1]))
        assert kv.allocate(request, len(request.all_token_ids)) is not None
        item = StepRequest(
            request_id="whole", token_ids=request.all_token_ids, start_position=0,
            block_tables=kv.block_tables("whole"), sample=True,
            params=SamplingParams(temperature=0.0), output_index=0,
        )  # fmt: skip
        try:
            result = executor.execute(StepBatch((item,)))
        finally:
            kv.free("whole", computed=False)
        assert result.token_ids[0] == tokens[-1] and result.proposals is not None
        return list(result.proposals[0])


@attrs.define
class _Request:
    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple[object, ...] = ()


def _our_tensors(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors of the checkpoint under our names (``mtp.0.proj.weight``)."""
    stored = load_file(str(checkpoint.path / "mtp.safetensors"))
    return {checkpoint._name(k) or "": v for k, v in stored.items()}
