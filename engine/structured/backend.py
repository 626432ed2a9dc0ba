"""Grammar compilation for structured output: :class:`GrammarBackend`, over xgrammar and
llguidance.

:class:`GrammarBackend` is built once per engine at model load, from the model's tokenizer
(the backends' tokenizer info reads every vocabulary entry's bytes: about half a second for
a 49k vocabulary). It compiles a :class:`StructuredOutputs` into a grammar, once per
distinct spec (an LRU cache keyed by ``spec.key``; concurrent compiles of one key wait for
the first), and makes a :class:`Matcher` per sample from a compiled grammar.

The compilers are ``xgrammar_compiler.py`` and ``guidance.py`` (the fallback); the
matcher is ``matcher.py`` and the bitmask it fills ``bitmask.py``. This module chooses
between the compilers, caches their grammars and counts.

Thread-safety: :meth:`GrammarBackend.compile` may run in any thread (admission runs it in a
worker thread); a :class:`Matcher` belongs to the one thread that drives the model runner.

Holds: a grammar that some live request still needs is *held* (:meth:`hold` when the
request's compile starts, :meth:`release` by the scheduler when each of its samples
finishes), and the cache never evicts a held grammar: past ``cache_size`` it evicts the
least recently used grammar nobody holds, and runs over by the grammars held. So the
runner finds every running request's grammar in the cache. Should one still be missing
(a bug, or a backend driven without holds), :meth:`matcher` compiles it through
:attr:`GrammarBackend.recompile`, which the engine points at its
:class:`~engine.structured.pool.CompilePool`: the same time budget, size budget and
limiter as any compile, never a compile of its own on the model thread.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from engine.errors import InvalidParamError
from engine.structured.bitmask import bitmask_words, clear_bits
from engine.structured.check import check_choice
from engine.structured.compiled import CompiledGrammar, Refused
from engine.structured.guidance import GuidanceCompiler
from engine.structured.matcher import Matcher, ThinkKeep
from engine.structured.spec import StructuredOutputs, think_prefix
from engine.structured.xgrammar_compiler import XGrammarCompiler

BACKENDS = ("auto", "xgrammar", "guidance")
# Compiled grammars kept: an xgrammar JSON-schema grammar is tens of KiB to a few MiB
# (its per-token mask cache); 256 distinct specs cover a server's working set of tool and
# response schemas without holding unbounded memory for one-off ones.
CACHE_SIZE = 256
# Upper bounds of the compile-time histogram, in seconds: a cached compile is ~0.1 ms, a
# small schema on SmolLM2's vocabulary ~60 ms, a large one seconds.
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclasses.dataclass(frozen=True, slots=True)
class StructuredStatistics:
    """Cumulative counters of one :class:`GrammarBackend` (a frozen snapshot)."""

    requests: dict[str, int]  # structured requests admitted, by kind
    compiles: int  # grammars actually compiled (cache misses)
    cache_hits: int
    compile_seconds_sum: float
    compile_buckets: tuple[int, ...]  # cumulative counts per COMPILE_BUCKETS bound, then +Inf
    evictions: int = 0  # grammars dropped from the cache (none while held)
    held: int = 0  # distinct grammars held by live requests now
    recompiles: int = 0  # matchers whose grammar had to be compiled again (see recompile)


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
        self._no_special = clear_bits(bitmask_words(vocab_size), special) if special else None
        self._think_keeps: dict[str, ThinkKeep | None] = {}  # per reasoning format
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str, str], CompiledGrammar] = (
            collections.OrderedDict())
        self._pending: dict[tuple[str, str, str], threading.Event] = {}
        self._cache_size = cache_size
        # Live requests per grammar key (see the module docstring): never evicted while > 0.
        self._holds: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._evictions = 0
        self._recompiles = 0
        # How matcher() compiles a grammar the cache lost: the engine's CompilePool (its
        # budget and limiter). None: compiled here, for a backend used without an engine.
        self.recompile: Callable[[StructuredOutputs], CompiledGrammar] | None = None
        self._requests: collections.Counter[str] = collections.Counter()
        self._compiles = 0
        self._hits = 0
        self._seconds = 0.0
        self._buckets = [0] * (len(COMPILE_BUCKETS) + 1)
        self._xgr: XGrammarCompiler | None = None
        self._guidance = GuidanceCompiler(self._hf, vocab_size=vocab_size,
                                          stop_token_ids=self._stop_ids)
        if backend in ("auto", "xgrammar"):
            self._xgr = XGrammarCompiler(self._hf, vocab_size=vocab_size,
                                         stop_token_ids=self._stop_ids)
        else:
            self._guidance.tokenizer()

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
            compiled = self.compile_uncached(spec)
        finally:
            with self._lock:
                self._pending.pop(key).set()
        self._store(key, compiled)
        return compiled

    def _store(self, key: tuple[str, str, str], compiled: CompiledGrammar) -> None:
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            self._evict_locked()
            self._compiles += 1
            self._seconds += compiled.seconds
            self._buckets[bisect.bisect_left(COMPILE_BUCKETS, compiled.seconds)] += 1

    def _evict_locked(self) -> None:
        """Down to ``cache_size``, least recently used first, skipping held grammars."""
        excess = len(self._cache) - self._cache_size
        if excess <= 0:
            return
        for key in [k for k in self._cache if k not in self._holds][:excess]:
            del self._cache[key]
            self._evictions += 1

    def hold(self, spec: StructuredOutputs, count: int = 1) -> None:
        """``count`` live samples need ``spec``'s grammar: it stays cached (once compiled)
        until they :meth:`release` it. Take it before the compile, so that nothing can
        evict the grammar between its compile and its first matcher."""
        with self._lock:
            self._holds[spec.key] += count

    def release(self, spec: StructuredOutputs, count: int = 1) -> None:
        """``count`` of the samples that held ``spec``'s grammar finished."""
        with self._lock:
            left = self._holds[spec.key] - count
            if left > 0:
                self._holds[spec.key] = left
            else:
                del self._holds[spec.key]
            self._evict_locked()

    def held(self, spec: StructuredOutputs) -> GrammarHold:
        """One hold on ``spec``'s grammar, as an object: released by its ``release``, by
        ``pass_to`` (to the samples of the request that took it), or when it is dropped."""
        return GrammarHold(self, spec)

    def release_all(self) -> None:
        """No request is live any more (the engine's actors restarted): drop every hold."""
        with self._lock:
            self._holds.clear()
            self._evict_locked()

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
            if self._xgr is None:
                raise ValueError("an xgrammar grammar given to a guidance-only backend")
            handle = self._xgr.read_back(data)
        else:
            handle = data
        compiled = CompiledGrammar(backend, handle, seconds)
        self._store(spec.key, compiled)
        return compiled

    def exported(self, spec: StructuredOutputs) -> tuple[str, Any, float]:
        """``(backend, data, seconds)`` of ``spec``'s grammar (:meth:`grammar`) as
        :meth:`adopt` reads it back in another process (xgrammar's serialized JSON,
        llguidance's text)."""
        compiled = self.grammar(spec)
        data = (compiled.handle.serialize_json() if compiled.backend == "xgrammar"
                else compiled.handle)
        return compiled.backend, data, compiled.seconds

    def worker_payload(self, max_bytes: int) -> dict[str, Any]:
        """What a compile worker needs to build the same backend (its first frame)."""
        return {"tokenizer": self._hf.backend_tokenizer.to_str(), "vocab_size": self.vocab_size,
                "stop_token_ids": self._stop_ids or [], "backend": self.backend,
                "skipped_special_ids": sorted(self._skipped), "max_bytes": max_bytes}

    def is_cached(self, spec: StructuredOutputs) -> bool:
        with self._lock:
            return spec.key in self._cache

    def grammar(self, spec: StructuredOutputs) -> CompiledGrammar:
        """``spec``'s grammar for a live request: the cached one (the request holds it),
        else compiled again through :attr:`recompile`."""
        compiled = self.cached(spec)
        if compiled is None:
            with self._lock:
                self._recompiles += 1
            compiled = (self.recompile(spec) if self.recompile is not None
                        else self.compile(spec, count=False))
        return compiled

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A fresh matcher at the start of ``spec``'s grammar (:meth:`grammar`)."""
        compiled = self.grammar(spec)
        tok = self._guidance.tokenizer() if compiled.backend == "guidance" else None
        # llguidance never writes a special token for text; xgrammar does, unless masked.
        # A structural tag or an EBNF grammar may name one on purpose (a tool-call marker).
        strict = (compiled.backend == "xgrammar"
                  and spec.kind in ("json", "json_object", "regex", "choice"))
        keep = self._no_special if strict else None
        think = self._think_keep(spec.think) if strict else None
        return Matcher(compiled, self._stop_set, tok, keep, think)

    def _think_keep(self, think: str | None) -> ThinkKeep | None:
        """Where ``think``'s reasoning markers include special tokens (Mistral's
        ``[THINK]``, harmony's channel headers), the mask that lets them through inside the
        reasoning (the matcher masks special tokens again once it ends); None otherwise."""
        if self._no_special is None or think is None:
            return None
        if think not in self._think_keeps:
            mode, starts, ends = think_prefix(think)
            skipped = set(self._skipped)

            def special_ids(marker: str) -> tuple[int, ...]:  # the marker's special tokens, in order
                return tuple(i for i in self._hf.encode(marker, add_special_tokens=False) if i in skipped)

            start_runs = [special_ids(m) for m in starts]
            end_runs = tuple(r for r in (special_ids(m) for m in ends) if r)
            marked = {i for run in (*start_runs, *end_runs) for i in run}
            self._think_keeps[think] = None if not marked else ThinkKeep(
                clear_bits(bitmask_words(self.vocab_size),
                           [i for i in self._skipped if i not in self._stop_set and i not in marked]),
                frozenset(r[0] for r in start_runs if r), end_runs, mode == "optional",
                frozenset(marked))
        return self._think_keeps[think]

    def statistics(self) -> StructuredStatistics:
        with self._lock:
            cumulative, total = [], 0
            for n in self._buckets:
                total += n
                cumulative.append(total)
            return StructuredStatistics(dict(self._requests), self._compiles, self._hits,
                                        self._seconds, tuple(cumulative), self._evictions,
                                        len(self._holds), self._recompiles)

    # -- compiling -------------------------------------------------------------------------

    def compile_uncached(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile ``spec`` now, bypassing the cache (a compile worker's whole job)."""
        t0 = time.perf_counter()
        if spec.choice is not None:
            check_choice(spec.choice, self._special_texts)
        errors: list[str] = []
        if self._xgr is not None:  # "auto" or "xgrammar"
            try:
                handle = self._xgr.compile(spec)
                return CompiledGrammar("xgrammar", handle, time.perf_counter() - t0)
            except Refused as exc:
                errors.append(f"xgrammar: {exc}")
        # "auto" tries llguidance for JSON schemas only: there the two differ in what they
        # support. A regex or grammar xgrammar cannot parse is the request's error (its
        # EBNF dialect is the documented one), not a cue to try another reading.
        if self.backend == "guidance" or (self.backend == "auto" and spec.kind == "json"):
            try:
                handle = self._guidance.compile(spec)
                return CompiledGrammar("guidance", handle, time.perf_counter() - t0)
            except Refused as exc:
                errors.append(f"llguidance: {exc}")
        raise InvalidParamError(
            f"the {spec.kind} constraint cannot be enforced: " + "; ".join(errors),
            param="structured_outputs")

    def _refused(self, spec: StructuredOutputs) -> InvalidParamError:
        try:
            self.compile_uncached(spec)
        except InvalidParamError as exc:
            return exc
        return InvalidParamError(f"the {spec.kind} constraint failed to compile",
                                 param="structured_outputs")


class GrammarHold:
    """One :meth:`GrammarBackend.hold`, released exactly once (see :meth:`GrammarBackend.held`):
    a request that is prepared but never queued, or dropped, leaves no hold behind."""

    __slots__ = ("__weakref__", "_backend", "_release", "spec")

    def __init__(self, backend: GrammarBackend, spec: StructuredOutputs) -> None:
        backend.hold(spec)
        self._backend = backend
        self.spec = spec
        self._release = weakref.finalize(self, backend.release, spec)

    def release(self) -> None:
        self._release()

    def pass_to(self, samples: int) -> None:
        """The request is queued: one hold per sample (the scheduler releases each as it
        ends) replaces this one."""
        if self._release.alive:
            self._backend.hold(self.spec, samples)
            self._release()


def _hf_tokenizer(tokenizer: Any) -> Any:
    """A transformers fast tokenizer around the engine tokenizer's ``tokenizers`` object:
    both backends read vocabulary, byte encoding and prefix-space handling from it."""
    # Lazy: transformers is heavy to import (seconds) and only a grammar backend needs it.
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)
