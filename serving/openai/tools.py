"""Tool calling on chat completions, as vLLM does it.

A request's ``tools`` reach the chat template (``tools`` beside ``messages``, as Hugging
Face templates read them); what the model writes becomes ``message.tool_calls``::

    tool_choice   how the call is made                      finish_reason
    none          no call: the text is the content          stop / length
    auto          the model may write one; the server's     tool_calls if one parsed
                  --tool-call-parser finds it (needs
                  --enable-auto-tool-choice)
    required      JSON constrained by the grammar: a list   tool_calls
                  of {"name", "parameters"}, one at least
                  (one only with parallel_tool_calls false)
    {function}    JSON constrained to that function's       tool_calls
                  parameters: always parses

Constrained calls are compact JSON (no whitespace between tokens: none is needed to
parse them). Parsers for ``auto``: ``hermes`` (Hermes and Qwen: each call is ``<tool_call>{"name":
..., "arguments": ...}</tool_call>``, text before the first is the content) and
``json`` (the whole output is one such object, or a list of them). Streamed, the
content goes out as it comes, up to where a call may begin; the calls go in the last
chunk, each whole, as ``delta.tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.scheduler.params import StructuredOutput
from hybridkv.serving.openai.fields import Fields

PARSERS = ("hermes", "json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FIRST = re.compile(r"\s*(\S)")


@attrs.frozen
class ToolSpec:
    """A request's tools and how one is chosen.

    Attributes:
        tools: The tools as sent (``{"type": "function", "function": {...}}``).
        choice: ``none``, ``auto``, ``required`` or ``named``.
        name: The function ``named`` calls.
        parser: The server's parser of ``auto`` calls.
        parallel: ``parallel_tool_calls``: more than one call (``required``: at most one
            when false).
    """

    tools: tuple[Mapping[str, Any], ...]
    choice: str
    name: str | None = None
    parser: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutput | None:
        """The grammar that makes a ``required`` or named call always parse."""
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.choice == "named":
            assert self.name is not None
            arguments = _parameters(functions[self.name])
            return StructuredOutput("json_schema", json.dumps(arguments), any_whitespace=False)
        if self.choice == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": _parameters(f)},
                    "required": ["name", "parameters"],
                }
                for name, f in functions.items()
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput("json_schema", json.dumps(schema), any_whitespace=False)
        return None

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The content and the tool calls in a choice's whole text."""
        if self.choice == "none":
            return text, []
        if self.choice in ("named", "required"):
            try:
                value = json.loads(text)
            except ValueError:  # cut short by max_tokens (finish_reason says so)
                return text, []
            if self.choice == "named":
                assert self.name is not None
                return None, [call(self.name, value)]
            return None, [call(i["name"], i.get("parameters", {})) for i in value]
        if self.parser == "hermes":
            return _hermes(text)
        return _json(text)

    def held(self, pending: str, *, started: bool) -> int:
        """How much of a streamed choice's text not yet sent (``pending``; ``started``:
        some content was sent before it) is content safe to send now: all of it unless
        a call may begin there (``auto``), none while one is constrained. Reads only the
        text not yet sent, never the whole text again."""
        if self.choice == "none":
            return len(pending)
        if self.choice in ("named", "required"):
            return 0
        if self.parser == "json":  # a call is the whole output: decided by its first character
            if started:
                return len(pending)
            first = _FIRST.match(pending)
            return 0 if first is None or first.group(1) in "{[" else len(pending)
        if pending.startswith(_OPEN):
            return 0  # a call began: the rest waits for the end
        start = pending.find(_OPEN)
        if start >= 0:
            return start
        for keep in range(min(len(_OPEN) - 1, len(pending)), 0, -1):  # a marker's beginning
            if _OPEN.startswith(pending[-keep:]):
                return len(pending) - keep
        return len(pending)


def call(name: str, arguments: object) -> dict[str, Any]:
    """One entry of ``tool_calls``: arguments as a JSON string, as OpenAI sends them."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def parse_tools(fields: Fields, *, parser: str | None, auto: bool) -> ToolSpec | None:
    """The request's ``tools`` and ``tool_choice`` (``parser``, ``auto``: the server's
    ``--tool-call-parser`` and ``--enable-auto-tool-choice``).

    Raises:
        APIError: malformed tools, a choice naming no tool, or ``auto`` on a server that
            does not parse calls.
    """
    for field in ("functions", "function_call"):
        fields.refuse(field, allowed=(None, [], "none", "auto"), why="send 'tools'")
    tools = fields.raw("tools")
    choice = fields.raw("tool_choice")
    parallel = fields.boolean("parallel_tool_calls", True)
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise fields.error("tool_choice", "needs 'tools'")
        return None
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise fields.error(
            "tools", 'must be a list of {"type": "function", "function": {"name": ...}}'
        )
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        choice = "auto" if auto else "none"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or name not in names:
            raise fields.error("tool_choice", f"must name one of the tools {names}")
        return ToolSpec(tuple(tools), "named", name, parallel=parallel)
    if choice not in ("none", "auto", "required"):
        raise fields.error("tool_choice", "must be none, auto, required or a named function")
    if choice == "auto" and not (auto and parser):
        raise fields.error(
            "tool_choice",
            "'auto' needs the server started with --enable-auto-tool-choice and --tool-call-parser",
        )
    return ToolSpec(tuple(tools), choice, parser=parser, parallel=parallel)


def _is_tool(tool: object) -> bool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return False
    function = tool.get("function")
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and bool(function["name"])
        and isinstance(function.get("parameters", {}), dict)
    )


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    return dict(function.get("parameters") or {"type": "object", "properties": {}})


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    start = text.find(_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in text[start:].split(_OPEN)[1:]:
        body = block.split(_CLOSE)[0].strip()
        try:
            value = json.loads(body)
        except ValueError:
            return text, []  # not a call after all: the whole text is the content
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return text, []
        calls.append(call(value["name"], value.get("arguments", value.get("parameters", {}))))
    content = text[:start]  # as streamed: what came before the first call
    return content if content.strip() else None, calls


def _json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return text, []
    return None, [call(i["name"], i.get("arguments", i.get("parameters", {}))) for i in items]
