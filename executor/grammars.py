"""Structured-output specs to llguidance grammars, and the check the server runs first.

Torch-free, so the HTTP layer can refuse a bad schema, expression or grammar with a 400
before anything is queued; ``executor/structured.py`` compiles the same text against the
vocabulary to mask logits.
"""

from __future__ import annotations

import json

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.params import StructuredOutput


class GrammarError(HybridKVError, ValueError):
    """A structured-output spec does not compile: a bad schema, expression or grammar."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (not yet checked: see :func:`check_grammar`)."""
    from llguidance import LLMatcher, grammar_from

    if spec.kind == "json_schema":
        # vLLM's default backend's defaults: any whitespace, no property a schema does
        # not list (where it says nothing of others).
        schema = spec.spec
        if not spec.additional_properties:
            schema = json.dumps(close_objects(json.loads(schema)))
        flexible = spec.any_whitespace is not False
        return LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": flexible}
        )
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        return grammar_from("choice", json.dumps([str(c) for c in choices]))
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.spec)
    return grammar_from("grammar", spec.spec)


def check_grammar(spec: StructuredOutput) -> None:
    """Raise :class:`GrammarError` naming the problem if ``spec`` does not compile."""
    from llguidance import LLMatcher

    try:
        text = grammar_text(spec)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the {spec.kind} does not compile: {exc}") from None
    message = LLMatcher.validate_grammar(text)
    if message and not message.startswith("WARNING"):
        raise GrammarError(f"the {spec.kind} does not compile: {message.strip()}")


#: Keywords whose value is one subschema, a list of them, or a mapping of names to them.
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else",
        "contains", "propertyNames", "additionalItems", "unevaluatedItems")  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    its ``properties`` and says nothing of others (a bare ``{"type": "object"}`` stays any
    object); subschemas are followed by keyword, so a property named ``properties`` is a
    name, not a keyword."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _ONE:
        if key in out:
            out[key] = close_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(item) for item in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    return out
