"""vLLM's Prometheus series, under vLLM's names and labels, beside hybridkv's own.

A dashboard or alert written for ``vllm serve`` (``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, the latency histograms, ...) reads a hybridkv server
unchanged; every series carries ``model_name``, as vLLM's do. What vLLM has no word for
(pages per group and policy, state pages, the offload tiers) stays under ``hybridkv_*``.
``docs/grafana/hybridkv-vllm.json`` is a dashboard over these series, and a test checks
that each of its queries names one the server exports.

What each means here, where it differs from vLLM:

- ``vllm:kv_cache_usage_perc``: pages held over the pool's usable pages (cached free
  pages count as free, as vLLM counts them), all groups together;
- ``vllm:prefix_cache_queries`` / ``_hits``: prompt tokens looked up at a request's
  first admission, and those served from the prefix cache (vLLM counts tokens too);
- ``vllm:request_queue_time_seconds``: arrival to first admission;
- ``vllm:inter_token_latency_seconds``: between the outputs of one request, per token;
- ``vllm:spec_decode_*`` (with ``--speculative-config``): proposals verified, tokens
  proposed and accepted, and accepted per position (its rate over drafts is the
  acceptance rate at that position).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridkv.scheduler.outputs import EngineStats, RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
#: hybridkv's finish reasons under vLLM's ``finished_reason`` values.
_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class _EngineSeries(Collector):
    """The engine's state under vLLM's names, read on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        labels, names = self._labels, ["model_name"]
        series: list[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, float]] = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests running", s.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting", s.num_waiting),
            (
                GaugeMetricFamily,
                "vllm:kv_cache_usage_perc",
                "Fraction of the KV pool's pages held by requests (1 is full)",
                s.kv_usage,
            ),
            (
                CounterMetricFamily,
                "vllm:num_preemptions",
                "Preemptions since start",
                s.num_preemptions,
            ),
        ]
        spec = s.spec_decode
        if spec is not None:
            series += [
                (
                    CounterMetricFamily,
                    "vllm:spec_decode_num_drafts",
                    "Proposals verified",
                    spec.num_drafts,
                ),
                (
                    CounterMetricFamily,
                    "vllm:spec_decode_num_draft_tokens",
                    "Tokens proposed",
                    spec.num_draft_tokens,
                ),
                (
                    CounterMetricFamily,
                    "vllm:spec_decode_num_accepted_tokens",
                    "Proposed tokens accepted",
                    spec.num_accepted_tokens,
                ),
            ]
        for kind, name, text, value in series:
            family = kind(name, text, labels=names)
            family.add_metric(labels, value)
            yield family
        if spec is None:
            return
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted at each position of a proposal (0 first)",
            labels=[*names, "position"],
        )
        for position, value in enumerate(spec.accepted_per_position):
            per_position.add_metric([*labels, str(position)], value)
        yield per_position


class VllmMetrics:
    """The per-request series of vLLM, updated by the service as outputs arrive.

    Args:
        registry: The app's registry.
        stats: The engine's stats (read at scrape time).
        model_name: The ``model_name`` label.
    """

    def __init__(
        self, registry: CollectorRegistry, stats: Callable[[], EngineStats], model_name: str
    ) -> None:
        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(name, text, ["model_name", *labels], registry=registry)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, ["model_name"], buckets=buckets, registry=registry)

        self._model = model_name
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of ended requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache"
        )
        self.success = counter(
            "vllm:request_success", "Requests ended, by finish reason", "finished_reason"
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Between two tokens of a request", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to the last token", _LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Arrival to first admission", _LATENCY_BUCKETS
        )
        self.prompt_len = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS
        )
        self.output_len = histogram(
            "vllm:request_generation_tokens", "Tokens generated per request", _TOKEN_BUCKETS
        )
        registry.register(_EngineSeries(stats, model_name))

    def tokens(self, out: RequestOutput, since_arrival: float, since_last: float | None) -> None:
        """An output of a request: its tokens, the first one's latency or the gaps."""
        num = len(out.new_token_ids)
        if not num:
            return
        model = self._model
        self.generation_tokens.labels(model).inc(num)
        if since_last is None:
            self.ttft.labels(model).observe(since_arrival)
        else:
            gap = since_last / num
            for _ in range(num):
                self.itl.labels(model).observe(gap)

    def ended(self, last: RequestOutput, reason: str, since_arrival: float) -> None:
        """A request ended (``reason``: its finish reason, or ``abort``)."""
        model = self._model
        self.success.labels(model, _REASONS.get(reason, reason)).inc()
        self.e2e.labels(model).observe(since_arrival)
        self.prompt_tokens.labels(model).inc(last.num_prompt_tokens)
        self.prefix_queries.labels(model).inc(last.num_prompt_tokens)
        self.prefix_hits.labels(model).inc(last.num_cached_tokens)
        self.prompt_len.labels(model).observe(last.num_prompt_tokens)
        self.output_len.labels(model).observe(last.num_output_tokens)
        if last.queue_time_s is not None:
            self.queue.labels(model).observe(last.queue_time_s)
