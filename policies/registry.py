"""Policies by name, so configs and layer specs can say ``"sliding_window"``.

Three ways in: the built-ins; :func:`register_policy` on a class of the program's own
(any module imported before the name is used; the command line's ``--import MODULE``
imports one); and an entry point of an installed package, in the group
:data:`ENTRY_POINT_GROUP`, loaded the first time a name is looked up::

    [project.entry-points."hybridkv.policies"]
    sink_window = "my_package.policies:SinkWindow"

An entry point's name must be its class's ``name``.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Any, TypeVar

from hybridkv.policies.base import MemoryPolicy
from hybridkv.policies.builtin import (
    ChunkedLocal,
    CompressedEntries,
    FullAttention,
    MambaLike,
    SlidingWindow,
)
from hybridkv.policies.errors import PolicyError

P = TypeVar("P", bound=type[MemoryPolicy])

_REGISTRY: dict[str, type[MemoryPolicy]] = {}

#: The entry-point group installed packages register policies under.
ENTRY_POINT_GROUP = "hybridkv.policies"


def register_policy(cls: P) -> P:
    """Class decorator: make ``cls`` constructible by its ``name`` through :func:`make_policy`.

    Raises:
        PolicyError: the class has no name, or another class already holds it.
    """
    name = cls.name
    if not name:
        raise PolicyError(f"{cls.__qualname__} needs a non-empty class attribute `name`")
    held = _REGISTRY.get(name)
    if held is not None and held is not cls:
        raise PolicyError(f"policy name {name!r} is already registered by {held.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    """The registered names, installed packages' entry points included, sorted."""
    load_entry_points()
    return tuple(sorted(_REGISTRY))


def policy_classes() -> dict[str, type[MemoryPolicy]]:
    """Every registered policy class by name (entry points included)."""
    load_entry_points()
    return dict(sorted(_REGISTRY.items()))


@functools.cache
def load_entry_points() -> None:
    """Register the policies installed packages name in :data:`ENTRY_POINT_GROUP` (once).

    Raises:
        PolicyError: an entry point that does not load, is not a MemoryPolicy subclass,
            or whose name is not its class's ``name``.
    """
    for point in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name!r} ({point.value})"
        try:
            cls = point.load()
        except Exception as exc:
            raise PolicyError(
                f"{where} of group {ENTRY_POINT_GROUP} does not load: {exc!r}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, MemoryPolicy)):
            raise PolicyError(f"{where} is {cls!r}, not a MemoryPolicy subclass")
        if cls.name != point.name:
            raise PolicyError(f"{where} names class {cls.__qualname__}, whose name is {cls.name!r}")
        register_policy(cls)


def check_policy(value: object, what: str) -> MemoryPolicy:
    """``value``, once it is a memory policy (a config may hand us anything).

    Raises:
        PolicyError: it is not, naming ``what`` and the value.
    """
    if not isinstance(value, MemoryPolicy):
        raise PolicyError(
            f"{what} is {value!r}, not a MemoryPolicy; build one with "
            "hybridkv.policies.make_policy or subclass MemoryPolicy"
        )
    return value


def make_policy(name: str, **params: Any) -> MemoryPolicy:
    """Build a policy from its registered name and parameters.

    Raises:
        PolicyError: unknown name, or parameters the policy does not take or rejects.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        load_entry_points()
        cls = _REGISTRY.get(name)
    if cls is None:
        raise PolicyError(f"unknown memory policy {name!r}; known: {', '.join(policy_names())}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise PolicyError(f"bad parameters for policy {name!r}: {exc}") from None


for _cls in (FullAttention, SlidingWindow, ChunkedLocal, CompressedEntries, MambaLike):
    register_policy(_cls)
