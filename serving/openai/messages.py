"""The ``messages`` of a chat body: role, content (text), name, and the tool turns.

An assistant turn may carry the ``tool_calls`` it made (their arguments decoded from
their JSON strings, as chat templates read them) and a ``tool`` turn the
``tool_call_id`` it answers; both reach the chat template as sent.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.fields import Fields


def parse_messages(fields: Fields) -> tuple[Mapping[str, Any], ...]:
    """The ``messages`` of a chat body: role, content (text), optional name."""
    messages = fields.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise fields.error("messages", "must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(f"'{where}' must be an object with a 'role'", param="messages")
        entry = fields.inner(message, where)
        role = entry.string("role")
        if not role:
            raise APIError(f"'{where}.role' must be a non-empty string", param="messages")
        calls = entry.raw("tool_calls")
        content = entry.raw("content")
        item: dict[str, Any] = {
            "role": role,
            "content": "" if content is None and calls else _content(content, where),
        }
        name = entry.string("name")
        if name is not None:
            item["name"] = name
        if calls:  # an assistant turn that called tools: its template renders them
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise APIError(f"'{where}.tool_calls' must be a list of calls", param="messages")
            item["tool_calls"] = [_call_for_template(c) for c in calls]
        call_id = entry.string("tool_call_id")
        if call_id is not None:
            item["tool_call_id"] = call_id
        for field in ("function_call", "audio"):
            entry.refuse(field, allowed=(None, []), why="send tool_calls")
        entry.check_all_read()
        out.append(item)
    return tuple(out)


def _call_for_template(call: Mapping[str, Any]) -> dict[str, Any]:
    """A call as templates read it: the arguments decoded from their JSON string."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else left as the string sent
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    # The list form: text parts only.
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(f"'{where}.content' must be a string or a list of text parts", param="messages")
