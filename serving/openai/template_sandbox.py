"""A Jinja sandbox with a time limit and an output-size limit, for chat templates.

A checkpoint's chat template is code from a downloaded folder, and the messages it
renders come from clients. Jinja's immutable sandbox keeps templates from reaching
Python's internals, but not from running for minutes or building gigabytes. Here every
operation a template can loop or grow through passes a check of the rendering's
:class:`Budget`::

    output chunks           total size <= max_chars, clock <= deadline
    attribute, item, call   clock <= deadline (a loop body does at least one of these)
    range(...)              clock every 4096 items (an empty loop body does nothing)
    * ** + %                size of the result known before it is built; small exponents
    calls and filters       no integer argument over max_chars (center(10**9)), the
                            result's size checked; format widths of 8 digits refused
                            ("%99999999s" % x, "{:99999999}".format(x), | format)
    include, import         refused: a chat template stands alone

A violated limit raises :class:`TemplateLimitError` (or :class:`TemplateTooLongError`
for size), which the chat template reports as a 400. Rendering runs in a worker thread;
the checks make it end soon after its deadline, since a thread cannot be killed.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

from jinja2 import BaseLoader, Environment, TemplateNotFound
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from hybridkv.errors import HybridKVError

_RANGE_CHECK_EVERY = 4096
# A format width or precision of 10**7 characters or more, in %-style or {}-style specs.
_BIG_PERCENT_SPEC = re.compile(r"%[-+ #0]*(\d{8,}|\*|\.\d{8,})")
_BIG_BRACE_SPEC = re.compile(r"\{[^{}]*:[^{}]*\d{8,}[^{}]*\}")
_current = threading.local()


class TemplateLimitError(HybridKVError):
    """A template ran past its time limit or did something a chat template may not."""


class TemplateTooLongError(TemplateLimitError):
    """A template's output, or a value it built, is longer than the prompt can be."""


class Budget:
    """One rendering's limits: a deadline and a number of characters.

    Args:
        timeout_s: Seconds the rendering may take.
        max_chars: Characters the output (and any value built on the way) may have.
    """

    def __init__(self, timeout_s: float, max_chars: int) -> None:
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.max_chars = max_chars

    def tick(self) -> None:
        """Raise once the deadline has passed."""
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran longer than {self.timeout_s:g} s")

    def size(self, num_chars: int) -> None:
        """Raise if a value of ``num_chars`` characters (or items) is too long."""
        if num_chars > self.max_chars:
            raise TemplateTooLongError(
                f"the chat template built a value of {num_chars} characters or items; "
                f"the prompt can hold at most {self.max_chars}"
            )

    def __enter__(self) -> Budget:
        _current.budget = self
        return self

    def __exit__(self, *exc: object) -> None:
        _current.budget = None


def _budget() -> Budget:
    budget: Budget | None = getattr(_current, "budget", None)
    assert budget is not None, "templates render inside a Budget"
    return budget


class _NoIncludes(BaseLoader):
    def get_source(self, environment: Environment, template: str) -> Any:
        raise TemplateNotFound(
            template, f"a chat template may not include or import other templates ({template!r})"
        )


class _CheckedRange:
    """``range`` that checks the clock while a template loops over it."""

    def __init__(self, *args: int) -> None:
        self._range = safe_range(*args)

    def __iter__(self) -> Iterator[int]:
        budget = _budget()
        for i, value in enumerate(self._range):
            if i % _RANGE_CHECK_EVERY == 0:
                budget.tick()
            yield value

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        return self._range[index]


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every loop and growth point checked (module doc)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(loader=_NoIncludes(), **options)
        self.globals["range"] = _CheckedRange
        self.filters = {name: _guarded(f, name) for name, f in self.filters.items()}
        # Jinja's test table is inferred as dict[str, function]: its values are callables.
        self.tests = {
            name: _guarded(cast("Callable[..., Any]", f), name) for name, f in self.tests.items()
        }

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateLimitError(f"the chat template raised a number to the power {right}")
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    budget.size(len(seq) * times)
        if operator == "%" and isinstance(left, str):
            _check_format(left, _BIG_PERCENT_SPEC)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str | list | tuple):
            budget.size(len(result))
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__, _BIG_BRACE_SPEC)
        return wrapped

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, str | list | tuple):
            _budget().size(len(result))
        return result


def _guarded(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A filter or test with the call checks (its Jinja pass-arg marks kept)."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        if name == "format":  # "%s" | format(x): the value is a %-style format string
            strings = [a for a in args if isinstance(a, str)][:1]
            for text in strings:
                _check_format(text, _BIG_PERCENT_SPEC)
        result = function(*args, **kwargs)
        if isinstance(result, str | list | tuple):
            _budget().size(len(result))
        return result

    return guarded


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    budget = _budget()
    budget.tick()
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            budget.size(abs(value))  # a width, a count: what a result's size follows


def _check_format(text: str, spec: re.Pattern[str]) -> None:
    if spec.search(text):
        raise TemplateLimitError("the chat template used a format width of 10**7 or more")
