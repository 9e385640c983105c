"""Shared fixtures: small request objects the memory layer can read."""

from __future__ import annotations

import attrs
import pytest


@attrs.define
class FakeRequest:
    """The three attributes the KV cache manager reads of a request."""

    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple[object, ...] = ()


@pytest.fixture
def make_request() -> type[FakeRequest]:
    """The FakeRequest class, for tests that build requests."""
    return FakeRequest
