"""A request's structured output, checked and compiled before it is queued, off the loop.

::

    bounds            bytes, rules, reference depth, nesting, choices   (grammar_bounds)
    llguidance check  in a child process: a crash or a stall is a 400   (grammar_guard)
    compile           against the vocabulary, into the executor's cache (compile_grammar)

All three run in a worker thread of the preprocessing pool, so neither the event loop nor
any engine step waits for a grammar, and a grammar llguidance refuses at any of them is
a 400 naming the field, never a request that may sample only EOS. An executor that cannot
compile ahead (a pipeline, whose last stage samples in another process) compiles in its
step, as before.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import anyio

from hybridkv.executor.grammar_guard import GrammarGuard
from hybridkv.executor.grammars import GrammarError
from hybridkv.scheduler.params import StructuredOutput
from hybridkv.serving.openai.errors import APIError


@runtime_checkable
class GrammarCompiler(Protocol):
    """An executor that compiles a grammar for its steps ahead of them (thread-safe)."""

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile ``spec``; raise ``GrammarError`` if it does not compile."""
        ...


class GrammarCheck:
    """Bounds, the child-process check and the compile of one server's grammars.

    Args:
        guard: The child-process checker (its limits are the server's).
        compiler: The executor, when it compiles ahead; None compiles in the step.
        limiter: The preprocessing threads it runs on.
    """

    def __init__(
        self,
        guard: GrammarGuard,
        compiler: GrammarCompiler | None,
        limiter: anyio.CapacityLimiter,
    ) -> None:
        self.guard = guard
        self.compiler = compiler
        self.limiter = limiter

    async def check(self, spec: StructuredOutput, param: str) -> None:
        """Refuse (400, naming ``param``) a constraint over a bound, or one that does not
        compile or crashes the compiler; otherwise leave it compiled for the steps."""
        await anyio.to_thread.run_sync(self._check, spec, param, limiter=self.limiter)

    def _check(self, spec: StructuredOutput, param: str) -> None:
        try:
            self.guard.check(spec)
            if self.compiler is not None:
                self.compiler.compile_grammar(spec)
        except GrammarError as exc:
            raise APIError(f"'{param}': {exc}", param=param) from None
