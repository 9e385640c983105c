"""KV cache events on the wire: msgpack in the shape of vLLM's ``KVEventBatch``.

vLLM declares its events as msgspec structs, tagged, ``array_like`` (positional) with
``omit_defaults``; a batch is ``[ts, events, data_parallel_rank]`` and an event is an
array whose first element is its tag, the class name. hybridkv writes the same arrays,
vLLM's fields first and in vLLM's order, its own after them, so a consumer written for
vLLM (positional, ignoring trailing fields it does not know) decodes every event::

    BlockStored  [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
                  kv_cache_spec_sliding_window,  checkpoint_positions]   <- hybridkv's
    BlockRemoved [tag, block_hashes, medium, group_idx]
    AllBlocksCleared [tag]

A block hash is sent as vLLM sends it by default: an unsigned 64-bit integer, the last 8
bytes of the digest read big-endian (``hybridkv.memory.hashing`` says how a digest is
made). ``medium`` names the tier in vLLM's words: ``GPU`` for the engine's own KV pool
(on whatever device it runs), ``CPU`` for the host tier, ``REDIS`` for Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from hybridkv.memory.cache_events import DEVICE, AllBlocksCleared, BlockStored, CacheEvent
from hybridkv.memory.hashing import BlockHash

#: ``medium`` on the wire for each place a block lives.
MEDIUM = {DEVICE: "GPU", "host": "CPU", "redis": "REDIS"}


def wire_hash(block_hash: BlockHash) -> int:
    """A block hash as vLLM sends it: the digest's last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


def event_fields(event: CacheEvent) -> list[Any]:
    """One event as its positional msgpack array."""
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    medium = MEDIUM.get(event.medium, event.medium.upper())
    hashes = [wire_hash(h) for h in event.block_hashes]
    group = event.group
    if not isinstance(event, BlockStored):
        return ["BlockRemoved", hashes, medium, group.index]
    parent = None if event.parent_hash is None else wire_hash(event.parent_hash)
    positions = None if event.checkpoint_positions is None else list(event.checkpoint_positions)
    return [
        "BlockStored",
        hashes,
        parent,
        list(event.token_ids),
        group.block_size,
        None,  # lora_id: hybridkv serves no adapters
        medium,
        None,  # lora_name
        None,  # extra_keys: the cache salt is inside the root hash instead
        group.index,
        group.kind,
        group.sliding_window,
        positions,
    ]


def encode_batch(ts: float, events: Sequence[CacheEvent], data_parallel_rank: int = 0) -> bytes:
    """A ``KVEventBatch`` payload: ``[ts, [event, ...], data_parallel_rank]``."""
    body = [ts, [event_fields(event) for event in events], data_parallel_rank]
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data
