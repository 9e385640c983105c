"""/metrics in Prometheus text format: requests, tokens, queues, pages, prefix hits."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_samples import scrape

MODEL = "fake-model"


def test_requests_and_tokens_are_counted(client: Any, server: Any) -> None:
    """A finished completion counts one 200 request, its prompt and its output tokens."""
    client.completions.create(
        model=MODEL, prompt="w2 w3 w4", max_tokens=5, extra_body={"ignore_eos": True}
    )
    samples = scrape(server)
    requests = ("hybridkv_http_requests_total", (("endpoint", "completions"), ("status", "200")))
    assert samples[requests] == 1
    assert samples[("hybridkv_prompt_tokens_total", ())] == 3
    assert samples[("hybridkv_generation_tokens_total", ())] == 5
    assert samples[("hybridkv_time_to_first_token_seconds_count", ())] == 1


def test_refused_requests_are_counted_by_status(client: Any, server: Any) -> None:
    """A 404 for an unknown model is counted under its status."""
    httpx.post(f"{server.url}/v1/completions", json={"model": "x", "prompt": "w2"}, timeout=10)
    samples = scrape(server)
    assert (
        samples[("hybridkv_http_requests_total", (("endpoint", "completions"), ("status", "404")))]
        == 1
    )


def test_engine_state_is_exported(server: Any) -> None:
    """Queue lengths, pages per group with their policy, hit rate and preemptions are there."""
    samples = scrape(server)
    assert samples[("hybridkv_requests_waiting", ())] == 0
    assert samples[("hybridkv_requests_running", ())] == 0
    assert samples[("hybridkv_preemptions_total", ())] == 0
    assert samples[("hybridkv_kv_blocks_used", (("group", "0"), ("policy", "full")))] == 0
    assert samples[("hybridkv_kv_blocks_used", (("group", "1"), ("policy", "sliding_window")))] == 0
    assert samples[("hybridkv_kv_blocks_total", ())] == 256
    # A pool without state groups: no state pages, none free to take.
    assert samples[("hybridkv_kv_pages_used", ())] == 0
    assert samples[("hybridkv_state_pages_used", ())] == 0
    assert samples[("hybridkv_state_pages_free", ())] == 0
    assert ("hybridkv_prefix_cache_hit_rate", ()) in samples


def test_two_apps_count_separately(make_server: Any) -> None:
    """Each app has its own registry, so one server's requests do not show in another's."""
    first, second = make_server(), make_server()
    httpx.post(f"{first.url}/v1/completions", json={"model": "x", "prompt": "w2"}, timeout=10)
    assert not any(name == "hybridkv_http_requests_total" for name, _ in scrape(second))


def test_vllm_series_count_a_request_under_vllm_names(client: Any, server: Any) -> None:
    """A completion shows in vLLM's series, each labelled with the served model's name."""
    client.completions.create(
        model=MODEL, prompt="w2 w3 w4", max_tokens=5, extra_body={"ignore_eos": True}
    )
    server.wait_until_free()
    samples = scrape(server)
    model = (("model_name", MODEL),)
    assert samples[("vllm:prompt_tokens_total", model)] == 3
    assert samples[("vllm:generation_tokens_total", model)] == 5
    assert samples[("vllm:prefix_cache_queries_total", model)] == 3
    assert samples[("vllm:prefix_cache_hits_total", model)] == 0
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 1
    for histogram, count in (
        ("vllm:time_to_first_token_seconds", 1),
        ("vllm:inter_token_latency_seconds", 4),  # 5 tokens, one step each
        ("vllm:e2e_request_latency_seconds", 1),
        ("vllm:request_queue_time_seconds", 1),
        ("vllm:request_prompt_tokens", 1),
        ("vllm:request_generation_tokens", 1),
    ):
        assert samples[(f"{histogram}_count", model)] == count, histogram
    assert samples[("vllm:num_requests_running", model)] == 0
    assert samples[("vllm:num_requests_waiting", model)] == 0
    assert 0 <= samples[("vllm:kv_cache_usage_perc", model)] <= 1
    assert samples[("vllm:num_preemptions_total", model)] == 0


def test_every_query_of_the_shipped_dashboard_names_an_exported_series(
    client: Any, server: Any
) -> None:
    """docs/grafana/hybridkv-vllm.json: every metric its queries read is on /metrics."""
    import json
    import re
    from pathlib import Path

    client.completions.create(model=MODEL, prompt="w2", max_tokens=2)
    dashboard = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "hybridkv-vllm.json"
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    wanted = {
        name
        for expr in exprs
        for name in re.findall(r"\b(vllm:[a-z0-9_:]+|hybridkv_[a-z0-9_]+)", expr)
    }
    assert len(wanted) >= 15 and len(exprs) >= 20
    exported = {name for name, _ in scrape(server)}
    assert sorted(wanted - exported) == []
