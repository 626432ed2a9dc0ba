"""Structured output: constrain a request's tokens to a JSON schema, regex, choice or grammar.

* :class:`StructuredOutputs` (``spec.py``): the constraint, a field of ``SamplingParams``.
* :class:`GrammarBackend` (``backend.py``): compiles constraints with xgrammar (llguidance
  where xgrammar refuses), cached per spec, and makes one :class:`Matcher` per sample.

The model runner holds the matchers and the sampler applies their token bitmask to the
logits; ``docs/architecture.md`` ("Structured output") tells the whole path.
"""

from engine.structured.backend import (
    BACKENDS,
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    StructuredStatistics,
    apply_bitmask,
    bitmask_words,
)
from engine.structured.spec import StructuredOutputs

__all__ = [
    "BACKENDS",
    "CompiledGrammar",
    "GrammarBackend",
    "Matcher",
    "StructuredOutputs",
    "StructuredStatistics",
    "apply_bitmask",
    "bitmask_words",
]
