"""Structured-output grammars across tensor-parallel ranks: rank 0 sends them, workers
never compile.

Every rank builds the same grammar matcher for a request (the logits are all-gathered and
each rank samples them), so every rank needs the request's grammar. Rank 0's grammar is
the engine's: compiled at admission under the compile pool's budgets and limiter, and held
in its cache while the request lives (:mod:`engine.structured.backend`). A worker's backend
is its own; compiling the grammar there again would run inside a step, outside any
budget, while rank 0 waits in a collective. Instead rank 0 sends the grammar with the step
that brings the request (:class:`~engine.messages.RankGrammar` in the
:class:`~engine.messages.RankStep`: xgrammar's serialized JSON, read back as a compile
worker's is), and the worker adopts it.

A worker holds each request's grammar from the step that brings the request to the step
whose ``finished_ids`` name it; rank 0 keeps the same count from the same plans
(:class:`GrammarMirror`), so it knows which grammars every worker holds, and sends only
the others (a grammar whose last request finished is sent again with its next one). A
worker that finds a grammar missing anyway fails that step (:class:`WorkerGrammars`), and
rank 0 sees it diverge: a bug, never a silent compile.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from engine.messages import RankGrammar, StepPlan

logger = logging.getLogger("engine")


class _Holds:
    """Grammar keys held per live sample, as a worker's backend counts them."""

    def __init__(self) -> None:
        self.count: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.spec_of: dict[str, Any] = {}  # sample id -> its StructuredOutputs

    def finish(self, plan: StepPlan) -> list[Any]:
        """Forget the samples the plan finishes; the specs they held."""
        released = []
        for sample_id in plan.finished_ids:
            spec = self.spec_of.pop(sample_id, None)
            if spec is not None:
                left = self.count[spec.key] - 1
                if left > 0:
                    self.count[spec.key] = left
                else:
                    del self.count[spec.key]
                released.append(spec)
        return released

    def start(self, plan: StepPlan) -> list[Any]:
        """Count the plan's new structured samples; the specs they hold."""
        held = []
        for new in plan.new_requests:
            spec = new.params.structured_outputs
            if spec is not None:
                self.spec_of[new.sample_id] = spec
                self.count[spec.key] += 1
                held.append(spec)
        return held


class GrammarMirror:
    """Rank 0's side: the grammars to send with each plan (see the module docstring).
    ``grammar`` is rank 0's :class:`~engine.structured.GrammarBackend` (None: none)."""

    def __init__(self, grammar: Any) -> None:
        self._grammar = grammar
        self._holds = _Holds()
        self.sent = 0  # grammars sent so far (tests, the benchmark)

    def for_plan(self, plan: StepPlan) -> tuple[RankGrammar, ...]:
        """The grammars the workers need for ``plan`` and do not hold: call once per plan
        sent, in order (it counts the plan's holds as the workers will)."""
        self._holds.finish(plan)
        missing = [new.params.structured_outputs for new in plan.new_requests
                   if new.params.structured_outputs is not None
                   and new.params.structured_outputs.key not in self._holds.count]
        self._holds.start(plan)
        if not missing or self._grammar is None:
            return ()
        # Rank 0's requests hold their grammars, so these are cached; one lost anyway is
        # compiled again the way any is (GrammarBackend.grammar: the engine's pool).
        out = tuple(RankGrammar(spec, *self._grammar.exported(spec))
                    for spec in {s.key: s for s in missing}.values())
        self.sent += len(out)
        return out

    def reset(self) -> None:
        """The workers forgot every request (a reset) or were replaced."""
        self._holds = _Holds()


class WorkerGrammars:
    """A worker's side: holds and adopts what each step brings, before the step runs.
    The worker's backend is never told how to compile a grammar it lost: it raises."""

    def __init__(self, grammar: Any) -> None:
        self._grammar = grammar
        self._holds = _Holds()
        if grammar is not None:
            grammar.recompile = self._missing

    def before_step(self, plan: StepPlan, grammars: tuple[RankGrammar, ...]) -> None:
        if self._grammar is None:
            return
        for spec in self._holds.finish(plan):
            self._grammar.release(spec)
        for spec in self._holds.start(plan):  # held before they are stored: never evicted
            self._grammar.hold(spec)
        for sent in grammars:
            try:
                self._grammar.adopt(sent.spec, sent.backend, sent.data, sent.seconds)
            except Exception:  # its request fails on this rank: rank 0 sees it diverge
                logger.exception("a %s grammar from rank 0 could not be read back",
                                 sent.spec.kind)

    def reset(self) -> None:
        self._holds = _Holds()
        if self._grammar is not None:
            self._grammar.release_all()

    @staticmethod
    def _missing(spec: Any) -> Any:
        raise RuntimeError(f"rank 0 sent no {spec.kind} grammar for a request of this step "
                           "(a worker never compiles one)")
