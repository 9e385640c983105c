"""The Responses API's store is bounded by bytes as well as by count, oldest first."""

from __future__ import annotations

import pytest

from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.responses_api import ResponseStore


def _conversation(size: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "x" * size}]


def test_the_oldest_responses_leave_once_the_bytes_are_spent() -> None:
    """Past its byte budget the store evicts the least recently used conversations
    until it fits, and a request naming one is told it was evicted."""
    store = ResponseStore(max_stored=1024, max_bytes=10_000)
    for i in range(5):
        store.put(f"resp_{i}", _conversation(3_000))
    assert store.num_bytes <= 10_000
    store.get("resp_4")
    with pytest.raises(APIError, match=r"'resp_0' was evicted: .* within 10000 bytes") as info:
        store.get("resp_0")
    assert info.value.status == 404
    with pytest.raises(APIError, match="'resp_never' is not stored"):
        store.get("resp_never")


def test_one_conversation_larger_than_the_budget_is_not_kept() -> None:
    """A conversation over the whole budget is evicted at once, and the rest stay."""
    store = ResponseStore(max_bytes=10_000)
    store.put("resp_small", _conversation(100))
    store.put("resp_huge", _conversation(20_000))
    assert store.get("resp_small")
    with pytest.raises(APIError, match="was evicted"):
        store.get("resp_huge")
