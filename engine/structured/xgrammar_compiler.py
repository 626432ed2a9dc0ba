"""The xgrammar compiler: a :class:`StructuredOutputs` as an ``xgrammar.CompiledGrammar``.

xgrammar is the first choice of ``auto`` and what ``xgrammar`` means. It is trusted only
with what it enforces (``check.xgrammar_gap``); what it refuses is :class:`Refused`, and
the backend (``backend.py``) may then try llguidance (``guidance.py``).

xgrammar is imported inside the functions that use it: a heavy optional library (about
2 s to import beside torch) that only a server with a grammar backend needs, while
``engine.structured`` is imported by every process that reads a request.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from engine.structured.check import xgrammar_gap
from engine.structured.compiled import THINK_GAP, Refused, first_line
from engine.structured.spec import StructuredOutputs, tag_schemas, think_prefix

logger = logging.getLogger("engine")


class XGrammarCompiler:
    """xgrammar's compiler over one tokenizer's tables (``hf``: a transformers fast
    tokenizer). Building the tables reads every vocabulary entry's bytes: about half a
    second for a 49k vocabulary."""

    def __init__(self, hf: Any, *, vocab_size: int, stop_token_ids: list[int] | None) -> None:
        import xgrammar  # lazy: see the module docstring

        t0 = time.perf_counter()
        # Kept to read back the grammars compile workers serialize (read_back).
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # Two compile threads: a compile runs in an admission worker thread beside the
        # model step; more would take cores from it (the dev machines have 2).
        self._compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        logger.info("xgrammar tokenizer info built in %.2f s", time.perf_counter() - t0)

    def compile(self, spec: StructuredOutputs) -> Any:
        """``spec``'s ``xgrammar.CompiledGrammar``; raises :class:`Refused` for what xgrammar
        would not enforce or cannot parse."""
        import xgrammar  # lazy: see the module docstring

        schemas = ([spec.schema] if spec.kind == "json" else
                   tag_schemas(json.loads(spec.text)) if spec.kind == "structural_tag" else [])
        for schema in schemas:
            gap = xgrammar_gap(schema)
            if gap is not None:
                raise Refused(gap)
        try:
            grammar = _xgrammar_grammar(spec)
            if spec.think is not None:
                grammar = xgrammar.Grammar.concat(_xgrammar_think(spec.think), grammar)
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise Refused(first_line(exc)) from None

    def read_back(self, data: Any) -> Any:
        """A grammar a compile worker serialized, read back against these tables."""
        import xgrammar  # lazy: see the module docstring

        return xgrammar.CompiledGrammar.deserialize_json(data, self.info)


# Two faults of xgrammar 0.2.8's JSON strings, patched in the grammar text it writes
# (found by the jsonschema oracle on the tiny model; same compile time, measured):
# * a string with minLength/maxLength repeats the class [^"\\\r\n], which lets raw
#   control characters (U+0000..U+001F) in: invalid JSON that json.loads and pydantic
#   refuse ("val\x12o");
# * every string class takes the 3-byte UTF-8 forms of surrogates (ED A0..BF xx), which no
#   decoder accepts: they decode as three U+FFFD, so a 6-character string came out 8 long.
_XGR_STRING_CHARS = (r'[^\0-\x1f\"\\\r\n]', r'[^\"\\\r\n]')
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n\ud800-\udfff]'


def _json_strings_fixed(ebnf: str) -> str:
    for bad in _XGR_STRING_CHARS:
        ebnf = ebnf.replace(bad, _JSON_STRING_CHARS)
    return ebnf


def _xgrammar_grammar(spec: StructuredOutputs) -> Any:
    """``spec``'s constraint as an ``xgrammar.Grammar`` (before any reasoning prefix)."""
    import xgrammar  # lazy: see the module docstring

    kind = spec.kind
    if kind in ("json", "json_object"):
        return xgrammar.Grammar.from_ebnf(_json_ebnf(
            spec.json if spec.json is not None else '{"type": "object"}'))
    if kind == "regex":
        return xgrammar.Grammar.from_regex(spec.text)
    if kind == "choice":
        return xgrammar.Grammar.from_ebnf(_choice_ebnf(spec.choice or ()))
    if kind == "structural_tag":
        tag = json.loads(spec.text)
        return xgrammar.Grammar.from_structural_tag(json.dumps(
            {**tag, "format": _schemas_as_grammars(tag["format"])}))
    return xgrammar.Grammar.from_ebnf(spec.text)


def _json_ebnf(schema: str) -> str:
    """A JSON schema's grammar as xgrammar writes it, with its string faults patched.
    Compact separators, no free whitespace: a small model given free whitespace can loop
    on newlines forever; the document means the same."""
    import xgrammar  # lazy: see the module docstring

    return _json_strings_fixed(str(xgrammar.Grammar.from_json_schema(
        schema, any_whitespace=False)))


def _schemas_as_grammars(node: Any) -> Any:
    """A structural tag's format tree with each ``json_schema`` format replaced by the
    ``grammar`` of :func:`_json_ebnf`: the same compact, patched JSON as a ``json``
    constraint gets (xgrammar's own tag JSON allows free whitespace and has the faults)."""
    if isinstance(node, list):
        return [_schemas_as_grammars(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        return {"type": "grammar", "grammar": _json_ebnf(json.dumps(node["json_schema"]))}
    return {k: _schemas_as_grammars(v) for k, v in node.items()}


def _xgrammar_think(think: str) -> Any:
    """The reasoning prefix of ``think`` (:func:`think_prefix`) as an xgrammar grammar:
    any text up to the first closing marker, opened by one of the opening markers where
    the mode is "optional" (the block is then optional as a whole)."""
    import xgrammar  # lazy: see the module docstring

    mode, starts, ends = think_prefix(think)
    block: dict[str, Any] = {"type": "tag", "begin": "", "content": {"type": "any_text"},
                             "end": ends[0] if len(ends) == 1 else list(ends)}
    elements: list[dict[str, Any]] = [block, {"type": "regex", "pattern": THINK_GAP}]
    if mode == "optional":
        opening = [{"type": "const_string", "value": m} for m in starts]
        elements.insert(0, opening[0] if len(opening) == 1 else {"type": "or",
                                                                 "elements": opening})
    prefix: dict[str, Any] = {"type": "sequence", "elements": elements}
    if mode == "optional":
        prefix = {"type": "optional", "content": prefix}
    return xgrammar.Grammar.from_structural_tag(
        json.dumps({"type": "structural_tag", "format": prefix}))


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    # GBNF string literals take JSON's escapes (\" \\ \n \uXXXX).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
