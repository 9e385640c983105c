"""``--kv-offload`` for the model-running commands.

::

    --kv-offload host:4GiB              keep KV blocks in host memory too (LRU, 4 GiB)
    --kv-offload redis://HOST:PORT      and/or in Redis, shared by several engines
    --kv-offload-interval TOKENS        window groups save the blocks a resume needs at
                                        every TOKENS boundary and where requests end (1024)

A request whose prefix the pool has forgotten loads it from the tiers instead of
recomputing it; see ``hybridkv.memory.offload``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.memory.offload import OffloadConfig


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--kv-offload`` (repeatable) and ``--kv-offload-interval``."""
    group = parser.add_argument_group("KV offload")
    group.add_argument(
        "--kv-offload",
        action="append",
        default=[],
        metavar="TIER",
        help="also keep KV blocks of every layer group in a tier: host:SIZE (host memory, "
        "LRU, e.g. host:4GiB) or redis://HOST:PORT; repeat for both (loads read them in "
        "order); a prefix the KV pool forgot is then loaded instead of recomputed",
    )
    group.add_argument(
        "--kv-offload-interval",
        type=int,
        default=1024,
        metavar="TOKENS",
        help="sliding-window groups save only the blocks a resume needs at every TOKENS "
        "boundary and where requests end; a multiple of --block-size (1024)",
    )


def offload_config(args: argparse.Namespace, executor: object) -> OffloadConfig | None:
    """The tiers the flags name, for ``executor`` (None without ``--kv-offload``).

    Over tensor, pipeline or context ranks every rank builds the same tiers for its own
    share of the pages (a host tier's size is per rank; ``parallel/rank_offload.py``).

    Raises:
        UsageError: a bad tier value, an interval that is not a block multiple, or prefix
            caching off.
    """
    texts = getattr(args, "kv_offload", None) or []
    if not texts:
        return None
    from hybridkv.executor.offload_pages import pinned_buffers
    from hybridkv.memory.offload import OffloadConfig, OffloadConfigError, parse_tier
    from hybridkv.serving.cli.flags.values import UsageError

    if not getattr(args, "enable_prefix_caching", True):
        raise UsageError("--kv-offload needs prefix caching (drop --no-prefix-caching)")
    stage0: Any = getattr(executor, "stage0", executor)  # a pipeline's rank 0
    block_size = stage0.plan.block_size
    interval = args.kv_offload_interval
    if interval < 1 or interval % block_size:
        raise UsageError(
            f"--kv-offload-interval {interval} is not a positive multiple of the block size "
            f"{block_size}"
        )
    try:
        specs = [parse_tier(text) for text in texts]
    except OffloadConfigError as exc:
        raise UsageError(str(exc)) from exc
    allocate = pinned_buffers(getattr(stage0, "inner", stage0).device)
    return OffloadConfig.from_specs(specs, allocate=allocate, save_interval=interval)
