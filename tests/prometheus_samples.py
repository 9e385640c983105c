"""Reading a live server's ``/metrics`` in the tests: every sample by name and labels."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(server: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the server's ``/metrics``: (name, sorted labels) -> value."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
