"""Bounds on a structured-output spec, checked before any of it reaches llguidance.

llguidance is native code: a grammar of 3,000 chained rules overflows its stack and
kills the process, and 100,000 choices compile for tens of seconds. So every spec is
measured here first, in pure Python and in time linear in its length, and refused with a
:class:`GrammarLimitError` that names the limit::

    grammar (Lark, GBNF)   bytes, rule definitions, the longest chain of references
                           from the start rule, bracket nesting, alternatives of a rule
    regex                  bytes, group nesting
    JSON schema            bytes, nesting of objects and arrays
    choice                 number of choices, bytes of all of them

A rule's alternatives (and a choice list, one rule of them) are bounded well below the
2,000 items llguidance's parser keeps in one row: past it, a grammar that compiled fails
at the first sampled token, too late for a 400.

The counts are of the text as written (string literals and character classes skipped),
so they are cheap and conservative: they refuse no grammar that a reasonable client
sends, and every grammar that got through them compiled here in milliseconds.
"""

from __future__ import annotations

import json
import re

import attrs

from hybridkv.executor.grammars import GrammarError
from hybridkv.scheduler.params import StructuredOutput


class GrammarLimitError(GrammarError):
    """A structured-output spec over one of the :class:`GrammarLimits`."""


@attrs.frozen(kw_only=True)
class GrammarLimits:
    """The largest structured-output specs accepted (see the module docstring)."""

    max_grammar_bytes: int = 64 << 10
    max_rules: int = 1_000
    max_reference_depth: int = 400
    max_nesting: int = 64
    max_alternatives: int = 1_000
    max_regex_bytes: int = 8 << 10
    max_schema_bytes: int = 64 << 10
    max_choices: int = 1_000
    max_choice_bytes: int = 64 << 10


DEFAULT_LIMITS = GrammarLimits()

# A rule definition: Lark's ``name:`` (``?name:``, ``!name:``, ``name.2:``) or GBNF's
# ``name ::=``, at the start of a line.
_DEFINITION = re.compile(r"^\s*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?\s*(::=|:)(?!:)", re.M)
# What a reference is not: string literals, character classes, Lark regex terminals.
_LITERAL = re.compile(
    r'"(?:\\.|[^"\\\n])*"'  # "double-quoted"
    r"|'(?:\\.|[^'\\\n])*'"  # 'single-quoted'
    r"|\[(?:\\.|[^\]\\\n])*\]"  # [a character class]
    r"|/(?:\\.|[^/\\\n])+/[imslux]*"  # /a Lark regex/
)
_NAME = re.compile(r"[A-Za-z_][\w-]*")
_START_RULES = ("start", "root")


def check_bounds(spec: StructuredOutput, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Raise :class:`GrammarLimitError` if ``spec`` is over a limit (none of it compiled).

    Raises:
        GrammarLimitError: the bound crossed, with the spec's value and the limit.
    """
    text = spec.spec
    size = len(text.encode())
    if spec.kind == "grammar":
        _at_most("the grammar", size, limits.max_grammar_bytes, "bytes")
        _check_grammar_text(text, limits)
    elif spec.kind == "regex":
        _at_most("the regex", size, limits.max_regex_bytes, "bytes")
        _at_most("the regex", _nesting(text, "(", ")"), limits.max_nesting, "nested groups")
    elif spec.kind == "json_schema":
        _at_most("the JSON schema", size, limits.max_schema_bytes, "bytes")
        _at_most("the JSON schema", json_depth(text), limits.max_nesting, "levels of nesting")
    elif spec.kind == "choice":
        _at_most("the choice list", len(json.loads(text)), limits.max_choices, "entries")
        _at_most("the choice list", size, limits.max_choice_bytes, "bytes")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in the JSON ``text`` (not parsed: a text
    nested 10,000 deep is measured without recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _check_grammar_text(text: str, limits: GrammarLimits) -> None:
    bare = _LITERAL.sub('""', text)
    _at_most("the grammar", _nesting(bare, "(", ")"), limits.max_nesting, "nested groups")
    starts = [m.start() for m in _DEFINITION.finditer(bare)]
    if not starts:
        raise GrammarError(
            "the grammar defines no rule: write at least one, as `start: ...` (Lark) "
            "or `root ::= ...` (GBNF)"
        )
    _at_most("the grammar", len(starts), limits.max_rules, "rule definitions")
    rules: dict[str, set[str]] = {}
    for begin, end in zip(starts, [*starts[1:], len(bare)], strict=True):
        match = _DEFINITION.match(bare, begin)
        assert match is not None
        body = bare[match.end() : end]
        rules.setdefault(match.group(1), set()).update(_NAME.findall(body))
        alternatives = _top_level_bars(body) + 1
        _at_most(f"rule {match.group(1)!r}", alternatives, limits.max_alternatives, "alternatives")
    depth = _reference_depth(rules)
    _at_most("the grammar", depth, limits.max_reference_depth, "rules in its longest chain")


def _reference_depth(rules: dict[str, set[str]]) -> int:
    """The longest path of first visits from the start rule through rule references (a
    depth-first walk without recursion; references back into the path end it)."""
    roots = [name for name in _START_RULES if name in rules] or list(rules)[:1]
    deepest = 0
    seen: set[str] = set()
    for root in roots:
        stack = [(root, 1)]
        while stack:
            name, depth = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            deepest = max(deepest, depth)
            stack.extend((ref, depth + 1) for ref in rules[name] if ref in rules)
    return deepest


def _top_level_bars(body: str) -> int:
    """The ``|`` of a rule body outside brackets (literals already blanked)."""
    depth = bars = 0
    for char in body:
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "|" and depth <= 0:
            bars += 1
    return bars


def _nesting(text: str, opening: str, closing: str) -> int:
    depth = deepest = 0
    escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == opening:
            depth += 1
            deepest = max(deepest, depth)
        elif char == closing:
            depth -= 1
    return deepest


def _at_most(what: str, value: int, limit: int, unit: str) -> None:
    if value > limit:
        raise GrammarLimitError(f"{what} has {value} {unit}; the limit is {limit}")
