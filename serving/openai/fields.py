"""A JSON request body read field by field, each value checked, unknown fields listed.

Every reader names its field in the 400 it raises. A body is read through one
:class:`Fields`, which remembers what was read; :meth:`Fields.check_all_read` then deals
with any field nobody read. As vLLM does, by default such a field is ignored and named
(``ignored``: the app logs one warning per request listing them), since clients send
fields a server may not know (guidellm's ``stream_options.continuous_usage_stats``,
OpenAI's ``service_tier``); strict, as OpenAI's API is, it is refused ("unrecognized
request argument"). A field this server knows and does not implement, where a value
would change the output, is refused either way (:meth:`Fields.refuse`)::

    fields = Fields(body, ignored=[])
    temperature = fields.number("temperature", 1.0, low=0.0, high=2.0)
    fields.refuse("suffix", allowed=(None, ""))    # known, not implemented: 400
    fields.check_all_read()                         # {"temprature": 1}: listed, ignored
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridkv.serving.openai.errors import APIError


class Fields:
    """A request body whose fields are read, checked and accounted for.

    Args:
        body: The decoded JSON object.
        where: How the body is named in messages (a nested object's field name).
        ignored: Where unknown fields are listed (shared by the nested objects); None:
            refuse them (strict).
    """

    def __init__(
        self, body: Mapping[str, Any], where: str = "", *, ignored: list[str] | None = None
    ) -> None:
        self._body = body
        self._where = where
        self._read: set[str] = set()
        self.ignored = ignored

    def inner(self, body: Mapping[str, Any], where: str) -> Fields:
        """Another object of the same request (a list's entry), with the same rule."""
        return Fields(body, where, ignored=self.ignored)

    def name(self, field: str) -> str:
        """The field's name as errors report it (``stream_options.include_usage``)."""
        return f"{self._where}.{field}" if self._where else field

    def raw(self, field: str) -> Any:
        """The value as sent (None when absent), marked as read."""
        self._read.add(field)
        return self._body.get(field)

    def everything(self) -> dict[str, Any]:
        """Every field as sent, all marked as read (a free-form object)."""
        self._read.update(self._body)
        return dict(self._body)

    def has(self, field: str) -> bool:
        """Whether the body sets ``field`` to something other than null."""
        return self._body.get(field) is not None

    def optional_integer(
        self, field: str, *, low: int | None = None, high: int | None = None
    ) -> int | None:
        """An integer in ``[low, high]``, or None when absent."""
        value = self.raw(field)
        if value is None:
            return None
        if type(value) is not int:
            raise self.error(field, f"must be an integer, got {_show(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise self.error(field, f"must be in [{_bound(low)}, {_bound(high)}], got {value}")
        return value

    def integer(
        self, field: str, default: int, *, low: int | None = None, high: int | None = None
    ) -> int:
        """An integer in ``[low, high]``, ``default`` when absent."""
        value = self.optional_integer(field, low=low, high=high)
        return default if value is None else value

    def number(
        self, field: str, default: float, *, low: float, high: float, open_low: bool = False
    ) -> float:
        """A finite number in ``[low, high]`` (``(low, high]`` with ``open_low``)."""
        value = self.raw(field)
        if value is None:
            return default
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self.error(field, f"must be a finite number, got {_show(value)}")
        if value < low or value > high or (open_low and value == low):
            bracket = "(" if open_low else "["
            raise self.error(field, f"must be in {bracket}{low}, {high}], got {value}")
        return float(value)

    def boolean(self, field: str, default: bool) -> bool:
        """``true`` or ``false``, ``default`` when absent."""
        value = self.raw(field)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, f"must be true or false, got {_show(value)}")
        return value

    def string(self, field: str) -> str | None:
        """A string, or None when absent."""
        value = self.raw(field)
        if value is not None and not isinstance(value, str):
            raise self.error(field, f"must be a string, got {_show(value)}")
        return value

    def token_ids(self, field: str) -> tuple[int, ...]:
        """A list of non-negative integers (empty when absent)."""
        value = self.raw(field)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
            raise self.error(field, "must be a list of token ids (integers >= 0)")
        return tuple(value)

    def nested(self, field: str) -> Fields | None:
        """A nested JSON object as its own :class:`Fields`, or None when absent."""
        value = self.raw(field)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(field, f"must be an object, got {_show(value)}")
        return self.inner(value, self.name(field))

    def refuse(self, field: str, *, allowed: tuple[object, ...] = (None,), why: str = "") -> None:
        """Refuse a known field this server does not implement, unless its value is one
        of ``allowed`` (values that ask for nothing)."""
        value = self.raw(field)
        if value is not None and value not in allowed:
            reason = f": {why}" if why else ""
            raise self.error(field, f"is not supported by this server{reason}")

    def check_all_read(self) -> None:
        """List the fields nobody read (unknown to this server) in ``ignored``, or, strict,
        refuse the body."""
        unknown = sorted(set(self._body) - self._read)
        if unknown and self.ignored is not None:
            self.ignored.extend(self.name(f) for f in unknown)
        elif unknown:
            names = ", ".join(repr(self.name(f)) for f in unknown)
            raise APIError(
                f"unrecognized request argument(s): {names}",
                param=self.name(unknown[0]),
                code="unrecognized_argument",
            )

    def error(self, field: str, problem: str) -> APIError:
        """A 400 naming ``field``: ``'<field>' <problem>``."""
        name = self.name(field)
        return APIError(f"'{name}' {problem}", param=name)


def _bound(value: int | None) -> str:
    return "..." if value is None else str(value)


def _show(value: object) -> str:
    # Values come from a client: keep messages short.
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
