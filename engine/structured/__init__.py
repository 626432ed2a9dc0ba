"""Structured output: constrain a request's tokens to a JSON schema, regex, choice or grammar.

* :class:`StructuredOutputs` (``spec.py``): the constraint, a field of ``SamplingParams``.
* ``check.py``: what no backend may take (unresolvable or remote refs, cycles, empty
  languages, anchors mid-pattern), refused when the spec is built, and the subset xgrammar
  is trusted with (the rest goes to llguidance).
* :class:`GrammarBackend` (``backend.py``): compiles constraints with xgrammar (llguidance
  where xgrammar refuses), cached per spec, and makes one :class:`Matcher` per sample.
* ``pool.py`` / ``worker.py``: the engine's compiles, in worker processes killed past
  their time budget or when their caller leaves.

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
