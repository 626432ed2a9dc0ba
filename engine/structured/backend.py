"""Grammar compilation and matching for structured output, over xgrammar and llguidance.

:class:`GrammarBackend` is built once per engine at model load, from the model's tokenizer
(the backends' tokenizer info reads every vocabulary entry's bytes: about half a second for
a 49k vocabulary). It compiles a :class:`StructuredOutputs` into a grammar, once per
distinct spec (an LRU cache keyed by ``spec.key``; concurrent compiles of one key wait for
the first), and makes a :class:`Matcher` per sample from a compiled grammar.

Thread-safety: :meth:`GrammarBackend.compile` may run in any thread (admission runs it in a
worker thread); a :class:`Matcher` belongs to the one thread that drives the model runner.

Both backends fill the same bitmask layout: one int32 row of ``ceil(vocab / 32)`` words per
sample, token ``t`` allowed iff bit ``t % 32`` of word ``t // 32`` is set::

    word:   0                   1                        W - 1
    bits:   t0 t1 ... t31  |  t32 t33 ... t63  |  ...  |  ... t(V-1) [padding bits]
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.errors import InvalidParamError
from engine.structured.check import check_choice, xgrammar_gap
from engine.structured.spec import StructuredOutputs, tag_schemas

logger = logging.getLogger("engine")

BACKENDS = ("auto", "xgrammar", "guidance")
# Compiled grammars kept: an xgrammar JSON-schema grammar is tens of KiB to a few MiB
# (its per-token mask cache); 256 distinct specs cover a server's working set of tool and
# response schemas without holding unbounded memory for one-off ones.
CACHE_SIZE = 256
# Upper bounds of the compile-time histogram, in seconds: a cached compile is ~0.1 ms, a
# small schema on SmolLM2's vocabulary ~60 ms, a large one seconds.
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar ready to make matchers: ``backend`` is ``"xgrammar"`` or ``"guidance"``."""

    backend: str
    handle: Any  # xgrammar.CompiledGrammar, or llguidance's grammar text
    seconds: float  # how long the compile took


@dataclasses.dataclass(frozen=True, slots=True)
class StructuredStatistics:
    """Cumulative counters of one :class:`GrammarBackend` (a frozen snapshot)."""

    requests: dict[str, int]  # structured requests admitted, by kind
    compiles: int  # grammars actually compiled (cache misses)
    cache_hits: int
    compile_seconds_sum: float
    compile_buckets: tuple[int, ...]  # cumulative counts per COMPILE_BUCKETS bound, then +Inf


class Matcher:
    """One sample's position in its grammar. ``accept`` each sampled token in order;
    ``fill`` writes the tokens allowed next into a bitmask row. EOS is allowed only where
    the grammar accepts; accepting it terminates the matcher."""

    __slots__ = ("_m", "_guidance", "_stop_ids", "_keep", "accepted", "ended")

    def __init__(self, compiled: CompiledGrammar, stop_ids: frozenset[int],
                 guidance_tokenizer: Any = None, keep: torch.Tensor | None = None) -> None:
        self._guidance = compiled.backend == "guidance"
        self._stop_ids = stop_ids
        self._keep = keep  # int32 words ANDed into each mask row (None: all tokens kept)
        self._m: Any  # llguidance.LLMatcher or xgrammar.GrammarMatcher
        if self._guidance:
            import llguidance

            self._m = llguidance.LLMatcher(guidance_tokenizer, compiled.handle)
        else:
            import xgrammar

            self._m = xgrammar.GrammarMatcher(compiled.handle)
        self.accepted = 0  # tokens accepted so far
        # A stop token was accepted: the sample is over, and no mask may be asked for
        # (xgrammar raises). A grammar that is complete but has not seen EOS yet is not
        # ended: its mask then allows the stop tokens only.
        self.ended = False

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if the grammar does not allow it."""
        ok = bool(self._m.consume_token(token) if self._guidance else self._m.accept_token(token))
        if ok:
            self.accepted += 1
            self.ended = token in self._stop_ids
        return ok

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` (a speculative proposal) the grammar takes from
        here, counting none from the first stop token on (nothing can be masked after
        one); the matcher is left where it was."""
        tokens = list(tokens)
        cut = next((i for i, t in enumerate(tokens) if t in self._stop_ids), len(tokens))
        if self._guidance:
            return int(self._m.validate_tokens(tokens[:cut]))
        n = 0
        while n < cut and self._m.accept_token(tokens[n]):
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (a matcher ended by a stop token is not
        ended any more once that token is undone)."""
        if n < 0 or n > self.accepted:
            raise ValueError(f"cannot roll back {n} of {self.accepted} accepted tokens")
        if n:
            self._m.rollback(n)
            self.accepted -= n
            self.ended = False

    def complete(self) -> bool:
        """Whether the tokens accepted so far form a whole output (EOS may follow)."""
        return bool(self._m.is_accepting() if self._guidance else self._m.is_completed())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, on the CPU)."""
        if self._guidance:
            import llguidance.torch

            llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)
        if self._keep is not None:
            bitmask[row] &= self._keep


def _clear_bits(words: int, ids: list[int]) -> torch.Tensor:
    """An int32 bitmask row with every bit set but those of ``ids``."""
    import numpy as np

    row = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
    for i in ids:
        row[i // 32] &= np.uint32(~(1 << (i % 32)) & 0xFFFFFFFF)
    return torch.from_numpy(row.view(np.int32).copy())


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t]`` to -inf, in place, for every token ``t`` that bitmask row ``i``
    forbids, where ``r = rows[i]``. ``logits`` is fp32 [B, V]; ``bitmask`` int32
    [len(rows), W] on the CPU (moved to the logits' device here). xgrammar's kernels do the
    work: C++ on the CPU, Triton/CUDA on a GPU."""
    import xgrammar

    if not rows:
        return
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        return
    # Rows of the batch that have no constraint stay untouched: the mask rows are spread to
    # their batch rows (indices) rather than padding a full-batch mask.
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32,
                      device=bitmask.device)
    full[torch.tensor(rows, device=bitmask.device)] = bitmask
    xgrammar.apply_token_bitmask_inplace(logits, full, indices=rows)


class GrammarBackend:
    """Compiles specs (cached) and makes matchers, for one model's tokenizer.

    ``backend``: ``"xgrammar"``, ``"guidance"`` (llguidance) or ``"auto"`` (xgrammar, and
    llguidance for what xgrammar refuses or would not enforce, as vLLM's ``auto``).
    ``vocab_size`` is the model's (the logits' width, which may exceed the tokenizer's);
    ``stop_token_ids`` the ids that end generation (EOS), allowed only where the grammar is
    complete.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_token_ids: tuple[int, ...],
                 backend: str = "auto", cache_size: int = CACHE_SIZE) -> None:
        if backend not in BACKENDS:
            raise InvalidParamError(f"structured_outputs_backend must be one of {BACKENDS}, "
                                    f"got {backend!r}", param="structured_outputs_backend")
        self.backend = backend
        self.vocab_size = vocab_size
        self._stop_ids = list(stop_token_ids) or None
        self._stop_set = frozenset(stop_token_ids)
        self._hf = _hf_tokenizer(tokenizer)
        # Special tokens (those decode(skip_special_tokens=True) drops) other than the stop
        # tokens: xgrammar lets a grammar's literal text be written as one ("<|im_end|>" in
        # a choice came out as ''), so they are masked out of every constrained step.
        skipped = sorted(i for i in getattr(tokenizer, "skipped_special_ids", ())
                         if 0 <= i < vocab_size)
        self._special_texts = frozenset(
            t for t in (self._hf.convert_ids_to_tokens(i) for i in skipped) if t)
        self._skipped = skipped
        special = [i for i in skipped if i not in self._stop_set]
        self._no_special = _clear_bits(bitmask_words(vocab_size), special) if special else None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str, str], CompiledGrammar] = (
            collections.OrderedDict())
        self._pending: dict[tuple[str, str, str], threading.Event] = {}
        self._cache_size = cache_size
        self._requests: collections.Counter[str] = collections.Counter()
        self._compiles = 0
        self._hits = 0
        self._seconds = 0.0
        self._buckets = [0] * (len(COMPILE_BUCKETS) + 1)
        self._xgr: Any = None
        self._xgr_info: Any = None  # xgrammar.TokenizerInfo, to read back worker grammars
        self._guidance_tok: Any = None
        self._guidance_lock = threading.Lock()
        if backend in ("auto", "xgrammar"):
            self._xgr = self._xgrammar_compiler()
        else:
            self._guidance_tokenizer()

    # -- public ---------------------------------------------------------------------------

    def compile(self, spec: StructuredOutputs, *, count: bool = True) -> CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache or compiled now (blocking: run it
        off the trio thread when :meth:`is_cached` is false). ``count`` counts it as one
        structured request (admission does; the runner's lookups do not). Raises
        :class:`InvalidParamError` (``param="structured_outputs"``) when no backend takes it.
        """
        key = spec.key
        if count:
            with self._lock:
                self._requests[spec.kind] += 1
        while True:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    self._hits += 1
                    return hit
                waiting = self._pending.get(key)
                if waiting is None:
                    self._pending[key] = threading.Event()
                    break
            waiting.wait()  # another thread compiles this key; then read the cache
            with self._lock:
                if key not in self._cache:
                    raise self._refused(spec)  # it failed there; it would fail here too
        try:
            compiled = self._compile(spec)
        finally:
            with self._lock:
                self._pending.pop(key).set()
        self._store(key, compiled)
        return compiled

    def _store(self, key: tuple[str, str, str], compiled: CompiledGrammar) -> None:
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self._compiles += 1
            self._seconds += compiled.seconds
            self._buckets[bisect.bisect_left(COMPILE_BUCKETS, compiled.seconds)] += 1

    def count_request(self, spec: StructuredOutputs) -> None:
        """Count one admitted structured request (what ``compile(count=True)`` counts)."""
        with self._lock:
            self._requests[spec.kind] += 1

    def cached(self, spec: StructuredOutputs) -> CompiledGrammar | None:
        """The cached grammar of ``spec`` (counted as a hit), or None."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self._hits += 1
            return hit

    def adopt(self, spec: StructuredOutputs, backend: str, data: Any,
              seconds: float) -> CompiledGrammar:
        """Cache a grammar a worker process compiled (:mod:`engine.structured.worker`):
        xgrammar's serialized JSON is read back against this tokenizer's tables (blocking:
        about as long as reading the JSON), llguidance's grammar text is kept as is."""
        if backend == "xgrammar":
            import xgrammar

            handle = xgrammar.CompiledGrammar.deserialize_json(data, self._xgr_info)
        else:
            handle = data
        compiled = CompiledGrammar(backend, handle, seconds)
        self._store(spec.key, compiled)
        return compiled

    def worker_payload(self, max_bytes: int) -> dict[str, Any]:
        """What a compile worker needs to build the same backend (its first frame)."""
        return {"tokenizer": self._hf.backend_tokenizer.to_str(), "vocab_size": self.vocab_size,
                "stop_token_ids": self._stop_ids or [], "backend": self.backend,
                "skipped_special_ids": sorted(self._skipped), "max_bytes": max_bytes}

    def is_cached(self, spec: StructuredOutputs) -> bool:
        with self._lock:
            return spec.key in self._cache

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A fresh matcher at the start of ``spec``'s grammar (compiled if evicted)."""
        compiled = self.compile(spec, count=False)
        tok = self._guidance_tokenizer() if compiled.backend == "guidance" else None
        # llguidance never writes a special token for text; xgrammar does, unless masked.
        # A structural tag or an EBNF grammar may name one on purpose (a tool-call marker).
        keep = (self._no_special if compiled.backend == "xgrammar"
                and spec.kind in ("json", "json_object", "regex", "choice") else None)
        return Matcher(compiled, self._stop_set, tok, keep)

    def statistics(self) -> StructuredStatistics:
        with self._lock:
            cumulative, total = [], 0
            for n in self._buckets:
                total += n
                cumulative.append(total)
            return StructuredStatistics(dict(self._requests), self._compiles, self._hits,
                                        self._seconds, tuple(cumulative))

    # -- compiling -------------------------------------------------------------------------

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        t0 = time.perf_counter()
        if spec.choice is not None:
            check_choice(spec.choice, self._special_texts)
        errors: list[str] = []
        if self.backend in ("auto", "xgrammar"):
            try:
                handle = self._xgrammar(spec)
                return CompiledGrammar("xgrammar", handle, time.perf_counter() - t0)
            except _Refused as exc:
                errors.append(f"xgrammar: {exc}")
        # "auto" tries llguidance for JSON schemas only: there the two differ in what they
        # support. A regex or grammar xgrammar cannot parse is the request's error (its
        # EBNF dialect is the documented one), not a cue to try another reading.
        if self.backend == "guidance" or (self.backend == "auto" and spec.kind == "json"):
            try:
                handle = self._guidance(spec)
                return CompiledGrammar("guidance", handle, time.perf_counter() - t0)
            except _Refused as exc:
                errors.append(f"llguidance: {exc}")
        raise InvalidParamError(
            f"the {spec.kind} constraint cannot be enforced: " + "; ".join(errors),
            param="structured_outputs")

    def _refused(self, spec: StructuredOutputs) -> InvalidParamError:
        try:
            self._compile(spec)
        except InvalidParamError as exc:
            return exc
        return InvalidParamError(f"the {spec.kind} constraint failed to compile",
                                 param="structured_outputs")

    def _xgrammar(self, spec: StructuredOutputs) -> Any:
        import xgrammar

        schemas = ([spec.schema] if spec.kind == "json" else
                   tag_schemas(json.loads(spec.text)) if spec.kind == "structural_tag" else [])
        for schema in schemas:
            gap = xgrammar_gap(schema)
            if gap is not None:
                raise _Refused(gap)
        try:
            grammar = _xgrammar_grammar(spec)
            if spec.think is not None:
                grammar = xgrammar.Grammar.concat(_xgrammar_think(spec.think), grammar)
            return self._xgr.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _Refused(_first_line(exc)) from None

    def _guidance(self, spec: StructuredOutputs) -> str:
        import llguidance

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
                    _tag_lark(json.loads(spec.text)["format"], self._guidance_literal))
            else:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text))
            if spec.think is not None:
                grammar = _guidance_think(spec.think, grammar, self._guidance_literal)
        except Exception as exc:  # gbnf_to_lark raises its own error class
            raise _Refused(_first_line(exc)) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._guidance_tokenizer())
        if failed or messages:
            # A warning here is a schema feature it would skip ("Unimplemented keys"):
            # refused, as an unenforced keyword is for xgrammar.
            raise _Refused("; ".join(_first_line(m) for m in messages) or "invalid grammar")
        return grammar

    def _xgrammar_compiler(self) -> Any:
        import xgrammar

        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(
            self._hf, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids)
        # Two compile threads: a compile runs in an admission worker thread beside the
        # model step; more would take cores from it (the dev machines have 2).
        compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._xgr_info = info
        logger.info("xgrammar tokenizer info built in %.2f s", time.perf_counter() - t0)
        return compiler

    def _guidance_tokenizer(self) -> Any:
        """llguidance's tokenizer, built on first use (``auto`` rarely needs it)."""
        with self._guidance_lock:
            if self._guidance_tok is None:
                try:
                    import llguidance.hf
                except ImportError as exc:
                    raise InvalidParamError(
                        "the guidance backend needs the llguidance package, which is not "
                        "installed", param="structured_outputs_backend") from exc
                t0 = time.perf_counter()
                self._guidance_tok = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._stop_ids)
                logger.info("llguidance tokenizer built in %.2f s", time.perf_counter() - t0)
            return self._guidance_tok


    def _guidance_literal(self, text: str) -> str:
        """``text`` as a lark literal. llguidance holds every added token as a special
        token, which a quoted string does not match; a marker that is one (Qwen's
        ``</think>``, ``<tool_call>``) may be written as that token or spelled out."""
        tok = self._guidance_tokenizer()
        ids = tok.tokenize_str(text)
        if len(ids) == 1 and tok.is_special_token(ids[0]):
            return f"({json.dumps(text)} | <[{ids[0]}]>)"
        return json.dumps(text)


class _Refused(Exception):
    """One backend cannot take a spec; the message says why."""


def _hf_tokenizer(tokenizer: Any) -> Any:
    """A transformers fast tokenizer around the engine tokenizer's ``tokenizers`` object:
    both backends read vocabulary, byte encoding and prefix-space handling from it."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


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
    import xgrammar

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
    import xgrammar

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


# The text a model may write between </think> and the constrained output (Qwen3 writes
# "\n\n"): a little whitespace, bounded so a small model cannot loop on it.
_THINK_GAP = r"[ \t\r\n]{0,4}"


def _xgrammar_think(mode: str) -> Any:
    """The reasoning prefix of ``think`` ``mode`` as an xgrammar grammar."""
    import xgrammar

    block: dict[str, Any] = {"type": "tag", "begin": "", "content": {"type": "any_text"},
                             "end": "</think>"}
    if mode == "optional":
        block["begin"] = "<think>"
    prefix: dict[str, Any] = {"type": "sequence",
                              "elements": [block, {"type": "regex", "pattern": _THINK_GAP}]}
    if mode == "optional":
        prefix = {"type": "optional", "content": prefix}
    return xgrammar.Grammar.from_structural_tag(
        json.dumps({"type": "structural_tag", "format": prefix}))


def _guidance_think(mode: str, grammar: str, literal: Callable[[str], str]) -> str:
    """llguidance's ``grammar`` behind the reasoning prefix of ``think`` ``mode``: free text
    up to the first </think> (a lazy lexeme, or text then the </think> token), then the
    constraint as a sub-grammar. ``literal`` writes a marker as a lark literal."""
    # grammar_from_lark gives the lark text back; the others a JSON list of grammars.
    top = (json.loads(grammar) if grammar.lstrip().startswith("{")
           else {"grammars": [{"lark_grammar": grammar}]})
    inner = top["grammars"]
    name = inner[0].get("name") or "constraint"
    inner[0] = {**inner[0], "name": name}
    # "open" takes a leading <think> too (as the deepseek_r1 parser does); the free text
    # would, but not when <think> is a special token.
    opening = literal("<think>")
    start = f"{opening}? think GAP" if mode == "open" else f"({opening} think GAP)?"
    lark = "\n".join([
        "%llguidance {}", f"start: {start} @{name}", *_until("think", "</think>", literal),
        f"GAP: /{_THINK_GAP}/", "TEXT: /(.|\\n)*/"]) + "\n"
    return json.dumps({**top, "grammars": [{"lark_grammar": lark}, *inner]})


def _until(rule: str, marker: str, literal: Callable[[str], str]) -> list[str]:
    """Lark rules for ``rule``: any text up to and including the first ``marker``. The
    spelled-out marker ends a lazy lexeme (the shortest match); a marker that is a special
    token follows free text, which cannot contain it."""
    spelled = json.dumps(marker)
    written = literal(marker)
    if written == spelled:
        return [f"{rule}[lazy]: TEXT {spelled}"]
    token = written[len(spelled) + 4:-1]  # "(<spelled> | <[id]>)" -> "<[id]>"
    return [f"{rule}: {rule}_text | TEXT {token}", f"{rule}_text[lazy]: TEXT {spelled}"]


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


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    # GBNF string literals take JSON's escapes (\" \\ \n \uXXXX).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _choice_lark(choices: tuple[str, ...]) -> str:
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def _first_line(exc: BaseException | str) -> str:
    """The message of a backend error without its C++ location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ".cc:" in text and ": " in text:
        text = text.split(": ", 1)[1]
    return text[:500]
