"""What a request asks its output to match: :class:`StructuredOutputs`.

A frozen value of plain data (strings, tuples, a bool), so it rides inside
:class:`engine.params.SamplingParams` through every message and packs with msgpack. The
grammar it names is compiled elsewhere (:mod:`engine.structured.backend`); this module only
checks that the value is well formed and says which constraint it is.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engine.errors import InvalidParamError
from engine.structured.check import check_json_schema, check_regex, disjoint_one_of

# The largest constraint text (a schema as JSON, a regex, a grammar, the choices joined):
# compile time grows with it, and 64 KiB holds any schema an application sends (OpenAI
# caps a strict schema at 5,000 properties of short names, well under this).
MAX_SPEC_CHARS = 65_536
# Choices beyond this make a grammar as large as the limit above for no real use.
MAX_CHOICES = 1024

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Where the constraint starts when the output may reason first (``think``): "open", the
# output starts inside a <think> block its prompt opened (free text up to </think>, a
# leading <think> allowed); "optional", the output may start with a whole
# <think>...</think> block. Whitespace after </think> is free too.
THINK_MODES = ("open", "optional")
# The markers of a reasoning block when ``think`` names only a mode.
DEFAULT_THINK_MARKERS = (("<think>",), ("</think>",))


def think_value(mode: str, starts: tuple[str, ...], ends: tuple[str, ...]) -> str:
    """A ``think`` for ``mode`` with a reasoning format's opening and closing markers (any
    one of each): the mode alone for ``<think>``/``</think>``, else the JSON text
    ``[mode, starts, ends]`` (Granite's "Here is my thought process:", Mistral's
    ``[THINK]``)."""
    if (starts, ends) == DEFAULT_THINK_MARKERS:
        return mode
    return json.dumps([mode, list(starts), list(ends)])


def think_prefix(think: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """``think``'s mode, opening markers and closing markers (:func:`think_value`'s
    inverse); ``ValueError`` when it is neither a mode nor such a list."""
    if think in THINK_MODES:
        return think, *DEFAULT_THINK_MARKERS
    try:
        mode, starts, ends = json.loads(think)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"think must be one of {', '.join(THINK_MODES)} or "
                         f"[mode, starts, ends], got {think!r}") from exc
    if (mode not in THINK_MODES or not all(
            isinstance(group, list) and group and all(isinstance(m, str) and m for m in group)
            for group in (starts, ends))):
        raise ValueError(f"think must be one of {', '.join(THINK_MODES)} or [mode, starts, "
                         f"ends] with non-empty lists of markers, got {think!r}")
    return mode, tuple(starts), tuple(ends)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutputs:
    """One constraint on a request's output, exactly one field set (vLLM's names).

    * ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON document
      that validates against it. Stored as compact JSON text, key order kept (it is the
      order the properties are generated in).
    * ``json_object``: ``True`` for any JSON object.
    * ``regex``: the output fully matches this regular expression (ECMAScript syntax as
      xgrammar reads it; no ``^``/``$`` needed).
    * ``choice``: the output is exactly one of these strings.
    * ``grammar``: an EBNF grammar in xgrammar's (GBNF) syntax whose ``root`` rule the
      output matches.
    * ``structural_tag``: an xgrammar structural tag (a dict, or its JSON text:
      ``{"type": "structural_tag", "format": {...}}``), e.g. ``triggered_tags``: free text
      until a trigger such as ``<tool_call>``, then a tag whose content matches a JSON
      schema (how ``tool_choice: "auto"`` calls are constrained). Under llguidance only
      the formats the chat layer writes are translated (triggered_tags,
      tags_with_separator, tag, sequence, or, const_string, regex, json_schema).

    ``think`` (:data:`THINK_MODES`) lets the output reason first: the constraint applies
    after ``</think>`` (a reasoning model's structured output or forced call).

    Bad values raise :class:`InvalidParamError` with ``param="structured_outputs"``; a
    regex or grammar that does not compile is found when the engine compiles it (at
    admission), with the same error.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    think: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            object.__setattr__(self, "structural_tag", _json_text(self.structural_tag,
                                                                  "structural_tag"))
        if self.choice is not None and not isinstance(self.choice, tuple):
            if not isinstance(self.choice, list):
                raise _error("choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        self._check()

    def _check(self) -> None:
        if not isinstance(self.json_object, bool):
            raise _error("json_object must be true or false")
        set_kinds = [k for k in KINDS if (getattr(self, k) is not None and k != "json_object")
                     or (k == "json_object" and self.json_object)]
        if len(set_kinds) != 1:
            raise _error(
                "exactly one of json, json_object, regex, choice, grammar or structural_tag "
                "must be set, got "
                + (", ".join(set_kinds) if set_kinds else "none"))
        if self.json is not None:
            schema = self.schema
            if not isinstance(schema, dict):
                raise _error("json must be a JSON schema object")
            check_schema(schema)
            rewritten = disjoint_one_of(schema)
            if rewritten != schema:
                object.__setattr__(self, "json", _schema_text(rewritten))
            check_json_schema(rewritten)
        if self.structural_tag is not None:
            rewritten_tag = _disjoint_one_of_in_tag(self.structural_tag)
            if rewritten_tag is not None:
                object.__setattr__(self, "structural_tag", rewritten_tag)
            _check_structural_tag(self.structural_tag)
        if self.think is not None:
            if not isinstance(self.think, str):
                raise _error(f"think must be a string, got {self.think!r}")
            try:
                think_prefix(self.think)
            except ValueError as exc:
                raise _error(str(exc)) from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _error(f"{name} must be a non-empty string")
        if self.regex is not None:
            check_regex(self.regex)
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise _error(f"choice must hold 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise _error("choice must hold non-empty strings")
        if len(self.text) > MAX_SPEC_CHARS:
            raise _error(f"the {self.kind} constraint is {len(self.text)} characters; at most "
                         f"{MAX_SPEC_CHARS} are allowed")

    @property
    def kind(self) -> str:
        """``"json"``, ``"json_object"``, ``"regex"``, ``"choice"``, ``"grammar"`` or
        ``"structural_tag"``."""
        if self.json is not None:
            return "json"
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        if self.structural_tag is not None:
            return "structural_tag"
        return "grammar"

    @property
    def text(self) -> str:
        """The constraint as one string (the choices as a JSON list)."""
        if self.json is not None:
            return self.json
        if self.regex is not None:
            return self.regex
        if self.grammar is not None:
            return self.grammar
        if self.structural_tag is not None:
            return self.structural_tag
        if self.choice is not None:
            return json.dumps(list(self.choice), ensure_ascii=False)
        return ""

    @property
    def key(self) -> tuple[str, str, str]:
        """What the compiled-grammar cache is keyed by: equal keys compile alike."""
        return self.kind, self.text, self.think or ""

    @property
    def schema(self) -> Any:
        """The JSON schema of a ``json`` constraint, parsed."""
        return json.loads(self.json) if self.json is not None else None


def _schema_text(schema: Any) -> str:
    return _json_text(schema, "json", "a JSON schema")


def _json_text(value: Any, name: str, what: str = "JSON") -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _error(f"{name} must be {what}: {exc}") from None


def _disjoint_one_of_in_tag(text: str) -> str | None:
    """``text`` with every JSON schema inside the tag rewritten as a ``json`` constraint's
    is (:func:`engine.structured.check.disjoint_one_of`), so a tool's parameters hold to
    a ``oneOf`` as a response_format does; None when nothing changes (or the tag is not
    JSON, which :func:`_check_structural_tag` reports)."""
    try:
        tag = json.loads(text)
    except ValueError:
        return None
    changed = False

    def walk(node: Any) -> Any:
        nonlocal changed
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            schema = node["json_schema"]
            rewritten = disjoint_one_of(schema)
            changed = changed or rewritten != schema
            return {**node, "json_schema": rewritten}
        return {k: walk(v) for k, v in node.items()}

    out = walk(tag)
    return _json_text(out, "structural_tag") if changed else None


def _check_structural_tag(text: str) -> None:
    """The envelope of a structural tag, and every JSON schema inside it (the formats
    themselves are checked by the backend when it compiles)."""
    try:
        tag = json.loads(text)
    except ValueError as exc:
        raise _error(f"structural_tag is not JSON: {exc}") from None
    if not (isinstance(tag, dict) and tag.get("type") == "structural_tag"
            and isinstance(tag.get("format"), dict)):
        raise _error('structural_tag must be {"type": "structural_tag", "format": {...}}')
    for schema in tag_schemas(tag["format"]):
        if not isinstance(schema, dict):
            raise _error("a json_schema format in structural_tag must hold a schema object")
        check_schema(schema)
        check_json_schema(schema)


def tag_schemas(node: Any) -> list[Any]:
    """The ``json_schema`` of every ``json_schema`` format inside a structural tag's
    format tree."""
    found: list[Any] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if item.get("type") == "json_schema" and "json_schema" in item:
                found.append(item["json_schema"])
                continue
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
    return found


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema that is not valid JSON Schema (by its own metaschema)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise _error(f"json is not a valid JSON schema{' at ' + where if where else ''}: "
                     f"{exc.message}") from None


def _error(message: str) -> InvalidParamError:
    return InvalidParamError(message, param="structured_outputs")
