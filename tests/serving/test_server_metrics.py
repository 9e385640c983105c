"""/metrics in Prometheus text format: requests, tokens, queues, pages, prefix hits."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "fake-model"


def scrape(server: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


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
