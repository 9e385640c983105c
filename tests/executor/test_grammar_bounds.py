"""Structured-output specs are measured before llguidance sees them, and refused by the
limit they cross."""

from __future__ import annotations

import json

import pytest
from grammar_samples import chained_gbnf, chained_lark

from hybridkv.executor.grammar_bounds import (
    GrammarLimitError,
    GrammarLimits,
    check_bounds,
    json_depth,
)
from hybridkv.executor.grammars import GrammarError
from hybridkv.scheduler.params import StructuredOutput

JSON_GRAMMAR = r"""
?start: value
?value: object | array | string | SIGNED_NUMBER | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
"""


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput("grammar", JSON_GRAMMAR),
        StructuredOutput("grammar", 'root ::= "yes" | "no"'),
        StructuredOutput("grammar", chained_lark(300)),
        StructuredOutput("regex", "[0-9]{3}-(a|b(c|d))+"),
        StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {}}})),
        StructuredOutput("choice", json.dumps(["north", "south"])),
    ],
)
def test_ordinary_specs_pass(spec: StructuredOutput) -> None:
    """Grammars, expressions, schemas and choices a client sends are within bounds."""
    check_bounds(spec)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            StructuredOutput("grammar", chained_lark(3000)),
            "3002 rule definitions; the limit is 1000",
        ),
        (StructuredOutput("grammar", chained_gbnf(2_000)), "2002 rule definitions"),
        (
            StructuredOutput("grammar", "start: " + "(" * 100 + '"a"' + ")" * 100),
            "100 nested groups",
        ),
        (StructuredOutput("grammar", 'start: "' + "a" * 70_000 + '"'), "bytes; the limit is 65536"),
        (StructuredOutput("regex", "(" * 65 + "a" + ")" * 65), "65 nested groups"),
        (StructuredOutput("regex", "a" * 9000), "9000 bytes"),
        (StructuredOutput("json_schema", "[" * 65 + "]" * 65), "65 levels of nesting"),
        (
            StructuredOutput("choice", json.dumps([f"w{i}" for i in range(100_000)])),
            "100000 entries",
        ),
        (StructuredOutput("choice", json.dumps(["x" * 70_000])), "bytes"),
        (StructuredOutput("choice", json.dumps([f"w{i}" for i in range(1001)])), "1001 entries"),
        (
            StructuredOutput("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(1001))),
            "rule 'start' has 1001 alternatives",
        ),
        (
            StructuredOutput("grammar", 'start: "a"\n' + "\n".join(["  | 'b'"] * 1001)),
            "rule 'start' has 1002 alternatives",
        ),
    ],
)
def test_specs_over_a_bound_are_refused_naming_it(spec: StructuredOutput, match: str) -> None:
    """Rules, nesting, bytes and choices past their limits raise GrammarLimitError."""
    with pytest.raises(GrammarLimitError, match=match):
        check_bounds(spec)


@pytest.mark.parametrize("text", ["garbage", "x ::", "  | 'a'"])
def test_a_grammar_without_a_rule_is_refused(text: str) -> None:
    """Text with no rule definition is a GrammarError saying so, not a crash."""
    with pytest.raises(GrammarError, match="the grammar defines no rule"):
        check_bounds(StructuredOutput("grammar", text))


def test_the_reference_chain_is_bounded_apart_from_the_rule_count() -> None:
    """A chain within the rule count but past the depth limit is refused by its depth."""
    limits = GrammarLimits(max_rules=10_000, max_reference_depth=500)
    with pytest.raises(GrammarLimitError, match="in its longest chain; the limit is 500"):
        check_bounds(StructuredOutput("grammar", chained_lark(600)), limits)
    check_bounds(StructuredOutput("grammar", chained_lark(400)), limits)


def test_recursive_rules_are_not_a_chain() -> None:
    """A rule that refers to itself (or back up the chain) ends the walk there."""
    grammar = 'start: expr\nexpr: term ("+" expr)?\nterm: "1" | "(" expr ")"\n'
    check_bounds(StructuredOutput("grammar", grammar), GrammarLimits(max_reference_depth=3))


def test_names_inside_literals_are_not_references() -> None:
    """``"r1"``, ``[r1]`` and ``/r1/`` are text, not the rule r1."""
    grammar = 'start: "r1" [r1] /r1/ r0\nr0: "x"\nr1: r0\n'
    check_bounds(StructuredOutput("grammar", grammar), GrammarLimits(max_reference_depth=2))


def test_json_depth_skips_brackets_inside_strings() -> None:
    """Brackets inside JSON strings (escaped quotes too) do not nest."""
    assert json_depth('{"a": "[[[\\"{{"}') == 1
    assert json_depth('[[], {"b": [1]}]') == 3
    assert json_depth("[" * 10_000 + "]" * 10_000) == 10_000
