"""The front end's ``/metrics``: its own counters, then every replica's metrics, labelled.

::

    hybridkv_router_requests_total{replica="0",status="200"} 12     the front end's
    hybridkv_router_replica_healthy{replica="1"} 0
    vllm:num_requests_running{engine="0",model_name="m",replica="0"} 2   replica 0's

Each replica's text is scraped when the front end is, parsed, and every sample given a
``replica`` label; vLLM's series (``vllm:*``) get an ``engine`` label of the replica's
name too, as vLLM tells its data-parallel engines apart, so a vLLM dashboard that sums
over ``engine`` sums over the replicas. A replica out of rotation, or one that does not
answer, contributes nothing but its ``hybridkv_router_replica_healthy`` of 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import attrs
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from hybridkv.serving.router.replicas import ReplicaSet


class _ReplicaStates(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "hybridkv_router_replica_healthy",
            "1 while a replica is in rotation",
            labels=["replica"],
        )
        in_flight = GaugeMetricFamily(
            "hybridkv_router_replica_in_flight",
            "Requests forwarded to a replica and not finished",
            labels=["replica"],
        )
        free_tokens = GaugeMetricFamily(
            "hybridkv_router_replica_free_tokens",
            "The longest prompt a replica's free pages held at the last poll of its /load",
            labels=["replica"],
        )
        for replica in self._replicas.replicas.values():
            healthy.add_metric([replica.name], 1.0 if replica.healthy else 0.0)
            in_flight.add_metric([replica.name], replica.in_flight)
            if replica.free_tokens is not None:
                free_tokens.add_metric([replica.name], replica.free_tokens)
        yield healthy
        yield in_flight
        yield free_tokens


class RouterMetrics:
    """The front end's own counters (one registry per app, never the global one)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "hybridkv_router_requests",
            "Requests answered, by the replica that answered and its status",
            ["replica", "status"],
            registry=self.registry,
        )
        self.failed_tries = Counter(
            "hybridkv_router_failed_tries",
            "Forwards that failed before any answer reached the client (then retried)",
            ["replica"],
            registry=self.registry,
        )
        self.unrouted = Counter(
            "hybridkv_router_unrouted",
            "Requests no replica could take (answered 503)",
            registry=self.registry,
        )
        self.registry.register(_ReplicaStates(replicas))

    def render(self, replica_texts: Mapping[str, str]) -> bytes:
        """The exposition text: the front end's families, then the replicas'."""
        merged = _Merged(labelled_families(replica_texts))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(merged)
        return generate_latest(self.registry) + generate_latest(registry)


@attrs.define(eq=False)  # a registry keys its collectors by identity
class _Merged(Collector):
    families: list[Metric]

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def labelled_families(replica_texts: Mapping[str, str]) -> list[Metric]:
    """The families of every replica's exposition ``text``, each sample labelled with its
    replica, samples of a family from all replicas under one family."""
    families: dict[str, Metric] = {}
    for name, text in replica_texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            merged.samples.extend(_relabelled(family.samples, name))
    return list(families.values())


def _relabelled(samples: Iterable[Sample], replica: str) -> Iterator[Sample]:
    for sample in samples:
        labels = dict(sample.labels)
        if sample.name.startswith("vllm:"):
            labels["engine"] = replica
        labels["replica"] = replica
        yield sample._replace(labels=labels)


__all__ = ["RouterMetrics", "labelled_families"]
