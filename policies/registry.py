"""Policies by name, so configs and layer specs can say ``"sliding_window"``."""

from __future__ import annotations

from typing import Any, TypeVar

from hybridkv.policies.base import MemoryPolicy
from hybridkv.policies.builtin import ChunkedLocal, FullAttention, MambaLike, SlidingWindow
from hybridkv.policies.errors import PolicyError

P = TypeVar("P", bound=type[MemoryPolicy])

_REGISTRY: dict[str, type[MemoryPolicy]] = {}


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
    """The registered names, sorted."""
    return tuple(sorted(_REGISTRY))


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
        raise PolicyError(f"unknown memory policy {name!r}; known: {', '.join(policy_names())}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise PolicyError(f"bad parameters for policy {name!r}: {exc}") from None


for _cls in (FullAttention, SlidingWindow, ChunkedLocal, MambaLike):
    register_policy(_cls)
