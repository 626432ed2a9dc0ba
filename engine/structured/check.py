"""What a constraint must pass before any grammar library sees it: fail closed.

Pure (no I/O; ``jsonschema`` and Python's regex parser only). Two kinds of verdict:

* :func:`check_json_schema`, :func:`check_regex` and :func:`check_choice` raise
  :class:`InvalidParamError` for a constraint no backend may take: a ``$ref`` that is
  remote, relative or unresolvable, a ``$ref`` cycle (or a required property) with no base
  case, an ``enum``/``const`` no value of which fits the rest of its schema, a draft whose
  keywords mean something else (draft-03/04), a regex anchor in the middle of a pattern
  (``a$b``: xgrammar drops the anchor and matches ``ab``), a choice holding a special
  token's text (its tokens never reach the output text). Each message names the construct
  and where it is.
* :func:`xgrammar_gap` says why xgrammar 0.2.8 would not enforce a schema exactly (``None``
  when it would): it takes only the keywords of :data:`XGRAMMAR_KEYWORDS`, under the
  conditions checked there, each found by feeding its matcher documents that break the
  keyword (tests/test_structured_fail_closed.py keeps them). Under ``auto`` such a schema
  goes to llguidance, which enforces it or refuses it itself.

``docs/serving.md`` ("Structured output") lists the subset these functions admit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from engine.errors import InvalidParamError

# Keywords that only describe (no effect on which documents validate).
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "contentMediaType", "contentEncoding", "contentSchema",
    "discriminator",  # OpenAPI's (pydantic writes it beside a oneOf); an annotation here
})
# The keywords of JSON Schema 2020-12 (and of the drafts before it) that constrain. A key
# of a schema object outside these and ANNOTATIONS is an unknown keyword, which JSON
# Schema (and ``jsonschema``) ignore: it constrains nothing, so it is allowed.
CONSTRAINING = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties",
    "patternProperties", "propertyNames", "minProperties", "maxProperties",
    "dependentRequired", "dependentSchemas", "dependencies", "items", "prefixItems",
    "additionalItems", "contains", "minContains", "maxContains", "minItems", "maxItems",
    "uniqueItems", "unevaluatedItems", "unevaluatedProperties", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "anyOf", "allOf", "oneOf", "not", "if", "then", "else", "$ref", "$defs",
    "definitions", "$id", "id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
    "$recursiveAnchor", "$vocabulary", "extends", "disallow", "divisibleBy",
})
# Refused for every backend: keywords of older drafts whose meaning differs from
# 2020-12's, and dynamic references (neither library resolves them).
REFUSED = frozenset({"additionalItems", "dependencies", "$dynamicRef", "$dynamicAnchor",
                     "$recursiveRef", "$recursiveAnchor", "$vocabulary", "extends", "disallow",
                     "divisibleBy", "id"})
# The drafts whose keywords this module reads as 2020-12's (draft-04's exclusiveMinimum is
# a boolean, draft-03's required a boolean per property: refused).
SCHEMA_DRAFTS = frozenset({
    "https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2019-09/schema",
    "http://json-schema.org/draft-07/schema", "http://json-schema.org/draft-06/schema",
})
# What xgrammar 0.2.8 enforces exactly (each checked against a violating document): the
# rest it ignores (contains, propertyNames, ...), approximates (oneOf as anyOf, allOf of
# several schemas as its first), or reads only in part (maxProperties, patternProperties).
XGRAMMAR_KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf",
    "allOf", "$ref", "$defs", "definitions", "$id",
})
# The string formats xgrammar enforces (others it lets any string through).
XGRAMMAR_FORMATS = frozenset({"date", "time", "date-time", "email", "uuid", "uri", "ipv4",
                              "ipv6", "hostname", "duration"})
JSON_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "propertyNames", "not", "if",
              "then", "else", "unevaluatedItems", "unevaluatedProperties", "additionalItems",
              "contentSchema")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
# A regex that can match at most this many characters is bounded (for min_tokens).
_UNBOUNDED = 1 << 30


def _error(message: str, param: str = "structured_outputs") -> InvalidParamError:
    return InvalidParamError(message, param=param)


def subschemas(schema: Any, path: str = "#") -> Iterator[tuple[str, Any]]:
    """Every schema inside ``schema`` (itself first), with its JSON pointer."""
    stack = [(path, schema)]
    while stack:
        where, node = stack.pop()
        yield where, node
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            here = f"{where}/{_escape(key)}"
            if key in _SUBSCHEMA and isinstance(value, (dict, bool)):
                stack.append((here, value))
            elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
                stack.extend((f"{here}/{i}", v) for i, v in enumerate(value))
            elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
                stack.extend((f"{here}/{_escape(k)}", v) for k, v in value.items())


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# -- JSON schema ---------------------------------------------------------------------------


def check_json_schema(schema: dict[str, Any]) -> None:
    """Refuse what no backend may take (see the module's docstring). ``schema`` has passed
    its metaschema (:func:`engine.structured.spec.check_schema`)."""
    draft = schema.get("$schema")
    if draft is not None and str(draft).rstrip("#") not in SCHEMA_DRAFTS:
        raise _error(f"json: $schema {draft!r} is not supported; give a 2020-12, 2019-09, "
                     "draft-07 or draft-06 schema (or none)")
    anchors: dict[str, Any] = {}
    for where, node in subschemas(schema):
        if not isinstance(node, dict):
            continue
        refused = sorted(set(node) & REFUSED)
        if refused:
            raise _error(f"json: the keyword {refused[0]} at {where} is not supported")
        if isinstance(node.get("items"), list):
            raise _error(f"json: items as a list (draft-07 tuples) at {where} is not "
                         "supported; use prefixItems")
        if "$id" in node and where != "#":
            raise _error(f"json: $id at {where} is not supported (only on the root schema): "
                         "it changes the base that $refs resolve against")
        if isinstance(node.get("$anchor"), str):
            anchors[node["$anchor"]] = node
        for name in ("pattern",):
            if isinstance(node.get(name), str):
                _check_anchors(node[name], f"json: pattern at {where}")
        for key in node.get("patternProperties") or {}:
            _check_anchors(key, f"json: patternProperties key at {where}")
    refs = _Refs(schema, anchors)
    for where, node in subschemas(schema):
        if isinstance(node, dict) and "$ref" in node:
            refs.resolve(node["$ref"], where)
    _check_productive(schema, refs)
    _check_enums(schema)


class _Refs:
    """Resolves the local ``$ref`` forms: ``#``, ``#/json/pointer`` and ``#anchor``."""

    def __init__(self, root: dict[str, Any], anchors: dict[str, Any]) -> None:
        self.root = root
        self.anchors = anchors

    def resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise _error(f"json: $ref {ref!r} at {where} is not supported: only references "
                         "inside the schema ('#', '#/$defs/name', '#anchor') resolve, nothing "
                         "is fetched")
        fragment = ref[1:]
        if fragment and not fragment.startswith("/"):
            if fragment not in self.anchors:
                raise _error(f"json: $ref {ref!r} at {where} names no $anchor of the schema")
            return self.anchors[fragment]
        node: Any = self.root
        for part in fragment.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _error(f"json: $ref {ref!r} at {where} does not resolve")
        if not isinstance(node, (dict, bool)):
            raise _error(f"json: $ref {ref!r} at {where} does not point at a schema")
        return node


def _check_productive(schema: Any, refs: _Refs) -> None:
    """Refuse a schema no finite document satisfies through its structure: a ``$ref``
    cycle with no base case (``{"$ref": "#"}``, ``a -> b -> a``, a property that requires
    the whole schema again), a required property that ``additionalProperties: false``
    forbids, ``minItems`` over ``items: false``. A least fixpoint: a schema is productive
    once some finite document is known to fit its structure."""
    nodes = [(w, n) for w, n in subschemas(schema) if isinstance(n, dict)]
    # A worklist, not passes until nothing changes: a chain of n $refs in adversarial
    # order would take n passes over n nodes (a 64 KiB schema holds thousands).
    users: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for where, node in nodes:
        for sub in _children(node, refs, where):
            users.setdefault(id(sub), []).append((where, node))
    productive: set[int] = set()
    work = list(nodes)
    while work:
        where, node = work.pop()
        if id(node) not in productive and _productive(node, productive, refs, where):
            productive.add(id(node))
            work.extend(users.get(id(node), ()))
    if not _is(schema, productive, refs, "#"):
        stuck = [w for w, n in nodes if id(n) not in productive]
        raise _error("json: no finite JSON document fits the schema: "
                     f"{_why_unproductive(schema, refs, stuck)}")


def _children(node: dict[str, Any], refs: _Refs, where: str) -> Iterator[Any]:
    """The schemas whose productivity ``node``'s depends on."""
    if "$ref" in node:
        yield refs.resolve(node["$ref"], where)
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        yield from node.get(key, [])
    yield from node.get("properties", {}).values()
    for key in ("additionalProperties", "items"):
        if key in node:
            yield node[key]


def _is(node: Any, productive: set[int], refs: _Refs, where: str) -> bool:
    if isinstance(node, bool):
        return node
    return isinstance(node, dict) and id(node) in productive


def _productive(node: dict[str, Any], productive: set[int], refs: _Refs, where: str) -> bool:
    def ok(sub: Any) -> bool:
        return _is(sub, productive, refs, where)

    if "$ref" in node and not ok(refs.resolve(node["$ref"], where)):
        return False
    if not all(ok(s) for s in node.get("allOf", [])):
        return False
    for key in ("anyOf", "oneOf"):
        if key in node and not any(ok(s) for s in node[key]):
            return False
    if "enum" in node or "const" in node:
        return True  # literal values (whether they fit is _check_enums')
    types = node.get("type", JSON_TYPES)
    types = [types] if isinstance(types, str) else types
    return any(_type_productive(t, node, ok) for t in types)


def _type_productive(kind: str, node: dict[str, Any], ok: Any) -> bool:
    if kind == "object":
        props = node.get("properties", {})
        extra = node.get("additionalProperties", True)
        return all(ok(props[p]) if p in props else ok(extra) for p in node.get("required", []))
    if kind == "array":
        prefix = node.get("prefixItems", [])
        items = node.get("items", True)
        need = node.get("minItems", 0)
        return all(ok(prefix[i] if i < len(prefix) else items) for i in range(min(need, 1024)))
    return True


def _why_unproductive(schema: Any, refs: _Refs, stuck: list[str]) -> str:
    """A message for :func:`_check_productive`: the ``$ref`` cycle when there is one, else
    the deepest schema that cannot be completed."""
    by_id = {id(n): w for w, n in subschemas(schema) if isinstance(n, dict)}
    for where, node in subschemas(schema):
        seen: list[str] = []
        while isinstance(node, dict) and "$ref" in node and where not in seen:
            seen.append(where)
            node = refs.resolve(node["$ref"], where)
            where = by_id.get(id(node), "?")
        if isinstance(node, dict) and where in seen:
            cycle = seen[seen.index(where):] + [where]
            return "a $ref cycle with no base case (" + " -> ".join(cycle) + ")"
    deepest = max(stuck, key=len) if stuck else "#"
    return (f"the schema at {deepest} can never be completed (a $ref cycle with no base case, "
            "or a required property that no value fits)")


def _check_enums(schema: dict[str, Any]) -> None:
    """An ``enum``/``const`` none of whose values fits the rest of its schema (``{"type":
    "integer", "enum": ["a"]}``) admits nothing."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    for where, node in subschemas(schema):
        if isinstance(node, dict) and ("enum" in node or "const" in node):
            values = node["enum"] if "enum" in node else [node["const"]]
            sub = validator.evolve(schema=node)
            if not any(sub.is_valid(v) for v in values):
                key = "enum" if "enum" in node else "const"
                raise _error(f"json: no value of the {key} at {where} fits the rest of its "
                             "schema (type, bounds, pattern, ...)")


def _fits_enum(schema: dict[str, Any], node: dict[str, Any]) -> bool:
    import jsonschema

    sub = jsonschema.validators.validator_for(schema)(schema).evolve(schema=node)
    values = node["enum"] if "enum" in node else [node["const"]]
    return all(sub.is_valid(v) for v in values)


def xgrammar_gap(schema: Any) -> str | None:
    """Why xgrammar 0.2.8 would not enforce ``schema`` exactly, or None when it would."""
    if not isinstance(schema, dict):
        return None
    for where, node in subschemas(schema):
        if not isinstance(node, dict):
            continue
        known = set(node) & CONSTRAINING
        extra = sorted(known - XGRAMMAR_KEYWORDS)
        if extra:
            return f"it does not enforce {extra[0]} (at {where})"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"it keeps only the first schema of allOf (at {where})"
        ref = node.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            return f"it resolves no $ref {ref!r} (at {where})"
        props = node.get("properties", {})
        missing = [p for p in node.get("required", []) if p not in props]
        if missing:
            return f"it drops required {missing[0]!r}, which properties does not list (at {where})"
        fmt = node.get("format")
        if fmt is not None and fmt not in XGRAMMAR_FORMATS:
            return f"it does not enforce format {fmt!r} (at {where})"
        if "multipleOf" in node and node.get("type") != "integer":
            return f"it enforces multipleOf on integers only (at {where})"
        bounds = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(node)
        if "multipleOf" in node and bounds:
            # "range + multipleOf combination not yet supported; ignoring multipleOf"
            return f"it drops multipleOf beside {sorted(bounds)[0]} (at {where})"
        if ("enum" in node or "const" in node) and set(node) & (CONSTRAINING - {"enum", "const"}):
            if not _fits_enum(schema, node):
                return f"it writes enum/const values that break the rest of their schema (at {where})"
    return None


# -- regex, choice -------------------------------------------------------------------------


def check_regex(pattern: str) -> None:
    """Refuse anchors (``^``, ``$``) anywhere but the start or the end of the pattern:
    xgrammar drops them with a warning (``a$b`` matches ``ab``), llguidance refuses them."""
    _check_anchors(pattern, "regex")


def _check_anchors(pattern: str, what: str) -> None:
    from re import _parser  # type: ignore[attr-defined]  # the stdlib's regex parser

    try:
        tree = _parser.parse(pattern)
    except (re.error, OverflowError, RecursionError):
        # Not Python syntax (an ECMAScript form): every anchor must be the first or last
        # character, outside a class.
        for i, ch in enumerate(_unescaped_outside_class(pattern)):
            if (ch == "^" and i != 0) or (ch == "$" and i != len(pattern) - 1):
                raise _error(f"{what}: the anchor {ch!r} at offset {i} is in the middle of "
                             "the pattern; anchors may only open or close it") from None
        return
    _walk_anchors(list(tree), True, True, what)


def _unescaped_outside_class(pattern: str) -> list[str]:
    """``pattern`` with escaped characters and character classes blanked."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.extend("  ")
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
            out.append(" ")
        elif ch == "[":
            in_class = True
            out.append(" ")
        else:
            out.append(ch)
        i += 1
    return out[: len(pattern)]


def _walk_anchors(items: list[Any], lead: bool, trail: bool, what: str) -> None:
    from re import _constants as c  # type: ignore[attr-defined]

    width = [op is not c.AT for op, _ in items]  # zero-width items do not move the position
    for i, (op, arg) in enumerate(items):
        at_lead = lead and not any(width[:i])
        at_trail = trail and not any(width[i + 1:])
        if op is c.AT:
            if arg in (c.AT_BEGINNING, c.AT_BEGINNING_STRING) and not at_lead:
                raise _error(f"{what}: '^' in the middle of the pattern matches nothing there "
                             "and is not enforced; anchors may only open or close it")
            if arg in (c.AT_END, c.AT_END_STRING) and not at_trail:
                raise _error(f"{what}: '$' in the middle of the pattern matches nothing there "
                             "and is not enforced; anchors may only open or close it")
        elif op is c.SUBPATTERN:
            _walk_anchors(list(arg[-1]), at_lead, at_trail, what)
        elif op is c.BRANCH:
            for branch in arg[1]:
                _walk_anchors(list(branch), at_lead, at_trail, what)
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            once = arg[1] <= 1
            _walk_anchors(list(arg[2]), at_lead and once, at_trail and once, what)
        elif op in (c.ASSERT, c.ASSERT_NOT, c.ATOMIC_GROUP):
            _walk_anchors(list(arg[-1]), False, False, what)


def regex_max_chars(pattern: str) -> int | None:
    """The most characters ``pattern`` can match, or None when unbounded or unknown."""
    from re import _parser  # type: ignore[attr-defined]

    try:
        most = _parser.parse(pattern).getwidth()[1]
    except (re.error, OverflowError, RecursionError):
        return None
    return most if most < _UNBOUNDED else None


def check_choice(choices: tuple[str, ...], special_tokens: frozenset[str]) -> None:
    """Refuse a choice that holds a special token's text: the constrained output never
    holds special tokens (they vanish from its text), so such a choice cannot be written."""
    for choice in choices:
        for token in special_tokens:
            if token and token in choice:
                raise _error(f"choice {choice!r} holds the special token {token!r}, which the "
                             "output text cannot hold", param="structured_outputs.choice")


def max_output_bytes(kind: str, text: str, choices: tuple[str, ...] | None) -> int | None:
    """The most UTF-8 bytes a ``regex`` or ``choice`` output can have (None: unbounded or
    another kind). Every token the grammar takes writes at least one byte, so a request
    whose ``min_tokens`` exceeds this reaches a dead end: refused at admission."""
    if kind == "choice" and choices:
        return max(len(c.encode("utf-8")) for c in choices)
    if kind == "regex":
        most = regex_max_chars(text)
        return None if most is None else 4 * most  # UTF-8: at most 4 bytes a character
    return None


# -- oneOf whose branches cannot overlap ---------------------------------------------------


def disjoint_one_of(schema: Any) -> Any:
    """``schema`` with every ``oneOf`` whose branches provably never both match written as
    ``anyOf`` (the same language; both backends enforce ``anyOf``, neither ``oneOf``).
    Provably: the branches' types are pairwise disjoint (``integer`` inside ``number``),
    or they are all objects requiring one property whose ``const``/``enum`` strings,
    booleans or nulls differ (a discriminated union, as pydantic writes one). Any other
    ``oneOf`` is left for the backends to refuse."""
    if not isinstance(schema, dict):
        return schema
    refs = _Refs(schema, {})

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items()}
        branches = node.get("oneOf")
        if isinstance(branches, list) and "anyOf" not in node and _disjoint(branches, refs):
            out["anyOf"] = out.pop("oneOf")
        return out

    return walk(schema)


def _resolved(node: Any, refs: _Refs) -> Any:
    for _ in range(32):  # a chain of refs; a longer one is not proven anything
        if not (isinstance(node, dict) and set(node) - ANNOTATIONS == {"$ref"}):
            return node
        try:
            node = refs.resolve(node["$ref"], "oneOf")
        except InvalidParamError:
            return None
    return None


def _value_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, (int, float)):
        return {"number", "integer"}  # 1 and 1.0 are equal and both integers
    return {"string"} if isinstance(value, str) else {"array" if isinstance(value, list) else "object"}


def _types(node: Any) -> set[str] | None:
    """The JSON types a branch can match, or None when it is not known."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return _value_types(node["const"])
    if "enum" in node and isinstance(node["enum"], list):
        return set().union(*(_value_types(v) for v in node["enum"])) if node["enum"] else set()
    types = node.get("type")
    if types is None or set(node) & {"anyOf", "oneOf", "allOf", "$ref", "not", "if"}:
        return None
    found = {types} if isinstance(types, str) else set(types)
    if "number" in found:
        found.add("integer")
    if "integer" in found:
        found.add("number")
    return found


def _disjoint(branches: list[Any], refs: _Refs) -> bool:
    nodes = [_resolved(b, refs) for b in branches]
    kinds = [_types(n) for n in nodes]
    if all(k is not None for k in kinds):
        seen: set[str] = set()
        for k in kinds:
            assert k is not None
            if k & seen:
                break
            seen |= k
        else:
            return True
    return _discriminated(nodes, refs)


def _discriminated(nodes: list[Any], refs: _Refs) -> bool:
    if not all(isinstance(n, dict) and n.get("type") == "object" for n in nodes):
        return False
    shared = set.intersection(*(set(n.get("required", [])) for n in nodes))
    for name in sorted(shared):
        seen: set[str] = set()
        for node in nodes:
            prop = _resolved(node.get("properties", {}).get(name), refs)
            values = ([prop["const"]] if isinstance(prop, dict) and "const" in prop else
                      prop.get("enum") if isinstance(prop, dict) else None)
            if not isinstance(values, list) or not all(
                    v is None or isinstance(v, (str, bool)) for v in values):
                break
            keys = {json.dumps(v) for v in values}
            if keys & seen:
                break
            seen |= keys
        else:
            return True
    return False
