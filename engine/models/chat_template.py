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
