"""Offload tiers for KV blocks of every group, and the connector that uses them.

The scheduler side (``connector.py``) decides what to load and save; the executor side
(``worker.py``) moves pages; tiers (``host.py``, ``redis_tier.py``) store encoded blocks
(``blob.py``) under keys (``keys.py``). No torch here: an executor supplies page access.
"""

from hybridkv.memory.offload.blob import KVBlock, decode, encode
from hybridkv.memory.offload.config import (
    OffloadConfig,
    OffloadStats,
    TierSpec,
    build_tier,
    parse_tier,
)
from hybridkv.memory.offload.connector import KVConnector, PlannedLoad
from hybridkv.memory.offload.errors import (
    CorruptBlockError,
    OffloadConfigError,
    OffloadError,
    TierUnavailableError,
)
from hybridkv.memory.offload.host import HostTier
from hybridkv.memory.offload.keys import KeySpace, salt_of
from hybridkv.memory.offload.redis_tier import RedisTier
from hybridkv.memory.offload.tier import Tier
from hybridkv.memory.offload.transfers import (
    BlockLoad,
    BlockSave,
    KVTransfers,
    LoadReport,
    LoadTask,
)
from hybridkv.memory.offload.worker import PageIO, TransferWorker

__all__ = [
    "BlockLoad",
    "BlockSave",
    "CorruptBlockError",
    "HostTier",
    "KVBlock",
    "KVConnector",
    "KVTransfers",
    "KeySpace",
    "LoadReport",
    "LoadTask",
    "OffloadConfig",
    "OffloadConfigError",
    "OffloadError",
    "OffloadStats",
    "PageIO",
    "PlannedLoad",
    "RedisTier",
    "Tier",
    "TierSpec",
    "TierUnavailableError",
    "TransferWorker",
    "build_tier",
    "decode",
    "encode",
    "parse_tier",
    "salt_of",
]
