"""``--kv-events-config`` for ``hybridkv serve``: vLLM's flag, its JSON and its keys.

::

    --kv-events-config '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}'

The engine then publishes every block its prefix cache (and its offload tiers) stores
and drops over ZMQ, as vLLM does; see ``hybridkv.parallel.kv_events``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.parallel.kv_events import KVEventPublisher
    from hybridkv.parallel.kv_events_config import KVEventsConfig


def add_kv_events_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--kv-events-config``."""
    parser.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV cache events over ZMQ as vLLM does: a JSON object of vLLM's keys "
        "(enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm, "
        "max_queue_size, topic)",
    )


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    """The flag's config, checked (None without the flag, or when it does not publish).

    Raises:
        UsageError: bad JSON, an unknown key or value, or prefix caching off.
    """
    text = getattr(args, "kv_events_config", None)
    if text is None:
        return None
    from hybridkv.parallel.kv_events_config import KVEventsConfig, KVEventsConfigError
    from hybridkv.serving.cli.flags.values import UsageError

    try:
        config = KVEventsConfig.from_json(text)
    except KVEventsConfigError as exc:
        raise UsageError(f"--kv-events-config: {exc}") from exc
    if not config.is_publishing:
        return None
    if not getattr(args, "enable_prefix_caching", True):
        raise UsageError(
            "--kv-events-config describes the prefix cache, which --no-prefix-caching turns "
            "off: drop one of them"
        )
    return config


@contextlib.contextmanager
def kv_event_publisher(
    config: KVEventsConfig | None, *, data_parallel_rank: int = 0
) -> Iterator[KVEventPublisher | None]:
    """The publisher of ``config`` while the engine runs (None: no events), writing
    ``data_parallel_rank`` into its batches."""
    if config is None:
        yield None
        return
    from hybridkv.parallel.kv_events import KVEventPublisher
    from hybridkv.parallel.kv_events_config import KVEventsConfigError
    from hybridkv.serving.cli.flags.values import UsageError

    try:
        publisher = KVEventPublisher(config, data_parallel_rank=data_parallel_rank)
    except KVEventsConfigError as exc:
        raise UsageError(f"--kv-events-config: {exc}") from exc
    with publisher:
        yield publisher
