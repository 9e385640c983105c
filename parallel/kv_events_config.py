"""``--kv-events-config``: vLLM's ``KVEventsConfig``, its keys and defaults, checked.

::

    --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
                         "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'

A key vLLM does not have is refused by name, so a typo never silently turns events off.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from hybridkv.errors import HybridKVError


class KVEventsConfigError(HybridKVError):
    """A ``--kv-events-config`` that cannot be served (its message names the key)."""


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KVEventsConfigError(
            f"kv-events-config {attribute.name} must be an int >= 1, got {value!r}"
        )


def _endpoint(_: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is None and attribute.name == "replay_endpoint":
        return
    if not isinstance(value, str) or "://" not in value:
        raise KVEventsConfigError(
            f"kv-events-config {attribute.name} must be a ZMQ endpoint such as "
            f"'tcp://*:5557', got {value!r}"
        )


@attrs.frozen(kw_only=True)
class KVEventsConfig:
    """Where and how an engine publishes its KV cache events (vLLM's fields and defaults).

    Attributes:
        enable_kv_cache_events: Publish at all.
        publisher: ``zmq``, or ``null`` (record nothing); None: ``zmq`` when enabled.
        endpoint: The PUB socket: bound when it has ``*``, ``::``, ``ipc://`` or
            ``inproc://``, else connected (a consumer that binds).
        replay_endpoint: The ROUTER socket a consumer asks for missed batches and, when
            they are no longer buffered, for a snapshot (None: no replay).
        buffer_steps: Batches kept for replay.
        hwm: The PUB socket's high-water mark (messages queued per subscriber).
        max_queue_size: Batches waiting for the publisher thread; beyond it a batch is
            dropped (and counted), never waited for.
        topic: The first frame of every message (a subscriber's filter).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = attrs.field(default="tcp://*:5557", validator=_endpoint)
    replay_endpoint: str | None = attrs.field(default=None, validator=_endpoint)
    buffer_steps: int = attrs.field(default=10_000, validator=_positive)
    hwm: int = attrs.field(default=100_000, validator=_positive)
    max_queue_size: int = attrs.field(default=100_000, validator=_positive)
    topic: str = ""

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise KVEventsConfigError(
                f"kv-events-config enable_kv_cache_events must be true or false, "
                f"got {self.enable_kv_cache_events!r}"
            )
        if self.publisher not in (None, "zmq", "null"):
            raise KVEventsConfigError(
                f"kv-events-config publisher must be 'zmq' or 'null', got {self.publisher!r}"
            )
        if self.publisher == "zmq" and not self.enable_kv_cache_events:
            raise KVEventsConfigError(
                "kv-events-config publisher 'zmq' with enable_kv_cache_events false: "
                "set enable_kv_cache_events to true, or drop the publisher"
            )
        if not isinstance(self.topic, str):
            raise KVEventsConfigError(
                f"kv-events-config topic must be a string, got {self.topic!r}"
            )

    @property
    def is_publishing(self) -> bool:
        """Whether events go out over ZMQ."""
        return self.enable_kv_cache_events and self.publisher != "null"

    def for_data_parallel_rank(self, rank: int) -> KVEventsConfig:
        """The config of data-parallel replica ``rank``, as vLLM derives it: a TCP port
        moved up by the rank (a wildcard port stays), an ``ipc``/``inproc`` name given
        ``_dp<rank>``; rank 0 keeps the endpoints as written."""
        if rank == 0:
            return self
        return attrs.evolve(
            self,
            endpoint=_offset(self.endpoint, rank),
            replay_endpoint=None
            if self.replay_endpoint is None
            else _offset(self.replay_endpoint, rank),
        )

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config``'s JSON object; unknown keys are refused by name."""
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KVEventsConfigError(f"kv-events-config is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise KVEventsConfigError(f"kv-events-config must be a JSON object, got {text!r}")
        known = {field.name for field in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise KVEventsConfigError(
                f"kv-events-config has unknown keys {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**data)


def _offset(endpoint: str, rank: int) -> str:
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{rank}"
    address, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        return endpoint
    return f"{address}:{int(port) + rank}"
