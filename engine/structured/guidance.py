"""The llguidance compiler: where xgrammar refuses a JSON schema under ``auto``, and
everything under ``guidance``. A :class:`StructuredOutputs` becomes llguidance's grammar
text (lark, or its JSON list of grammars).

llguidance is imported inside the methods that use it: a heavy optional library (seconds
to import) that ``auto`` rarely needs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.errors import InvalidParamError
from engine.structured.compiled import THINK_GAP, Refused, first_line
from engine.structured.spec import StructuredOutputs, think_prefix

logger = logging.getLogger("engine")


class GuidanceCompiler:
    """llguidance over one tokenizer (``hf``: a transformers fast tokenizer), whose tables
    are built on first use. Thread-safe."""

    def __init__(self, hf: Any, *, vocab_size: int, stop_token_ids: list[int] | None) -> None:
        self._hf = hf
        self._vocab_size = vocab_size
        self._stop_ids = stop_token_ids
        self._tok: Any = None
        self._lock = threading.Lock()

    def tokenizer(self) -> Any:
        """llguidance's tokenizer, built on first use (``auto`` rarely needs it)."""
        with self._lock:
            if self._tok is None:
                try:
                    import llguidance.hf  # lazy: see the module docstring
                except ImportError as exc:
                    raise InvalidParamError(
                        "the guidance backend needs the llguidance package, which is not "
                        "installed", param="structured_outputs_backend") from exc
                t0 = time.perf_counter()
                self._tok = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self._vocab_size, eos_token=self._stop_ids)
                logger.info("llguidance tokenizer built in %.2f s", time.perf_counter() - t0)
            return self._tok

    def literal(self, text: str) -> str:
        """``text`` as a lark literal. llguidance holds every added token as a special
        token, which a quoted string does not match; a marker that is one (Qwen's
        ``</think>``, ``<tool_call>``) may be written as that token or spelled out."""
        tok = self.tokenizer()
        ids = tok.tokenize_str(text)
        if len(ids) == 1 and tok.is_special_token(ids[0]):
            return f"({json.dumps(text)} | <[{ids[0]}]>)"
        if any(tok.is_special_token(i) for i in ids):
            # Special tokens and text (harmony's "<|end|><|start|>assistant..."): each
            # special token as itself, the text between as written.
            parts: list[str] = []
            run: list[int] = []
            for i in [*ids, -1]:
                if i != -1 and not tok.is_special_token(i):
                    run.append(i)
                    continue
                if run:
                    parts.append(json.dumps(self._hf.decode(run)))
                    run = []
                if i != -1:
                    parts.append(f"<[{i}]>")
            return "(" + " ".join(parts) + ")"
        return json.dumps(text)

    def compile(self, spec: StructuredOutputs) -> str:
        """``spec``'s grammar text, validated against the tokenizer; raises
        :class:`Refused` for what llguidance cannot take or would only partly enforce."""
        import llguidance  # lazy: see the module docstring

        grammar = self._grammar(spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer())
        if failed or messages:
            # A warning here is a schema feature it would skip ("Unimplemented keys"):
            # refused, as an unenforced keyword is for xgrammar.
            raise Refused("; ".join(first_line(m) for m in messages) or "invalid grammar")
        return grammar

    def _grammar(self, spec: StructuredOutputs) -> str:
        import llguidance  # lazy: see the module docstring

        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = spec.json if spec.json is not None else '{"type": "object"}'
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
            elif kind == "choice":
                grammar = llguidance.LLMatcher.grammar_from_lark(_choice_lark(spec.choice or ()))
            elif kind == "structural_tag":
                grammar = llguidance.LLMatcher.grammar_from_lark(
                    _tag_lark(json.loads(spec.text)["format"], self.literal))
            else:
                from llguidance.gbnf_to_lark import gbnf_to_lark  # lazy: see the module docstring

                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text))
            if spec.think is not None:
                grammar = _guidance_think(spec.think, grammar, self.literal)
        except Exception as exc:  # gbnf_to_lark raises its own error class
            raise Refused(first_line(exc)) from None
        return grammar


def _guidance_think(think: str, grammar: str, literal: Callable[[str], str]) -> str:
    """llguidance's ``grammar`` behind the reasoning prefix of ``think``
    (:func:`think_prefix`): free text up to the first closing marker (a lazy lexeme, or
    text then the marker's token), then the constraint as a sub-grammar. ``literal``
    writes a marker as a lark literal."""
    mode, starts, ends = think_prefix(think)
    # grammar_from_lark gives the lark text back; the others a JSON list of grammars.
    top = (json.loads(grammar) if grammar.lstrip().startswith("{")
           else {"grammars": [{"lark_grammar": grammar}]})
    inner = top["grammars"]
    name = inner[0].get("name") or "constraint"
    inner[0] = {**inner[0], "name": name}
    # "open" takes a leading opening marker too (as the deepseek_r1 parser does); the free
    # text would, but not when the marker is a special token.
    opening = " | ".join(literal(m) for m in starts)
    opening = f"({opening})" if len(starts) > 1 else opening
    start = f"{opening}? think GAP" if mode == "open" else f"({opening} think GAP)?"
    lark = "\n".join([
        "%llguidance {}", f"start: {start} @{name}", *_until("think", ends, literal),
        f"GAP: /{THINK_GAP}/", "TEXT: /(.|\\n)*/"]) + "\n"
    return json.dumps({**top, "grammars": [{"lark_grammar": lark}, *inner]})


def _until(rule: str, markers: str | tuple[str, ...], literal: Callable[[str], str]) -> list[str]:
    """Lark rules for ``rule``: any text up to and including the first of ``markers``.
    A spelled-out marker ends a lazy lexeme (the shortest match); a marker that is a
    special token follows free text, which cannot contain it."""
    markers = (markers,) if isinstance(markers, str) else markers
    spelled = [json.dumps(m) for m in markers]
    tokens = []
    for w, s in zip((literal(m) for m in markers), spelled, strict=True):
        if w.startswith(f"({s} | "):
            tokens.append(w[len(s) + 4:-1])  # "(<spelled> | <[id]>)" -> "<[id]>"
        elif w != s:
            tokens.append(w)  # special tokens and text: as they are
    ending = spelled[0] if len(spelled) == 1 else f"({' | '.join(spelled)})"
    if not tokens:
        return [f"{rule}[lazy]: TEXT {ending}"]
    return [f"{rule}: {rule}_text | " + " | ".join(f"TEXT {t}" for t in tokens),
            f"{rule}_text[lazy]: TEXT {ending}"]


def _tag_lark(node: dict[str, Any], literal: Callable[[str], str]) -> str:
    """A structural tag's format as an llguidance lark grammar, for the formats the chat
    layer writes. A trigger and the text before it are one :func:`_until` rule, the rest
    follows the format tree. ``literal`` writes a string as a lark literal."""
    rules: list[str] = []

    def expr(n: Any) -> str:
        kind = n.get("type") if isinstance(n, dict) else None
        if kind == "const_string":
            return literal(n["value"])
        if kind == "regex" and "/" not in n["pattern"]:
            return f"/{n['pattern']}/"
        if kind == "json_schema":
            return "%json " + json.dumps({**n["json_schema"],
                                          "x-guidance": {"whitespace_flexible": False}})
        if kind == "sequence":
            return "(" + " ".join(expr(e) for e in n["elements"]) + ")"
        if kind == "or":
            return "(" + " | ".join(expr(e) for e in n["elements"]) + ")"
        if kind == "tag" and isinstance(n.get("begin"), str) and isinstance(n.get("end"), str):
            return " ".join(x for x in (literal(n["begin"]) if n["begin"] else "",
                                        expr(n["content"]),
                                        literal(n["end"]) if n["end"] else "") if x)
        if kind == "triggered_tags" and not n.get("excludes"):
            return triggered(n)
        if kind == "tags_with_separator":
            tag = "(" + " | ".join(expr(t) for t in n["tags"]) + ")"
            sep = literal(n["separator"]) + " " if n["separator"] else ""
            body = tag if n.get("stop_after_first") else f"({tag} ({sep}{tag})*)"
            return body if n.get("at_least_one") else f"({body})?"
        raise ValueError(f"structural tag format {kind!r} is not translated for llguidance")

    def triggered(n: dict[str, Any]) -> str:
        options = []
        for i, trigger in enumerate(n["triggers"]):
            rules.extend(_until(f"open_{i}", trigger, literal))
            for tag in n["tags"]:
                if isinstance(tag.get("begin"), str) and tag["begin"].startswith(trigger):
                    rest = {**tag, "begin": tag["begin"][len(trigger):]}
                    options.append(f"(open_{i} {expr(rest)})")
        call = "(" + " | ".join(options) + ")"
        if n.get("stop_after_first"):
            return call if n.get("at_least_one") else f"({call} | TEXT)"
        return f"({call}{'+' if n.get('at_least_one') else '*'} TEXT)"

    start = expr(node)
    return "\n".join(["%llguidance {}", f"start: {start}", *rules, "TEXT: /(.|\\n)*/"]) + "\n"


def _choice_lark(choices: tuple[str, ...]) -> str:
    return "start: " + " | ".join(json.dumps(c) for c in choices)
