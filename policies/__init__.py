"""Memory policies: which earlier tokens each kind of layer must keep resident."""

from hybridkv.errors import CapacityError, HybridKVError
from hybridkv.policies.base import AttentionWindow, MemoryPolicy, Span, cdiv
from hybridkv.policies.builtin import (
    ChunkedLocal,
    CompressedEntries,
    FullAttention,
    MambaLike,
    SlidingWindow,
)
from hybridkv.policies.errors import PolicyError
from hybridkv.policies.laws import PolicyLawError, check_policy_laws
from hybridkv.policies.registry import (
    ENTRY_POINT_GROUP,
    check_policy,
    make_policy,
    policy_classes,
    policy_names,
    register_policy,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "AttentionWindow",
    "CapacityError",
    "ChunkedLocal",
    "CompressedEntries",
    "FullAttention",
    "HybridKVError",
    "MambaLike",
    "MemoryPolicy",
    "PolicyError",
    "PolicyLawError",
    "SlidingWindow",
    "Span",
    "cdiv",
    "check_policy",
    "check_policy_laws",
    "make_policy",
    "policy_classes",
    "policy_names",
    "register_policy",
]
