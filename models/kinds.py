"""Layer kinds: the names a layer's attention or state goes by, and how a family reads
each layer's kind from its config (torch-free).

=====================  =========================================================
``full_attention``     every earlier position
``sliding_attention``  a window of ``sliding_window`` positions
``chunked_attention``  the positions of its chunk (``attention_chunk_size``)
``mamba``              a Mamba2 state instead of K/V
``mamba1``             a Mamba1 state (Jamba's ``mamba`` layers)
``deltanet``           a Gated DeltaNet state (Qwen3-Next's ``linear_attention``)
``short_conv``         a short convolution's state (LFM2's ``conv``)
``lightning``          a lightning attention memory (MiniMax's ``linear_attention``)
``mlp``                nothing: an MLP in place of a mixer (Nemotron-H's ``-``)
``moe``                nothing: experts in place of a mixer (Nemotron-H's ``E``)
``hybrid``             full attention and a Mamba2 state side by side (Falcon-H1)
=====================  =========================================================

A config's ``layer_types`` names them where it has it; a family's own pattern otherwise
(``kinds_by``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybridkv.models.errors import ModelConfigError
from hybridkv.policies import MemoryPolicy

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
MAMBA = "mamba"
DELTANET = "deltanet"
SHORT_CONV = "short_conv"
MAMBA1 = "mamba1"
MLP = "mlp"
MOE = "moe"
LIGHTNING = "lightning"
HYBRID = "hybrid"

#: The kinds that keep a fixed-size state per request instead of K/V, and the name of
#: their mixer in a checkpoint's layer (``model.layers.{i}.<name>``).
STATE_KINDS = {MAMBA: "mamba", DELTANET: "linear_attn", SHORT_CONV: "conv", MAMBA1: "mamba"}
STATE_KINDS[LIGHTNING] = "self_attn"

#: The kinds whose layers run two mixers side by side, and the kinds of the two: the
#: attention's, and the state's beside it (``AttentionSpec.beside``).
SIDE_BY_SIDE = {HYBRID: (FULL, MAMBA)}

#: The kinds that keep nothing per request (``NoCacheSpec``).
NO_CACHE_KINDS = (MLP, MOE)

#: ``layer_types`` entries we can size.
LAYER_TYPES = (FULL, SLIDING, CHUNKED)

#: A memory policy per layer kind, chosen in place of the one the config implies.
PolicyChoices = Mapping[str, MemoryPolicy]


def pattern_layer_types(num_layers: int, every: int) -> tuple[str, ...]:
    """Layer types for configs without ``layer_types``: every ``every``-th layer is full."""
    return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers))


def layer_types_kinds(
    cfg: Mapping[str, Any], num_layers: int, names: Mapping[str, str] | None = None
) -> list[str]:
    """Each layer's kind from ``layer_types``, its names mapped by ``names`` (by default
    the attention kinds under their own names)."""
    kinds = names if names is not None else {k: k for k in LAYER_TYPES}
    return named_kinds([str(k) for k in cfg["layer_types"]], num_layers, kinds)


def window_everywhere(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Every layer sliding (``sliding_window``) where the config sets a window, else every
    layer full (Mistral's, Phi-3's)."""
    return [SLIDING if cfg.get("sliding_window") else FULL] * num_layers


def kinds_by(
    pattern: Callable[[Mapping[str, Any], int], list[str]],
    names: Mapping[str, str] | None = None,
) -> Callable[[Mapping[str, Any], int], list[str]]:
    """A family's layer kinds: from ``layer_types`` (its names mapped by ``names``) where
    the config has them, else ``pattern(config, num_layers)``."""

    def kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
        if cfg.get("layer_types") is not None:
            return layer_types_kinds(cfg, num_layers, names)
        return pattern(cfg, num_layers)

    return kinds


def named_kinds(names: list[str], num_layers: int, kinds: Mapping[str, str]) -> list[str]:
    """Each layer's kind from its ``layer_types`` name, once the count and names check."""
    if len(names) != num_layers:
        raise ModelConfigError(
            f"layer_types has {len(names)} entries, num_hidden_layers is {num_layers}"
        )
    for i, name in enumerate(names):
        if name not in kinds:
            raise ModelConfigError(
                f"layer {i} has layer type {name!r}; supported: {', '.join(kinds)}"
            )
    return [kinds[name] for name in names]


def shared_tail(kinds: Sequence[str], count: int) -> dict[int, int]:
    """The last ``count`` layers each reading the cache of the last earlier layer of its
    kind outside them (Gemma 4's ``num_kv_shared_layers``): reader -> owner.

    Raises:
        ModelConfigError: ``count`` not from 0 to the layers, or a reader with no earlier
            layer of its kind.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(kinds):
        raise ModelConfigError(f"{count!r} shared layers of {len(kinds)}: not a layer count")
    first = len(kinds) - count
    owners: dict[int, int] = {}
    for reader in range(first, len(kinds)):
        earlier = [i for i in range(first) if kinds[i] == kinds[reader]]
        if not earlier:
            raise ModelConfigError(
                f"{count} shared layers: layer {reader} ({kinds[reader]}) has no earlier "
                "layer of its kind whose cache it could read"
            )
        owners[reader] = earlier[-1]
    return owners
