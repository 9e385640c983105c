"""``POST /v1/responses``: OpenAI's Responses API, served by translating to a chat request.

A Responses body becomes one chat completion (its ``instructions`` a system message, its
``input`` the messages after the conversation ``previous_response_id`` names), and the
chat answer becomes a Response::

    Responses                       chat completion
    instructions, input             messages (input text, message items, function_call
                                    and function_call_output items as tool turns)
    previous_response_id            the stored conversation it continues (in memory,
                                    the last ``max_stored`` responses; store: false
                                    keeps none)
    max_output_tokens, temperature, max_tokens, temperature, top_p, tools,
    top_p, tools (flat function     tool_choice, parallel_tool_calls,
    tools), tool_choice,            response_format
    parallel_tool_calls, text.format
    output                          a message item (output_text), function_call items

Streamed, the chat chunks become the Responses events (``response.created``,
``response.output_item.added``, ``response.output_text.delta`` ... ``response.completed``).
Fields the server does not know are ignored and named, as on the other endpoints.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.fields import Fields

Emit = Callable[[bytes], Awaitable[None]]


class ResponseStore:
    """The conversations of the last responses, by response id: at most ``max_stored`` of
    them and ``max_bytes`` of their JSON, the least recently used evicted first. An
    evicted id is remembered, so that a request naming it is told why it is gone."""

    def __init__(self, max_stored: int = 1024, max_bytes: int = 256 << 20) -> None:
        self._max = max_stored
        self._max_bytes = max_bytes
        self._conversations: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self.num_bytes = 0

    def get(self, response_id: str) -> list[dict[str, Any]]:
        """The messages up to and including that response's answer.

        Raises:
            APIError: no stored response has that id (404; saying so if it was evicted).
        """
        found = self._conversations.get(response_id)
        if found is None:
            bounds = f"the last {self._max} responses within {self._max_bytes} bytes"
            why = "was evicted" if response_id in self._evicted else "is not stored"
            raise APIError(
                f"the response {response_id!r} {why}: the server keeps {bounds} "
                "(--responses-store-size), the oldest evicted first",
                status=404,
                param="previous_response_id",
                code="response_not_found",
            )
        self._conversations.move_to_end(response_id)
        return list(found)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        """Keep a response's conversation, evicting the oldest beyond the bounds (one
        larger than the whole budget is not kept)."""
        size = len(json.dumps(messages, separators=(",", ":"), default=str))
        if size > self._max_bytes:
            self._forget(response_id)
            return
        self._conversations[response_id] = messages
        self._sizes[response_id] = size
        self.num_bytes += size
        while self._conversations and (
            len(self._conversations) > self._max or self.num_bytes > self._max_bytes
        ):
            evicted, _ = self._conversations.popitem(last=False)
            self.num_bytes -= self._sizes.pop(evicted)
            self._forget(evicted)

    def _forget(self, response_id: str) -> None:
        """Remember that ``response_id`` was evicted (for its 404), a bounded while."""
        self._evicted[response_id] = None
        while len(self._evicted) > _REMEMBERED_EVICTIONS:
            self._evicted.popitem(last=False)


#: Evicted ids remembered for their 404's message.
_REMEMBERED_EVICTIONS = 65_536


def chat_body(body: Mapping[str, Any], store: ResponseStore) -> tuple[dict[str, Any], list[str]]:
    """The chat completion body of a Responses body, and the Responses fields ignored.

    Raises:
        APIError: a malformed field, named; an unknown previous_response_id (404).
    """
    fields = Fields(body, ignored=[])
    messages: list[dict[str, Any]] = []
    previous = fields.string("previous_response_id")
    if previous:
        messages = store.get(previous)
    instructions = fields.string("instructions")
    if instructions:
        messages = [m for m in messages if m.get("role") != "system"]
        messages.insert(0, {"role": "system", "content": instructions})
    messages += _input_messages(fields)
    chat: dict[str, Any] = {"model": fields.string("model"), "messages": messages}
    for source, target in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
        ("stream", "stream"),
        ("top_logprobs", "top_logprobs"),
    ):
        value = fields.raw(source)
        if value is not None:
            chat[target] = value
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    tools = fields.raw("tools")
    if tools:
        chat["tools"] = [_chat_tool(t, fields) for t in _list(tools, fields, "tools")]
    choice = fields.raw("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    text = fields.nested("text")
    if text is not None:
        form = text.raw("format")
        text.raw("verbosity")
        if isinstance(form, dict) and form.get("type") == "json_schema":
            schema = {k: form.get(k) for k in ("name", "schema", "strict") if k in form}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif isinstance(form, dict) and form.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        text.check_all_read()
    for field in ("store", "metadata", "truncation", "reasoning", "include", "service_tier"):
        fields.raw(field)  # accepted: store is read by the route, the rest change nothing
    fields.check_all_read()
    return chat, list(fields.ignored or [])


def _list(value: object, fields: Fields, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise fields.error(name, "must be a list")
    return value


def _chat_tool(tool: object, fields: Fields) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under ``function``)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise fields.error("tools", "only function tools are served")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _input_messages(fields: Fields) -> list[dict[str, Any]]:
    value = fields.raw("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise fields.error("input", "must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"'{where}' must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role", "user"), "content": _text(item, where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        else:
            raise APIError(f"'{where}.type' {kind!r} is not served", param="input")
    return out


def _text(item: Mapping[str, Any], where: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
        for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    raise APIError(f"'{where}.content' must be text or a list of text parts", param="input")


class ResponseBuilder:
    """One Response: its id, the output items as they come, and the final object."""

    def __init__(self, model: str, body: Mapping[str, Any], chat: Mapping[str, Any]) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self._body = body
        self._chat = chat
        self.text = ""
        self.calls: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def output(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.text or not self.calls:
            items.append(self.message_item("completed"))
        for call in self.calls:
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{call['id'].removeprefix('call_')}",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
            )
        return items

    def message_item(self, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": self.text, "annotations": []}]
        if status != "completed":
            content = []
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(self, status: str) -> dict[str, Any]:
        """The Response object (``status``: in_progress, completed or incomplete)."""
        body = self._body
        incomplete = status == "completed" and self.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "model": self.model,
            "output": self.output() if status != "in_progress" else [],
            "usage": self.usage if status != "in_progress" else None,
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": list(body.get("tools") or []),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": bool(body.get("store", True)),
        }

    def take_chat(self, chat: Mapping[str, Any]) -> None:
        """The whole chat completion answer."""
        choice = chat["choices"][0]
        message = choice["message"]
        self.text = message.get("content") or ""
        self.calls = list(message.get("tool_calls") or [])
        self.finish_reason = choice.get("finish_reason")
        self.take_usage(chat.get("usage"))

    def take_usage(self, usage: Mapping[str, Any] | None) -> None:
        if usage is None:
            return
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0},
        }

    def conversation(self) -> list[dict[str, Any]]:
        """The messages a later request continues: the request's and this answer."""
        answer: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            answer["tool_calls"] = self.calls
        return [*self._chat["messages"], answer]


class EventTranslator:
    """Chat completion chunks (SSE) in, Responses events (SSE) out."""

    def __init__(self, builder: ResponseBuilder, emit: Emit) -> None:
        self._builder = builder
        self._emit = emit
        self._sequence = 0
        self._opened = False

    async def send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        await self._emit(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

    async def start(self) -> None:
        response = self._builder.response("in_progress")
        await self.send("response.created", response=response)
        await self.send("response.in_progress", response=response)

    async def __call__(self, data: bytes) -> None:
        """One chat SSE event."""
        payload = data.removeprefix(b"data: ").strip()
        if payload == b"[DONE]":
            await self._finish()
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            await self.send("error", message=chunk["error"].get("message"), code=None)
            return
        self._builder.take_usage(chunk.get("usage"))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            if text:
                await self._text(text)
            self._builder.calls += list(delta.get("tool_calls") or [])
            if choice.get("finish_reason"):
                self._builder.finish_reason = choice["finish_reason"]

    async def _part(self, kind: str, **fields: Any) -> None:
        """An event about the message item's one text part."""
        builder = self._builder
        await self.send(kind, item_id=builder.message_id, output_index=0, content_index=0, **fields)

    async def _text(self, text: str) -> None:
        builder = self._builder
        if not self._opened:
            self._opened = True
            item = builder.message_item("in_progress")
            await self.send("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": []}
            await self._part("response.content_part.added", part=part)
        builder.text += text
        await self._part("response.output_text.delta", delta=text)

    async def _finish(self) -> None:
        builder = self._builder
        for call in builder.calls:
            call.pop("index", None)
        if self._opened:
            await self._part("response.output_text.done", text=builder.text)
            part = {"type": "output_text", "text": builder.text, "annotations": []}
            await self._part("response.content_part.done", part=part)
        for index, item in enumerate(builder.output()):
            if item["type"] == "message" and not self._opened:
                await self.send("response.output_item.added", output_index=index, item=item)
            if item["type"] == "function_call":
                await self.send("response.output_item.added", output_index=index, item=item)
            await self.send("response.output_item.done", output_index=index, item=item)
        await self.send("response.completed", response=builder.response("completed"))
