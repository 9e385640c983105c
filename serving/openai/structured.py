"""The structured-output fields of a request, as OpenAI and vLLM spell them.

All of these become one :class:`~hybridkv.scheduler.params.StructuredOutput`:

    response_format {"type": "json_object"}                   any JSON object
    response_format {"type": "json_schema",
                     "json_schema": {"name": ..., "schema": S}} JSON following S
    guided_json S, guided_regex R, guided_choice [..],         vLLM's older fields
    guided_grammar G (Lark or GBNF)
    structured_outputs {"json" | "regex" | "choice" |          vLLM's newer field
                        "grammar" | "json_object": ...}

Setting two constraints is a 400; so is a schema, expression or grammar over a bound or
that does not compile (``grammar_check``, in a worker thread before the request is
queued). A JSON schema sent as a string is decoded with the request body's own limits.
llguidance is the only backend: ``guided_decoding_backend`` may name it or ``auto``.

JSON schemas follow vLLM's default backend: any whitespace between tokens, and no
property a schema does not list where it says nothing of others. ``structured_outputs``
may set ``disable_any_whitespace`` and ``disable_additional_properties`` (false: allow
them) for the request; ``ServerOptions.structured_outputs`` sets them for the server.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hybridkv.scheduler.params import StructuredKind, StructuredOutput
from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.fields import Fields
from hybridkv.serving.openai.json_text import parse_json_text

_BACKENDS = (None, "auto", "guidance", "llguidance")
_GUIDED_KINDS: dict[str, StructuredKind] = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def parse_structured_output(fields: Fields) -> tuple[StructuredOutput, str] | None:
    """The request's constraint and the field that set it, or None.

    Raises:
        APIError: a malformed constraint, two of them, or an unsupported option.
    """
    fields.refuse("guided_decoding_backend", allowed=_BACKENDS, why="only llguidance is built in")
    fields.refuse("guided_whitespace_pattern")
    found = [
        item
        for item in (
            _response_format(fields),
            _guided(fields, "guided_json", _schema),
            _guided(fields, "guided_regex", _regex),
            _guided(fields, "guided_choice", _choice),
            _guided(fields, "guided_grammar", _grammar),
            _structured_outputs(fields),
        )
        if item is not None
    ]
    if len(found) > 1:
        names = " and ".join(repr(name) for _, name in found)
        raise APIError(f"only one output constraint may be set, got {names}", param=found[1][1])
    return found[0] if found else None


def _response_format(fields: Fields) -> tuple[StructuredOutput, str] | None:
    form = fields.nested("response_format")
    if form is None:
        return None
    kind = form.string("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_schema", '{"type": "object"}'), "response_format"
    if kind == "json_schema":
        schema = form.nested("json_schema")
        if schema is None:
            raise form.error("json_schema", "is required when type is json_schema")
        for name in ("name", "description", "strict"):
            schema.raw(name)  # descriptive: they change nothing here
        value = schema.raw("schema")
        schema.check_all_read()
        form.check_all_read()
        name = schema.name("schema")
        return StructuredOutput("json_schema", _schema(value, name)), name
    raise form.error("type", f"must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(fields: Fields) -> tuple[StructuredOutput, str] | None:
    options = fields.nested("structured_outputs")
    if options is None:
        return None
    found = []
    for key, convert in (("json", _schema), ("regex", _regex), ("choice", _choice)):
        if options.has(key):
            found.append((key, convert(options.raw(key), options.name(key))))
    if options.has("grammar"):
        found.append(("grammar", _grammar(options.raw("grammar"), options.name("grammar"))))
    if options.boolean("json_object", False):
        found.append(("json_object", '{"type": "object"}'))
    any_whitespace = _negated(options, "disable_any_whitespace")
    additional = _negated(options, "disable_additional_properties")
    options.refuse("whitespace_pattern", why="choose disable_any_whitespace")
    options.check_all_read()
    if len(found) != 1:
        raise fields.error("structured_outputs", "must set exactly one constraint")
    key, spec = found[0]
    kind = {"json": "json_schema", "json_object": "json_schema"}.get(key, key)
    output = StructuredOutput(kind, spec, any_whitespace, additional)  # type: ignore[arg-type]
    return output, options.name(key)


def _negated(fields: Fields, field: str) -> bool | None:
    """vLLM's ``disable_*`` switch as the option it turns off; None when not set."""
    if not fields.has(field):
        fields.raw(field)
        return None
    return not fields.boolean(field, False)


def _guided(
    fields: Fields, field: str, convert: Callable[[object, str], str]
) -> tuple[StructuredOutput, str] | None:
    value = fields.raw(field)
    if value is None:
        return None
    return StructuredOutput(_GUIDED_KINDS[field], convert(value, field)), field


def _schema(value: object, name: str) -> str:
    if isinstance(value, str):  # JSON in a string: the body's limits hold for it too
        try:
            value = parse_json_text(value, f"'{name}'")
        except APIError as exc:
            raise APIError(exc.message, param=name) from None
    if not isinstance(value, dict | bool):
        raise APIError(f"'{name}' must be a JSON schema (an object)", param=name)
    return json.dumps(value)


def _regex(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise APIError(f"'{name}' must be a non-empty regular expression", param=name)
    return value


def _choice(value: object, name: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise APIError(f"'{name}' must be a non-empty list of strings", param=name)
    return json.dumps(value)


def _grammar(value: object, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise APIError(f"'{name}' must be a non-empty grammar (Lark or GBNF)", param=name)
    return value
