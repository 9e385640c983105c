"""A stored block: its shape, dtype and checksum in a small header, then the raw bytes.

::

    b"HKV1" | u8 len(dtype) | dtype | u8 ndim | u32 * ndim shape | u64 xxh3 | payload

The checksum (xxh3-64 of the payload) catches a truncated or corrupted value; shape and
dtype catch a block written by another layout. A block that fails either is not loaded:
its tokens are recomputed.
"""

from __future__ import annotations

import math
import struct

import attrs
import xxhash

from hybridkv.memory.offload.errors import CorruptBlockError

_MAGIC = b"HKV1"
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint64": 8, "int8": 1}


@attrs.frozen(eq=False)
class KVBlock:
    """One group's page of one block, as bytes.

    Attributes:
        dtype: The element type's name (``float32``, ``bfloat16``, ...).
        shape: The page's shape in elements (layers, K/V, heads, slots, head dim).
        data: The elements, C order (any bytes-like object).
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview

    @property
    def num_bytes(self) -> int:
        """Bytes of the payload."""
        return memoryview(self.data).nbytes


def encode(block: KVBlock) -> bytes:
    """The stored form of ``block`` (header and payload)."""
    dtype = block.dtype.encode()
    header = struct.pack(
        f"<4sB{len(dtype)}sB{len(block.shape)}IQ",
        _MAGIC,
        len(dtype),
        dtype,
        len(block.shape),
        *block.shape,
        xxhash.xxh3_64_intdigest(block.data),
    )
    return header + bytes(block.data)


def decode(raw: bytes | bytearray | memoryview) -> KVBlock:
    """Read a stored block back, checking its header and checksum.

    Raises:
        CorruptBlockError: not a stored block, truncated, or the checksum differs.
    """
    view = memoryview(raw)
    try:
        magic, num_dtype = struct.unpack_from("<4sB", view, 0)
        if magic != _MAGIC:
            raise CorruptBlockError(f"a stored block starts with {bytes(magic)!r}, not {_MAGIC!r}")
        offset = 5
        dtype = bytes(view[offset : offset + num_dtype]).decode()
        offset += num_dtype
        (ndim,) = struct.unpack_from("<B", view, offset)
        shape_sum = struct.unpack_from(f"<{ndim}IQ", view, offset + 1)
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptBlockError(f"a stored block's header is unreadable: {exc}") from exc
    shape, checksum = tuple(shape_sum[:ndim]), shape_sum[ndim]
    payload = view[offset + 1 + 4 * ndim + 8 :]
    expected = math.prod(shape) * _ITEMSIZE.get(dtype, 0)
    if payload.nbytes != expected:
        raise CorruptBlockError(
            f"a stored {dtype} block of shape {shape} holds {payload.nbytes} bytes, "
            f"expected {expected}"
        )
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptBlockError(f"a stored {dtype} block of shape {shape} fails its checksum")
    return KVBlock(dtype, shape, payload)
