"""Structured output: constrain a request's tokens to a JSON schema, regex, choice or grammar.

* :class:`StructuredOutputs` (``spec.py``): the constraint, a field of ``SamplingParams``.
* ``check.py``: what no backend may take (unresolvable or remote refs, cycles, empty
  languages, anchors mid-pattern), refused when the spec is built, and the subset xgrammar
  is trusted with (the rest goes to llguidance).
* :class:`GrammarBackend` (``backend.py``): compiles constraints with xgrammar
  (``xgrammar_compiler.py``; llguidance where xgrammar refuses, ``guidance.py``), cached
  per spec, and makes one :class:`Matcher` (``matcher.py``) per sample.
* ``bitmask.py``: the token bitmask a matcher fills and the sampler applies.
* ``pool.py`` / ``worker.py``: the engine's compiles, in worker processes killed past
  their time budget or when their caller leaves.

The model runner holds the matchers and the sampler applies their token bitmask to the
logits; ``docs/architecture.md`` ("Structured output") tells the whole path.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.structured.backend import (
        BACKENDS,
        GrammarBackend,
        GrammarHold,
        StructuredStatistics,
    )
    from engine.structured.bitmask import apply_bitmask, bitmask_words
    from engine.structured.compiled import CompiledGrammar
    from engine.structured.matcher import Matcher
    from engine.structured.spec import StructuredOutputs

# Imported on first use: ``engine.messages`` needs only ``spec`` (and through it
# ``engine.params`` and ``import engine``), and the backend and bitmask pull in torch.
_LAZY = {
    "BACKENDS": "engine.structured.backend",
    "GrammarBackend": "engine.structured.backend",
    "GrammarHold": "engine.structured.backend",
    "StructuredStatistics": "engine.structured.backend",
    "apply_bitmask": "engine.structured.bitmask",
    "bitmask_words": "engine.structured.bitmask",
    "CompiledGrammar": "engine.structured.compiled",
    "Matcher": "engine.structured.matcher",
    "StructuredOutputs": "engine.structured.spec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.structured' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "BACKENDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarHold",
    "Matcher",
    "StructuredOutputs",
    "StructuredStatistics",
    "apply_bitmask",
    "bitmask_words",
]
