"""The model executor's pages for the KV connector: page access and the model's key space.

A group's page of one block is, for every layer of the group, its ``[2, kv_heads,
block_size, head_dim]`` slice; a stored block stacks them as ``[layers, 2, kv_heads,
block_size, head_dim]`` (where the layers' pages differ in shape, as DeepSeek V4's
compressor states of two sizes do, it holds them flattened one after another). Reads
and writes run on the executor's torch thread, at the start of a step
(``hybridkv.memory.offload.worker``). On CUDA, pages go through pinned host buffers, and
the host tier keeps its values in pinned memory too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from hybridkv.memory.layout import LayerSpec, LayoutPlan, cached_layers
from hybridkv.memory.offload.blob import KVBlock
from hybridkv.memory.offload.errors import CorruptBlockError
from hybridkv.memory.offload.keys import KeySpace
from hybridkv.memory.offload.tier import BufferFactory
from hybridkv.models.config import ModelConfig


class KVPages:
    """Reads and writes whole pages of a group over every layer it holds (a ``PageIO``).

    Args:
        caches: Per layer held, its paged view ``[num_blocks, 2, heads, bs, head_dim]`` (a
            state layer's: one float32 row per state page; a latent layer's K/V axis of
            stride 0 is read and written once).
        layer_groups: Per layer held, its KV group.
        device: Where the caches live.
        state_spans: Per state group whose pages span several page ids, the span.
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layer_groups: Sequence[int],
        device: torch.device,
        *,
        state_spans: dict[int, int] | None = None,
    ) -> None:
        # A state group's view has one row per state page: page id // span.
        self._spans = state_spans or {}
        self._layers: dict[int, list[torch.Tensor]] = {}
        for cache, group in zip(caches, layer_groups, strict=True):
            if cache.dim() == 5 and cache.stride(1) == 0:  # values that are the keys
                cache = cache[:, :1]
            self._layers.setdefault(group, []).append(cache)
        self.device = device
        self._pin = device.type == "cuda"

    @property
    def groups(self) -> frozenset[int]:
        """The groups of the layers held (a pipeline stage holds some)."""
        return frozenset(self._layers)

    def _index(self, group: int, pages: Sequence[int]) -> torch.Tensor:
        span = self._spans.get(group, 1)
        rows = [page // span for page in pages] if span > 1 else list(pages)
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _mixed(self, group: int) -> bool:
        """Whether the group's layers hold pages of different shapes (DeepSeek V4's
        compressor states, CSA's beside HCA's, in one state group): its blocks then hold
        every layer's page flattened, one after another."""
        layers = self._layers[group]
        return any(cache.shape[1:] != layers[0].shape[1:] for cache in layers)

    def read_pages(self, group: int, pages: Sequence[int]) -> list[KVBlock]:
        layers = self._layers[group]
        index = self._index(group, pages)
        with torch.inference_mode():
            parts = [cache.index_select(0, index) for cache in layers]
            if self._mixed(group):
                stacked = torch.cat([part.flatten(1) for part in parts], dim=1)
            else:
                stacked = torch.stack(parts, dim=1)
            if self._pin:
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()
            else:
                host = stacked.contiguous()
        dtype = str(host.dtype).removeprefix("torch.")
        shape = tuple(host.shape[1:])
        raw = host.view(torch.uint8).numpy()
        return [KVBlock(dtype, shape, raw[i].tobytes()) for i in range(len(pages))]

    def write_pages(self, group: int, pages: Sequence[int], blocks: Sequence[KVBlock]) -> None:
        layers = self._layers[group]
        first, mixed = layers[0], self._mixed(group)
        sizes = [cache[0].numel() for cache in layers]
        shape = (sum(sizes),) if mixed else (len(layers), *first.shape[1:])
        dtype = str(first.dtype).removeprefix("torch.")
        for block in blocks:
            if block.dtype != dtype or block.shape != shape:
                raise CorruptBlockError(
                    f"a stored {block.dtype} block of shape {block.shape} does not fit group "
                    f"{group}'s {dtype} pages of shape {shape}"
                )
        staging = torch.empty((len(blocks), *shape), dtype=first.dtype, pin_memory=self._pin)
        raw = staging.view(torch.uint8).numpy().reshape(len(blocks), -1)
        for row, block in zip(raw, blocks, strict=True):
            row[:] = np.frombuffer(block.data, dtype=np.uint8)
        index = self._index(group, pages)
        with torch.inference_mode():
            values = staging.to(self.device, non_blocking=self._pin)
            parts = torch.split(values, sizes, dim=1) if mixed else values.unbind(1)
            for cache, part in zip(layers, parts, strict=True):
                cache.index_copy_(0, index, part.view(-1, *cache.shape[1:]))


def pinned_buffers(device: torch.device) -> BufferFactory | None:
    """The host tier's buffer factory: pinned memory on CUDA, None (bytearray) elsewhere."""
    if device.type != "cuda":
        return None

    def allocate(num_bytes: int) -> memoryview:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True).numpy().data

    return allocate


def key_space(
    model: torch.nn.Module, config: ModelConfig, plan: LayoutPlan, dtype: torch.dtype
) -> KeySpace:
    """The key space of a model and layout: a fingerprint of its weights, config, dtype and
    groups, and each group's layer kind.

    The weights enter by a sample: the first values of every parameter, so two checkpoints
    of one architecture (a base model and its fine-tune) never share blocks. The model's
    own name for the tiers' layout marker is the dtype and the first values of the token
    embedding, which rank 0 holds whatever the rank layout.
    """
    digest = xxhash.xxh3_128()
    model_id = xxhash.xxh3_64(str(dtype).encode())  # what every rank layout shares
    embeds = False
    digest.update(repr(config).encode())
    digest.update(f"{dtype}|{plan.block_size}".encode())
    for group in plan.groups:
        digest.update(("|".join(group.layer_names) + repr(group.policy)).encode())
    with torch.inference_mode():
        for name, param in model.named_parameters():
            sample = param.detach().reshape(-1)[:64].to("cpu", torch.float32)
            digest.update(name.encode() + sample.numpy().tobytes())
            if name.endswith("embed_tokens.weight"):  # rank 0 holds its first rows
                model_id.update(sample.numpy().tobytes())
                embeds = True
    return KeySpace(
        digest.hexdigest()[:24],
        group_kinds(cached_layers(config.planned_layers), plan),
        model=model_id.hexdigest() if embeds else "",
    )


def group_kinds(layers: Sequence[LayerSpec], plan: LayoutPlan) -> list[str]:
    """Per KV group of ``plan``, the layer kind of its layers (the config's, else its
    policy's class name)."""
    kinds = {spec.name: spec.kind for spec in layers}
    return [kinds.get(g.layer_names[0]) or type(g.policy).__name__ for g in plan.groups]
