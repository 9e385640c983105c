"""vLLM's KV event structs as its consumers declare them (msgspec, positional, tagged):
the current fields, and an older consumer's that stops at ``lora_id``."""

from __future__ import annotations

from typing import Any

import msgspec


class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """vLLM's ``KVCacheEvent``."""


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OldBlockStored(Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class OldBlockRemoved(Event, tag="BlockRemoved"):
    block_hashes: list[int]


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | AllBlocksCleared]
