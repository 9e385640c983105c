"""Prometheus metrics of one server: request counters, and the engine's state at scrape time.

Each app gets its own ``CollectorRegistry`` (never the process-global one), so two apps
in one process, as in tests, count separately. Counters the server owns are updated as
requests go; the engine's queues and pages are read from ``engine.stats()`` when
``/metrics`` is scraped, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridkv.scheduler.outputs import EngineStats
from hybridkv.serving.metrics.vllm_series import VllmMetrics

if TYPE_CHECKING:
    from hybridkv.memory.offload import OffloadStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    """Reads the engine's stats on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats], group_policies: Sequence[str]) -> None:
        self._stats = stats
        self._policies = tuple(group_policies)

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("hybridkv_requests_waiting", "Requests waiting", s.num_waiting)
        yield GaugeMetricFamily("hybridkv_requests_running", "Requests running", s.num_running)
        yield GaugeMetricFamily(
            "hybridkv_requests_preempted",
            "Waiting requests that were preempted",
            s.num_preempted,
        )
        yield CounterMetricFamily(
            "hybridkv_preemptions", "Preemptions since start", s.num_preemptions
        )
        yield CounterMetricFamily("hybridkv_engine_steps", "Engine steps run", s.num_steps)
        pages = GaugeMetricFamily(
            "hybridkv_kv_blocks_used", "KV pages held per group", labels=["group", "policy"]
        )
        for group, used in enumerate(s.blocks_used_per_group):
            policy = self._policies[group] if group < len(self._policies) else ""
            pages.add_metric([str(group), policy], used)
        yield pages
        yield GaugeMetricFamily("hybridkv_kv_blocks_free", "Free KV pages", s.num_free_blocks)
        yield GaugeMetricFamily(
            "hybridkv_kv_pages_used", "Pages the K/V groups hold", s.num_kv_pages_used
        )
        yield GaugeMetricFamily(
            "hybridkv_state_pages_used",
            "Pages the state groups hold (a span of page ids each where a state needs it)",
            s.num_state_pages_used,
        )
        yield GaugeMetricFamily(
            "hybridkv_state_pages_free",
            "State pages an allocation could take now (0 where a state page is one page id)",
            s.num_free_state_pages,
        )
        yield GaugeMetricFamily(
            "hybridkv_kv_blocks_total", "KV pages in the pool (null page included)", s.num_blocks
        )
        yield GaugeMetricFamily(
            "hybridkv_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache over those looked up",
            s.prefix_hit_rate,
        )
        yield GaugeMetricFamily(
            "hybridkv_tokens_per_second", "Tokens run per second, recent steps", s.tokens_per_second
        )


class ServerMetrics:
    """The metrics of one app, in their own registry."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        group_policies: Sequence[str] = (),
        model_name: str = "",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        #: vLLM's series (``hybridkv.serving.metrics.vllm_series``), labelled ``model_name``.
        self.vllm = VllmMetrics(self.registry, stats, model_name)
        self.requests = Counter(
            "hybridkv_http_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "hybridkv_prompt_tokens", "Prompt tokens of admitted requests", registry=self.registry
        )
        self.cached_prompt_tokens = Counter(
            "hybridkv_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "hybridkv_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.finished = Counter(
            "hybridkv_requests_finished",
            "Generation requests ended, by finish reason",
            ["reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "hybridkv_time_to_first_token_seconds",
            "Seconds from arrival to the first generated token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats, group_policies))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


#: Endpoint labels by path; ``/v1/models/{id}`` counts as ``models``, others as ``other``.
ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/models": "models",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/health": "health",
    "/metrics": "metrics",
    "/version": "version",
}


class RequestCounter:
    """ASGI middleware counting every response by endpoint and status, whoever sent it
    (a route, a refusal of the access guard, an error handler); 500 for an app that
    raised before responding."""

    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        endpoint = ENDPOINTS.get(path) or ("models" if path.startswith("/v1/models/") else "other")
        status: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            code = str(status[0]) if status else "500"
            self.metrics.requests.labels(endpoint=endpoint, status=code).inc()


class OffloadCollector(Collector):
    """The connector's counters, read on every scrape."""

    def __init__(self, stats: OffloadStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        hits = CounterMetricFamily(
            "hybridkv_kv_offload_hit_tokens",
            "Prompt tokens loaded from an offload tier instead of computed",
            labels=["tier"],
        )
        for tier, num in sorted(s.hit_tokens.items()):
            hits.add_metric([tier], num)
        yield hits
        for name, text, value in (
            ("loaded_bytes", "Bytes of KV pages loaded from offload tiers", s.num_loaded_bytes),
            ("saved_bytes", "Bytes of KV pages saved to offload tiers", s.num_saved_bytes),
            ("loaded_blocks", "KV pages (group, block) loaded", s.num_loaded_blocks),
            ("saved_blocks", "KV pages (group, block) saved", s.num_saved_blocks),
            ("failed_loads", "KV page loads that failed and were recomputed", s.num_failed_blocks),
            ("dropped_saves", "KV page saves dropped (queue full, tier down)", s.num_dropped_saves),
        ):
            yield CounterMetricFamily(f"hybridkv_kv_offload_{name}", text, value)
