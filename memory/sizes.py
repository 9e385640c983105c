"""Byte sizes as people write them: ``2GiB``, ``512MiB``, ``1.5GB``, ``1e9``, ``4096``.

One grammar for every flag and setting that takes a size (``--kv-memory``,
``--kv-offload host:SIZE``, ``--max-body-size``): a non-negative number, decimal or in
scientific notation, and an optional decimal (kB, MB, ...) or binary (KiB, MiB, ...) unit,
case-insensitive. Fractions of a byte are rounded down.
"""

from __future__ import annotations

import re
from fractions import Fraction

from hybridkv.errors import HybridKVError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip

_SIZE = re.compile(r"(\d*\.?\d+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)")


class SizeError(HybridKVError, ValueError):
    """A text that is not a byte size."""


def parse_size(text: str) -> int:
    """Bytes in ``text``.

    Raises:
        SizeError: not a non-negative number with a known unit.
    """
    match = _SIZE.fullmatch(text.strip())
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise SizeError(
            f"size {text!r} is not a non-negative number with an optional unit "
            f"({', '.join(u for u in _UNITS if u)}), such as 2GiB or 1e9"
        )
    # Fraction keeps 1.5GiB exact where a float would round.
    return int(Fraction(match.group(1)) * _UNITS[unit])
