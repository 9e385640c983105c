"""Errors of the offload tiers and the KV connector."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class OffloadError(HybridKVError):
    """Base class of the KV connector's errors."""


class OffloadConfigError(OffloadError, ValueError):
    """A ``--kv-offload`` value or an offload setting that cannot be used."""


class TierUnavailableError(OffloadError):
    """A tier cannot be reached now (a Redis server went away): its blocks count as
    missing, and the tokens they held are recomputed."""


class CorruptBlockError(OffloadError):
    """A stored block fails its checksum, or its shape or dtype is not the page's."""
