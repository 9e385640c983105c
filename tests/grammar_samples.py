"""Grammars the structured-output tests share: the chains that crash llguidance."""

from __future__ import annotations


def chained_lark(num_rules: int) -> str:
    """``start: r0``, ``r0: r1 "x"``, ...: past about 2,500 rules llguidance's native
    parser overflows its stack and the process dies."""
    rules = [f'r{i}: r{i + 1} "x"' for i in range(num_rules)]
    return "\n".join(["start: r0", *rules, f'r{num_rules}: "y"']) + "\n"


def chained_gbnf(num_rules: int) -> str:
    """The same chain in GBNF (``root ::= r0``, ...)."""
    rules = [f'r{i} ::= r{i + 1} "x"' for i in range(num_rules)]
    return "\n".join(["root ::= r0", *rules, f'r{num_rules} ::= "y"']) + "\n"
