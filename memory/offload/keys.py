"""Where an engine's blocks live in a tier: one key per (group, block).

::

    hkv:<model fingerprint>:<group>.<layer kind>:<cache salt>:<chained block hash>
    hkv:3f2a9c...:0.full_attention:-:9b1e...          (no salt)
    hkv:3f2a9c...:1.sliding_attention:a41c07e2...:9b1e...

The fingerprint covers the model and the layout (which layers each group holds, their
dtype, the block size), so engines of one model and layout share blocks and no other
engine ever reads them. Over tensor, pipeline or context ranks it also names the rank's
share of the pages (``<model>.tp0of2-pp0of1-cp0of1``, ``parallel/rank_offload.py``):
each rank stores its own share, and only the same rank of the same layout reads it.
The chained block hash already covers the tokens and the cache
salt; the salt is in the key too (hashed), so a tenant's entries can be found and
dropped by pattern.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import xxhash

from hybridkv.memory.hashing import BlockHash


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    # A typed converter: mypy reads attrs' converter=tuple as taking Iterable[_T_co].
    return tuple(values)


@attrs.frozen
class KeySpace:
    """The key prefix of one model and layout.

    Attributes:
        fingerprint: Identifies the model's weights and the layout (hex, no colon).
        group_kinds: Per KV group, the config's layer kind of its layers
            (``full_attention``, ``sliding_attention``, ...).
        group_fingerprints: Per KV group, the fingerprint its keys carry, where they
            differ (a pipeline whose stage 0 holds no layer of a group looks up the
            first stage that does); empty: ``fingerprint`` for all.
        model: Names the model whatever the rank layout (empty: unknown), for
            :meth:`layout_key`.
        layout: The rank layout the pages are cut for (``tp=2 pp=1 cp=1``).
    """

    fingerprint: str
    group_kinds: tuple[str, ...] = attrs.field(converter=_str_tuple)
    group_fingerprints: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    model: str = ""
    layout: str = "tp=1 pp=1 cp=1"

    def layout_key(self) -> bytes:
        """Where a shared tier records the rank layout this model's blocks are cut for:
        an engine of another layout could never load them, and is refused
        (``connector.py``). Not a block key: tier events skip it."""
        return f"hkv-layout:{self.model}".encode()

    def key(self, group: int, block_hash: BlockHash, salt: str) -> bytes:
        """The key of ``group``'s page of the block ``block_hash`` (``salt``: see
        :func:`salt_of`)."""
        kind = self.group_kinds[group]
        fingerprint = (
            self.group_fingerprints[group] if self.group_fingerprints else self.fingerprint
        )
        return f"hkv:{fingerprint}:{group}.{kind}:{salt}:{block_hash.hex()}".encode()


def with_fingerprint(key: bytes, fingerprint: str) -> bytes:
    """``key`` with another fingerprint: the same page of the same block, as another rank
    of the layout stores its share of it."""
    prefix, _, rest = key.split(b":", 2)
    return b":".join((prefix, fingerprint.encode(), rest))


def parse_key(key: bytes) -> tuple[int, BlockHash]:
    """The (group, chained block hash) a key of :meth:`KeySpace.key` names."""
    fields = key.split(b":")
    return int(fields[2].split(b".", 1)[0]), BlockHash(bytes.fromhex(fields[-1].decode()))


def salt_of(extra_keys: tuple[object, ...]) -> str:
    """The key's salt field for a request's extra keys: ``-`` without any, else a hash."""
    if not extra_keys:
        return "-"
    return xxhash.xxh3_64_hexdigest(repr(extra_keys).encode())
