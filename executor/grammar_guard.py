"""llguidance's grammar check in a child process, so that a grammar that crashes the
native library, or takes too long, costs that process and never the server.

::

    server thread                         child process (started once, kept)
    check_bounds(spec)                    (pure Python, in the server)
    verdict cached?  -> answer
    send (kind, text) ------------------> check_grammar(spec): llguidance parses it
    wait at most timeout_s  <------------ "" (it compiles) or the refusal
    died / timed out: a 400 naming it, the child restarted for the next request

One child serves every check in turn (a check takes milliseconds once bounded); a lock
orders the callers. Verdicts are cached by spec, so ``n`` choices or a client retrying
the same schema pay one check.
"""

from __future__ import annotations

import enum
import json
import select
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict
from typing import IO

from hybridkv.errors.events import get_logger
from hybridkv.executor.grammar_bounds import DEFAULT_LIMITS, GrammarLimits, check_bounds
from hybridkv.executor.grammars import GrammarError, check_grammar
from hybridkv.scheduler.params import StructuredOutput

log = get_logger(__name__)


class GrammarGuard:
    """Checks structured-output specs in a child process (thread-safe, blocking).

    Args:
        limits: Bounds checked in this process first.
        timeout_s: Longest a check may take in the child.
        cache_size: Verdicts remembered.
    """

    def __init__(
        self,
        *,
        limits: GrammarLimits = DEFAULT_LIMITS,
        timeout_s: float = 10.0,
        cache_size: int = 512,
    ) -> None:
        self.limits = limits
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        self._verdicts: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._lock = threading.Lock()
        self._child: _Child | None = None

    def check(self, spec: StructuredOutput) -> None:
        """Raise :class:`GrammarError` if ``spec`` is over a bound, does not compile, or
        crashes or stalls the compiler. Blocks: call it from a worker thread.

        Raises:
            GrammarError: why (a :class:`GrammarLimitError` for a bound).
        """
        check_bounds(spec, self.limits)
        with self._lock:
            verdict = self._verdicts.get(spec)
            if verdict is None:
                verdict = self._ask(spec)
                self._verdicts[spec] = verdict
                while len(self._verdicts) > self._cache_size:
                    self._verdicts.popitem(last=False)
            self._verdicts.move_to_end(spec)
        if verdict:
            raise GrammarError(verdict)

    @property
    def is_running(self) -> bool:
        """Whether a child process is up (it starts with the first uncached check)."""
        return self._child is not None and self._child.process.poll() is None

    def close(self) -> None:
        """Stop the child (a later check starts a new one)."""
        with self._lock:
            if self._child is not None:
                self._child.stop()
                self._child = None

    def _ask(self, spec: StructuredOutput) -> str:
        child = self._child = self._child or _Child.start()
        answer = child.ask(spec, self.timeout_s)
        if isinstance(answer, str):
            return answer
        child.stop()
        self._child = None
        log.warning("grammar_check_failed", kind=spec.kind, reason=answer.value)
        if answer is _NoAnswer.TIMEOUT:
            return f"the {spec.kind} did not compile within {self.timeout_s:g} s"
        return f"the {spec.kind} crashed the grammar compiler (llguidance)"


class _NoAnswer(enum.Enum):
    """Why a child gave no answer."""

    TIMEOUT = "timeout"
    DIED = "died"


class _Child:
    """One checker process (``python -m hybridkv.executor.grammar_guard``), spoken to in
    JSON lines over its standard input and output."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        # Killed when dropped (a guard collected, a restart) or at exit, if not before.
        self._kill = weakref.finalize(self, _kill, process)

    @classmethod
    def start(cls) -> _Child:
        # A fresh interpreter, not a fork: the server has threads, and a spawned
        # multiprocessing child would re-run the embedding program's main module.
        process = subprocess.Popen(
            [sys.executable, "-m", "hybridkv.executor.grammar_guard"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        return cls(process)

    def ask(self, spec: StructuredOutput, timeout_s: float) -> str | _NoAnswer:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(json.dumps({"kind": spec.kind, "spec": spec.spec}).encode() + b"\n")
            stdin.flush()
            ready, _, _ = select.select([stdout], [], [], timeout_s)
            if not ready:
                return _NoAnswer.TIMEOUT
            line = stdout.readline()
        except OSError:  # the pipe broke: the child is gone
            return _NoAnswer.DIED
        if not line:
            return _NoAnswer.DIED
        answer: str = json.loads(line)["error"]
        return answer

    def stop(self) -> None:
        self._kill()


def _kill(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


def _serve(lines: IO[str], out: IO[str]) -> None:
    """The child's loop: check each spec it is sent, answer "" or the refusal."""
    for line in lines:
        request = json.loads(line)
        try:
            check_grammar(StructuredOutput(request["kind"], request["spec"]))
            error = ""
        except GrammarError as exc:
            error = str(exc)
        out.write(json.dumps({"error": error}) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.stdin, sys.stdout)
