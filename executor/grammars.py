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
        # Any whitespace between JSON tokens, as vLLM's default.
        return LLMatcher.grammar_from_json_schema(spec.spec, defaults={"whitespace_flexible": True})
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
