"""Request bodies: strict JSON decoding, as a 400 for every way a body can be wrong."""

from __future__ import annotations

import pytest

from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.json_text import MAX_DEPTH, parse_json


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"temperature": NaN}', "NaN is not a JSON number"),
        (b'{"temperature": Infinity}', "Infinity is not a JSON number"),
        (b'{"temperature": -Infinity}', "Infinity is not a JSON number"),
        (b'{"top_p": 1e999}', "out of range"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "5000 digits is too long"),
        (b'{"prompt": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"messages": [{"content": "a\\udfffb"}]}', "lone UTF-16 surrogate"),
        (b'{"\\ud800": 1}', "lone UTF-16 surrogate"),
        (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeper than"),
        (b"[1]", "must be a JSON object"),
        (b'{"a": ', "not valid JSON"),
    ],
)
def test_bad_bodies_are_bad_requests(raw: bytes, match: str) -> None:
    """Each malformed body is an APIError (a 400), never another exception."""
    with pytest.raises(APIError, match=match) as info:
        parse_json(raw)
    assert info.value.status == 400


def test_nesting_at_the_limit_is_accepted() -> None:
    """A body nested exactly MAX_DEPTH deep parses."""
    raw = b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert "a" in parse_json(raw)


def test_ordinary_values_pass() -> None:
    """Unicode text, big but short integers and floats pass unchanged."""
    body = parse_json('{"p": "é 😀 \\u00e9", "seed": 12345678901234567890, "t": 0.5}'.encode())
    assert body == {"p": "é 😀 é", "seed": 12345678901234567890, "t": 0.5}
