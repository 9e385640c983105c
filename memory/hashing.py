"""Chained block hashes: the key of a full block of tokens in the prefix cache.

A block's hash covers its parent's hash and its own tokens; the first block's parent is
a root hash of the request's extra keys (cache salt, adapter id), so two requests share a
cached block only if they share every token before it and every extra key::

    root = H("hybridkv" | extra_keys)
    h0 = H(root | tokens[0:bs])     h1 = H(h0 | tokens[bs:2bs])     ...

Hashes are computed once per request as tokens arrive and shared by every KV group (the
pool keys its map by (hash, group)).

The default is SHA-256: a collision would serve one request another's KV, across tenants,
so the function must resist crafted inputs. Measured on this project's CI machine, it
costs about 0.7 us per 16-token block, which is 0.04 us per token, noise beside
everything else a step does; xxh3-128 (0.3 us) is offered for trusted single-tenant use.
``python -m benchmarks.allocator.allocator --hash-bench`` prints the numbers.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import NewType

from hybridkv.memory.errors import LayoutError

BlockHash = NewType("BlockHash", bytes)

#: Token ids are hashed as unsigned 32-bit integers: every id must be below this.
TOKEN_ID_LIMIT = 1 << 32


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128() -> Callable[[bytes], bytes]:
    import xxhash

    fn: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return fn


# Name -> factory of the hash function (factories keep imports lazy).
_HASHES: dict[str, Callable[[], Callable[[bytes], bytes]]] = {
    "sha256": lambda: _sha256,
    "xxh3_128": _xxh3_128,
}


def hash_names() -> tuple[str, ...]:
    """The supported hash function names."""
    return tuple(sorted(_HASHES))


class BlockHasher:
    """Extends a request's list of block hashes as its tokens arrive."""

    def __init__(self, block_size: int, hash_name: str = "sha256") -> None:
        factory = _HASHES.get(hash_name)
        if factory is None:
            raise LayoutError(f"unknown hash {hash_name!r}; known: {', '.join(hash_names())}")
        self.block_size = block_size
        self._fn = factory()

    def root(self, extra_keys: tuple[object, ...]) -> BlockHash:
        """The parent hash of a request's first block."""
        return BlockHash(self._fn(b"hybridkv\x00" + repr(extra_keys).encode()))

    def extend(
        self,
        hashes: list[BlockHash],
        root: BlockHash,
        token_ids: Sequence[int],
        num_tokens: int,
    ) -> None:
        """Append the hashes of the blocks that are full within ``token_ids[:num_tokens]``."""
        bs, fn = self.block_size, self._fn
        parent = hashes[-1] if hashes else root
        start = len(hashes) * bs
        stop = start + max(0, num_tokens - start) // bs * bs
        # One conversion for all new blocks: per block it cost as much as the hash.
        data, step = array("I", token_ids[start:stop]).tobytes(), 4 * bs
        for offset in range(0, len(data), step):
            parent = BlockHash(fn(parent + data[offset : offset + step]))
            hashes.append(parent)
