"""The jinja sandbox chat templates run in, with a budget on what one render may cost.

jinja's sandbox keeps a template away from Python's internals, but not from the CPU or
memory: ``{{ 7 ** 50000000 }}`` is one C-level multiplication that holds the GIL (and so
every thread, the event loop's included) for a minute, ``{{ 'x' * 10**10 }}`` asks for
10 GB, and ``{{ 10 ** 100000 }}`` was folded into a constant while the template compiled
(a ``ValueError`` there was a 500). A thread cannot be killed, so nothing may start that
cannot be stopped. :class:`BoundedSandbox` bounds each step instead:

* **values**: ``+``, ``*``, ``**`` and ``%`` are intercepted (which also stops jinja from
  folding them at compile time) and refused when the result would be an integer over
  :data:`MAX_INT_BITS` bits or a string or list over the render's character budget, checked
  from the operands' sizes *before* the operation runs; every call, filter and ``~``
  concatenation is checked the same way (integer arguments such as widths and repeat
  counts before, the result's size after);
* **time**: every loop iteration, call and output piece checks the render's deadline
  (and whether its caller has gone), so a template that loops for ever stops at
  :func:`render_budget`'s deadline with :class:`TemplateBudgetError`;
* **output**: the rendered text is collected piece by piece and refused past the budget.

``range`` is already bounded by jinja's sandbox (100,000 items). A budget is per thread:
:func:`render_budget` sets it for the renders in its ``with`` block; without one, only
the size limits apply.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Integers in templates count loop indices and lengths: 4096 bits is far past any of them,
# and an operation on such numbers, or printing one, takes microseconds.
MAX_INT_BITS = 1 << 12
# A string or list may hold this many items unless the render's budget allows more (it
# scales with the size of the messages: see render_budget). 16 Mi characters is four
# times the default --max-request-bytes: what a template makes of a body may repeat it,
# not multiply it.
DEFAULT_MAX_CHARS = 1 << 24
# Integer arguments of calls and filters (widths, repeat counts, indents) above this are
# refused before the call: no template formats a field a million characters wide.
MAX_INT_ARGUMENT = 1 << 20
# A field width or precision of seven digits or more: in a printf-style format
# ("%0999999999d", "%.9999999f") or in a str.format replacement field ("{:>9999999}").
_PRINTF_WIDE = re.compile(r"%[-#0 +]*(?:[0-9]*\.)?[0-9]{7,}")
_FORMAT_WIDE = re.compile(r"\{[^{}]*:[^{}]*[0-9]{7,}[^{}]*\}")


class TemplateBudgetError(jinja2.exceptions.TemplateError):
    """A render went past its time or size budget (the request's error, a 400)."""


class RenderBudget:
    """What the template renders of one request may cost: ``seconds`` of wall time from
    :meth:`active` on (None: no deadline), strings and lists of at most ``max_chars``
    items (never fewer than :data:`DEFAULT_MAX_CHARS`). :meth:`cancel` (from any thread)
    stops a render at its next step, for a caller that has gone."""

    __slots__ = ("cancelled", "deadline", "max_chars", "seconds")

    def __init__(self, seconds: float | None, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.seconds = seconds
        self.deadline: float | None = None
        self.max_chars = max(max_chars, DEFAULT_MAX_CHARS)
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    @contextlib.contextmanager
    def active(self) -> Iterator[RenderBudget]:
        """Bound this thread's renders inside the block; the clock starts here."""
        if self.seconds is not None:
            self.deadline = time.monotonic() + self.seconds
        outer = _budget()
        _local.budget = self
        try:
            yield self
        finally:
            _local.budget = outer


_local = threading.local()


def _budget() -> RenderBudget | None:
    return getattr(_local, "budget", None)


def render_budget(seconds: float | None, max_chars: int = DEFAULT_MAX_CHARS
                  ) -> contextlib.AbstractContextManager[RenderBudget]:
    """``RenderBudget(seconds, max_chars).active()``: bound this thread's renders."""
    return RenderBudget(seconds, max_chars).active()


def tick() -> None:
    """Raise :class:`TemplateBudgetError` if this thread's render is out of time."""
    budget = _budget()
    if budget is None:
        return
    if budget.cancelled:
        raise TemplateBudgetError("the chat template render was cancelled")
    if budget.deadline is not None and time.monotonic() > budget.deadline:
        raise TemplateBudgetError(
            f"the chat template took longer than {budget.seconds:g} s to render")


def _max_chars() -> int:
    budget = _budget()
    return DEFAULT_MAX_CHARS if budget is None else budget.max_chars


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_result(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateBudgetError(f"the chat template made an integer over {MAX_INT_BITS} bits")
    if _size(value) > _max_chars():
        raise TemplateBudgetError(
            f"the chat template made a value of {_size(value)} items; at most {_max_chars()}")
    return value


def _refuse_size(items: int) -> None:
    if items > _max_chars():
        raise TemplateBudgetError(
            f"the chat template would make a value of {items} items; at most {_max_chars()}")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_binop(op: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be too large, from its operands alone."""
    if op == "**" and _int(left) and _int(right) and right > 0:
        if abs(left) > 1 and abs(left).bit_length() * right > MAX_INT_BITS:
            raise TemplateBudgetError(
                f"the chat template computes {left} ** {right}, an integer over "
                f"{MAX_INT_BITS} bits")
    elif op == "*":
        if _int(left) and _int(right):
            if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise TemplateBudgetError(
                    f"the chat template multiplies integers past {MAX_INT_BITS} bits")
        elif _int(right) and _size(left) or _int(left) and _size(right):
            count, seq = (right, left) if _int(right) else (left, right)
            _refuse_size(_size(seq) * max(count, 0))
    elif op == "+":
        _refuse_size(_size(left) + _size(right))
    elif op == "%" and isinstance(left, str):
        _check_format(left, right)


def _check_format(fmt: str, args: Any) -> None:
    """A printf-style format whose widths would allocate too much (``'%0999999999d'``,
    or ``'%*d'`` with a huge argument)."""
    if _PRINTF_WIDE.search(fmt):
        raise TemplateBudgetError("the chat template formats a field over a million wide")
    if "*" in fmt:
        values = args if isinstance(args, tuple) else (args,)
        if any(_int(v) and abs(v) > MAX_INT_ARGUMENT for v in values):
            raise TemplateBudgetError("the chat template formats a field over a million wide")


def _check_arguments(args: Iterable[Any]) -> None:
    for value in args:
        if _int(value) and abs(value) > MAX_INT_ARGUMENT:
            raise TemplateBudgetError(
                f"the chat template passes {value} to a call; integer arguments are at most "
                f"{MAX_INT_ARGUMENT}")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    """``text.replace(old, new)`` grows ``text`` by ``len(new) - len(old)`` per match."""
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        matches = text.count(old) if old else len(text) + 1
        _refuse_size(len(text) + matches * max(len(new) - len(old), 0))


def _joinable(items: Any) -> Any:
    """``items`` as something with a length (a generator becomes a list), to size a join."""
    return items if isinstance(items, (str, list, tuple, range, dict)) else list(items)


def _check_join(separator: Any, items: Any) -> None:
    """A join's result is its items (strings, or short numbers) plus a separator each."""
    sizes = (_size(i) if isinstance(i, str) else 24 for i in items)
    _refuse_size(sum(sizes) + _size(separator) * len(items))


def _ticking(iterable: Any) -> Iterator[Any]:
    """A loop's iterable, checking the budget at each iteration."""
    for item in iterable:
        tick()
        yield item


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marker
    def bounded(*args: Any, **kwargs: Any) -> Any:
        tick()
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context,
                                                         jinja2.Environment,
                                                         jinja2.nodes.EvalContext))]
        if name == "format" and values and isinstance(values[0], str):
            _check_format(values[0], tuple(values[1:]))
        else:
            _check_arguments([*values[1:], *kwargs.values()])
        if name == "replace" and len(values) >= 3:
            _check_replace(values[0], values[1], values[2])
        if name == "join" and values:
            items = _joinable(values[0])
            separator = values[1] if len(values) > 1 else kwargs.get("d", "")
            _check_join(separator, items)
            args = tuple(items if a is values[0] else a for a in args)
        return _check_result(func(*args, **kwargs))

    return bounded


# Filters the rewritten templates call: loop iterables and "~" concatenations.
_TICKING = "engine_ticking"
_BOUNDED = "engine_bounded"


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox whose templates cannot run past their budget (see the
    module docstring). Filters added after construction are not wrapped: call
    :meth:`bound_filters` once they are all in."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bound_filters()

    def bound_filters(self) -> None:
        for name, func in list(self.filters.items()):
            if not getattr(func, "engine_bounded", False):
                wrapped = _bounded_filter(name, func)
                wrapped.engine_bounded = True  # type: ignore[attr-defined]
                self.filters[name] = wrapped
        self.filters[_TICKING] = _ticking
        self.filters[_BOUNDED] = _check_result

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        tick()
        _check_binop(operator_, left, right)
        return _check_result(self.binop_table[operator_](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805, B902 - jinja's signature
        tick()
        _check_arguments([*args, *kwargs.values()])
        # A str method (the sandbox hands out str.format as a wrapper of it).
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            name = getattr(method, "__name__", "")
            if name in ("format", "format_map") and _FORMAT_WIDE.search(owner):
                raise TemplateBudgetError("the chat template formats a field over a million wide")
            if name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1])
            if name == "join" and args:
                items = _joinable(args[0])
                _check_join(owner, items)
                args = (items, *args[1:])
        return _check_result(super().call(__context, __obj, *args, **kwargs))

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        """Parse, then route every loop's iterable through the budget check and bound
        every ``~`` concatenation's result."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = _filter(_TICKING, loop.iter)
        for parent in list(tree.find_all(jinja2.nodes.Node)):
            for field in parent.fields:
                value = getattr(parent, field, None)
                if isinstance(value, jinja2.nodes.Concat):
                    setattr(parent, field, _filter(_BOUNDED, value))
                elif isinstance(value, list):
                    value[:] = [_filter(_BOUNDED, v) if isinstance(v, jinja2.nodes.Concat)
                                else v for v in value]
        return tree


def _filter(name: str, node: jinja2.nodes.Expr) -> jinja2.nodes.Filter:
    return jinja2.nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


def render(template: jinja2.Template, **variables: Any) -> str:
    """Render ``template`` piece by piece, within this thread's budget (time and size)."""
    parts: list[str] = []
    total = 0
    limit = _max_chars()
    for piece in template.generate(**variables):
        tick()
        total += len(piece)
        if total > limit:
            raise TemplateBudgetError(
                f"the chat template rendered more than {limit} characters")
        parts.append(piece)
    return "".join(parts)

