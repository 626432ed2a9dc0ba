"""A model's chat template as jinja, set up the way transformers (v5) sets it up.

The environment is a sandbox with ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a
``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now`` and a no-op
``{% generation %}`` block. The sandbox bounds what one render may cost
(:mod:`engine.models.chat_sandbox`): values, output, and time under a
:func:`~engine.models.chat_sandbox.render_budget`.

Compiling and reading a template is the model's part (:class:`engine.models.tokenizer.Tokenizer`
compiles its folder's template on load, so a broken one fails there); rendering it for a
request's messages and tools is the chat layer's (:mod:`engine.chat.template`).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes

from engine.errors import CorruptModelError
from engine.models import chat_sandbox


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks.

    transformers tracks the marked spans; rendering only needs the body, unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace()`` that refuses underscore names, closing a sandbox escape."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja's signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace ({name!r})"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & for HTML, which would change the model's prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def template_reads(source: str | None, variable: str) -> bool:
    """Whether a chat template's jinja source reads ``variable`` (``tools``,
    ``reasoning_effort``). Reading the source runs jinja's constant folding, so it goes
    through the bounded sandbox too; a source that does not parse is searched as text."""
    if not source:
        return False
    env = chat_sandbox.BoundedSandbox(extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    try:
        return variable in jinja2.meta.find_undeclared_variables(env.parse(source))
    except Exception:  # a syntax error, or a constant that fails to fold
        return variable in source


def template_iterates_content(source: str) -> bool:
    """Whether a chat template reads a message's content as a list of parts (vLLM's
    ``auto`` content format): it loops over ``message['content']`` or
    ``message.content`` (through filters such as ``selectattr``, a slice, a name set from
    it, or a macro argument given it), or reads a part of it (``content[0]['text']``).
    ``message`` is a loop variable over ``messages`` (or over a name set from it, sliced or
    filtered) or one of its items (``messages[0]``, ``messages | last``). A source that
    does not parse reads as a string template."""
    env = chat_sandbox.BoundedSandbox(extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    try:
        tree = env.parse(source)
    except Exception:  # a syntax error: the template cannot render anyway
        return False
    return _ContentReads(tree).as_list


class _ContentReads:
    """Which names of a parsed template hold the messages, one message, or a message's
    content, found by following ``{% set %}``, ``{% for %}`` and macro calls until nothing
    changes; then whether content is read as a list of parts."""

    def __init__(self, tree: jinja2.nodes.Template) -> None:
        self.lists = {"messages"}
        self.messages: set[str] = set()
        self.contents: set[str] = set()
        assigns = list(tree.find_all(jinja2.nodes.Assign))
        loops = list(tree.find_all(jinja2.nodes.For))
        macros = {m.name: m for m in tree.find_all(jinja2.nodes.Macro)}
        calls = [c for c in tree.find_all(jinja2.nodes.Call)
                 if isinstance(c.node, jinja2.nodes.Name) and c.node.name in macros]
        while True:
            before = (len(self.lists), len(self.messages), len(self.contents))
            for assign in assigns:
                for name in _target_names(assign.target):
                    self._bind(name, assign.node)
            for loop in loops:
                if self._is_list(loop.iter):
                    self.messages.update(_target_names(loop.target))
            for call in calls:
                params = [p.name for p in macros[call.node.name].args]  # type: ignore[attr-defined]
                given = list(zip(params, call.args, strict=False))
                given += [(k.key, k.value) for k in call.kwargs]
                for name, value in given:
                    self._bind(name, value)
            if (len(self.lists), len(self.messages), len(self.contents)) == before:
                break
        self.as_list = any(self._is_content(loop.iter) for loop in loops) or any(
            self._is_part(node) for node in tree.find_all((jinja2.nodes.Getitem,
                                                           jinja2.nodes.Getattr)))

    def _bind(self, name: str, value: jinja2.nodes.Node) -> None:
        if self._is_list(value):
            self.lists.add(name)
        elif self._is_message(value):
            self.messages.add(name)
        elif self._is_content(value):
            self.contents.add(name)

    def _is_list(self, node: jinja2.nodes.Node) -> bool:
        return any(isinstance(b, jinja2.nodes.Name) and b.name in self.lists
                   for b in _bases(node))

    def _is_message(self, node: jinja2.nodes.Node) -> bool:
        for b in _bases(node, keep_items=True):
            if isinstance(b, jinja2.nodes.Name) and b.name in self.messages:
                return True
            if isinstance(b, jinja2.nodes.Filter) and b.name in ("first", "last") and (
                    b.node is not None and self._is_list(b.node)):
                return True
            if isinstance(b, jinja2.nodes.Getitem) and _index(b.arg) is not None and (
                    self._is_list(b.node)):
                return True
        return False

    def _is_content(self, node: jinja2.nodes.Node) -> bool:
        for b in _bases(node):
            if isinstance(b, jinja2.nodes.Name) and b.name in self.contents:
                return True
            if isinstance(b, jinja2.nodes.Getitem) and isinstance(b.arg, jinja2.nodes.Const) and (
                    b.arg.value == "content" and self._is_message(b.node)):
                return True
            if isinstance(b, jinja2.nodes.Getattr) and b.attr == "content" and (
                    self._is_message(b.node)):
                return True
        return False

    def _is_part(self, node: jinja2.nodes.Node) -> bool:
        """``content[0]['text']`` / ``content[0].type``: a field of one part."""
        inner = node.node  # type: ignore[attr-defined]
        if isinstance(node, jinja2.nodes.Getitem) and not (
                isinstance(node.arg, jinja2.nodes.Const) and isinstance(node.arg.value, str)):
            return False
        return (isinstance(inner, jinja2.nodes.Getitem) and _index(inner.arg) is not None
                and self._is_content(inner.node))


def _bases(node: jinja2.nodes.Node, keep_items: bool = False) -> list[jinja2.nodes.Node]:
    """What ``node`` evaluates to, under filters, tests, slices and ``a if c else b``
    (``messages[1:] | selectattr(...)`` is ``messages``). ``keep_items``: ``first`` and
    ``last`` stay (they pick an item, not the list)."""
    if isinstance(node, jinja2.nodes.Filter) and node.node is not None and not (
            keep_items and node.name in ("first", "last")):
        return _bases(node.node, keep_items)
    if isinstance(node, jinja2.nodes.Test):
        return _bases(node.node, keep_items)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _bases(node.node, keep_items)
    if isinstance(node, jinja2.nodes.CondExpr):
        return [*_bases(node.expr1, keep_items),
                *(_bases(node.expr2, keep_items) if node.expr2 is not None else [])]
    return [node]


def _index(node: jinja2.nodes.Node) -> int | None:
    """The integer ``node`` is (``0``, ``-1``), else None."""
    if isinstance(node, jinja2.nodes.Neg):
        inner = _index(node.node)
        return -inner if inner is not None else None
    if isinstance(node, jinja2.nodes.Const) and isinstance(node.value, int) and not (
            isinstance(node.value, bool)):
        return node.value
    return None


def _target_names(target: jinja2.nodes.Node) -> list[str]:
    if isinstance(target, jinja2.nodes.Name):
        return [target.name]
    if isinstance(target, jinja2.nodes.Tuple):
        return [n for item in target.items for n in _target_names(item)]
    return []  # a namespace attribute (ns.x): not followed


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the bounded sandbox. Raises what jinja raises: a
    :class:`jinja2.TemplateSyntaxError`, or any error of folding a constant expression
    while compiling (``{{ (10 ** 5000) | string }}`` exceeds Python's int-to-text limit
    before any message is rendered)."""
    env = chat_sandbox.BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def compile_model_template(source: str, folder: Path) -> jinja2.Template:
    """The chat template of the model folder ``folder``, compiled; a template that does not
    compile is a :class:`CorruptModelError` naming the folder."""
    try:
        return compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CorruptModelError(
            f"the chat template of {str(folder)!r} is not valid jinja: {exc} (line {exc.lineno})"
        ) from exc
    except Exception as exc:
        # jinja folds constant expressions while compiling: ``{{ (10 ** 5000) | string }}``
        # raises (Python's int-to-text digit limit) before any message is rendered.
        raise CorruptModelError(
            f"the chat template of {str(folder)!r} fails while compiling: "
            f"{type(exc).__name__}: {exc}") from exc
