"""Beam groups in the scheduler: a beam search request is planned, preempted and freed as
one request (the :class:`Scheduler`'s part of it; the ranking is :mod:`engine.core.beam`).

A group is the request the queue holds (``req.beam``: a :class:`BeamGroup`); each live beam
is a :class:`Request` outside the queue with its own block table and runner state. A step:

1. Fork: the beams the last ranking chose replace the live ones. A child's table shares
   every block of its parent's (``ForkBlocks``: reference counts); a parent's second and
   later children get a fresh block for the partly filled last one, which the runner
   copies before the step's forward (``StepPlan.block_copies``); the first child takes it
   over as the parent's table goes. Full blocks are never written again, so nothing else
   is ever copied.
2. Allocate: each beam that has not reported this step asks for its next chunk's slots; a
   refusal preempts the last running request, which may be the group itself (then every
   beam's table goes, and each beam recomputes from the prompt, sharing it through the
   prefix cache). All tables are taken before any chunk is planned, so a group is in a
   step whole or not at all.
3. Report: each beam's row reports its top logprobs; when every live beam reported, the
   ranking gives the next beams, or the answer (one delta per output sample).

Async scheduling: a group is not planned again while a beam's row is in flight (the
ranking needs every report).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

from engine.core.beam import BeamGroup, BeamSearch
from engine.core.planning import StepDraft, add_chunk, allocate_call, fits_table, too_small
from engine.core.request import ProtocolError, Request, RequestStatus
from engine.errors import InvalidParamError, PromptTooLongError
from engine.messages import (
    AllocatorCall,
    AllocatorReply,
    BlocksForked,
    ForkBlocks,
    FreeRequest,
    NewRequest,
    SampledToken,
    ScheduledChunk,
    SchedulerRequest,
    SlotsAllocated,
    TokenDelta,
)
from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.core.request_queue import RequestQueue
    from engine.core.scheduler_config import SchedulerConfig

# A beam's runner row: greedy (its draw is unused), no stop: the search reads its logprobs.
_BEAM_ROW = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


class BeamScheduling:
    """The :class:`~engine.core.scheduler.Scheduler`'s beam group methods (a base class,
    so the policy of one step still reads in one place; this holds only what groups add).
    """

    config: SchedulerConfig
    _queue: RequestQueue
    _finished_ids: list[str]
    _beam_owner: dict[str, Request]

    # The Scheduler's, used here (it overrides each).
    def _preempt(self, req: Request) -> Generator[AllocatorCall, AllocatorReply, None]:
        raise NotImplementedError

    def _finish(self, req: Request, status: RequestStatus) -> list[AllocatorCall]:
        raise NotImplementedError

    def _computed(self, req: Request, end: int) -> list[AllocatorCall]:
        raise NotImplementedError

    def _prefix_lookup(self, req: Request) -> bool:
        raise NotImplementedError

    def _start_beam_group(self, req: Request, request: SchedulerRequest) -> None:
        """Make ``req`` a beam group with its first beam (the prompt alone)."""
        params = request.params
        width = params.beam_width
        if width > self.config.max_num_seqs:
            raise InvalidParamError(f"the beam width ({width}) exceeds max_num_seqs "
                                    f"({self.config.max_num_seqs}): every beam is a row of "
                                    "the batch", param="n")
        # Without sharing, W beams of P + max_tokens tokens each, and while a step forks,
        # up to W fresh blocks for copies beside the parents' tables: cut max_tokens so
        # the group alone always fits the pool (nothing but itself to preempt).
        bs, prompt_len = self.config.block_size, len(request.prompt_token_ids)
        room = (self.config.num_kv_blocks - width) // width * bs
        fit = room - prompt_len
        if fit < 1:
            raise PromptTooLongError(prompt_tokens=prompt_len, max_tokens=request.max_tokens,
                                     max_model_len=max(room, 0))
        req.max_tokens = min(req.max_tokens, fit)
        ends = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(request.eos_token_ids))
        search = BeamSearch(width=width, max_tokens=req.max_tokens, min_tokens=params.min_tokens,
                            length_penalty=params.length_penalty,
                            early_stopping=params.early_stopping, end_token_ids=ends)
        req.beam = BeamGroup(search, request.beam_output_ids or (req.sample_id,),
                             params.stop_token_ids)
        req.beam.beams = [self._new_beam(req, 0, [])]

    def _new_beam(self, group: Request, index: int, outputs: list[int]) -> Request:
        """A beam of ``group``: greedy rows that report the top logprobs the search ranks
        (the token the runner draws is not used)."""
        runner_params = _BEAM_ROW.replace(logprobs=group.beam.search.logprobs_needed)
        beam = Request(group.beam.key(group.sample_id, index), group.prompt_token_ids,
                       runner_params, max_tokens=group.max_tokens, priority=group.priority,
                       arrival=group.arrival, cache_salt=group.cache_salt, lora=group.lora)
        beam.output_token_ids = outputs
        self._beam_owner[beam.sample_id] = group
        return beam

    # -- beam groups ----------------------------------------------------------------------

    def _schedule_group(
        self, step: StepDraft, group: Request, *, preempt: bool,
    ) -> Generator[AllocatorCall, AllocatorReply, str | None]:
        """Plan a beam group's beams as one request: fork the beams the last ranking chose,
        then give each beam that has not reported this step its next chunk. Every table
        is taken before any chunk is planned, so a group preempted on the way has nothing
        in the step. Returns None, ``"preempted"`` (another request was), ``"self"`` (the
        group was) or ``"refused"`` (``preempt`` false: a waiting group back in the queue)."""
        bg = group.beam
        if any(b.num_pending_tokens for b in bg.beams):
            return None  # its step is in flight: the ranking needs every beam's report
        outcome: str | None = None
        if bg.pending:
            outcome = yield from self._fork_beams(step, group, preempt=preempt)
            if outcome in ("self", "refused"):
                return outcome
        bs, budget = self.config.block_size, step.budget
        planned: list[tuple[Request, SlotsAllocated]] = []
        for index, beam in enumerate(bg.beams):
            want = min(budget, beam.num_known_tokens - beam.num_computed_tokens)
            if index in bg.tops or want <= 0:
                continue
            reply = fits_table(beam, want, 0, bs)
            while reply is None:
                lookup = (not beam.block_ids and beam.sample_id not in bg.forked
                          and self._prefix_lookup(group))
                answer = yield allocate_call(beam, want, lookup=lookup)
                if isinstance(answer, SlotsAllocated):
                    reply = answer
                    break
                stop = yield from self._beam_refused(group, answer, preempt=preempt)
                if stop is not None:
                    return stop
                outcome = "preempted"
            planned.append((beam, reply))
            budget -= reply.num_new_tokens
        for beam, reply in planned:
            if not beam.seen_by_runner:
                beam.seen_by_runner = True
                step.new_requests.append(NewRequest(
                    beam.sample_id, beam.prompt_token_ids + tuple(beam.output_token_ids),
                    beam.params, (), lora=beam.lora))
            add_chunk(step, beam, reply, (), 0, bs)
            if group.num_cached_tokens < 0:
                group.num_cached_tokens = beam.num_cached_tokens
        return outcome

    def _beam_refused(
        self, group: Request, refusal: AllocatorReply, *, preempt: bool,
    ) -> Generator[AllocatorCall, AllocatorReply, str | None]:
        """The pool refused a block to one of ``group``'s beams: preempt the last running
        request (None: it was another one, try again), or give up."""
        running = self._queue.running
        if len(running) == 1:
            raise too_small(group, refusal)
        if not preempt:
            yield from self._drop_beam_tables(group)
            self._queue.requeue(group)
            group.status = RequestStatus.WAITING
            return "refused"
        victim = running[-1]
        yield from self._preempt(victim)
        return "self" if victim is group else None

    def _fork_beams(
        self, step: StepDraft, group: Request, *, preempt: bool,
    ) -> Generator[AllocatorCall, AllocatorReply, str | None]:
        """Replace the live beams by the ones the ranking chose: each child shares its
        parent's blocks; a parent's second and later children copy its partly filled
        last block (the first takes it over, as the parent's table goes). A parent
        without blocks (preempted) leaves its child to recompute from the prompt."""
        bg, bs = group.beam, self.config.block_size
        old = bg.beams
        bg.generation += 1
        children: list[Request] = []
        outcome: str | None = None
        has_child: set[int] = set()
        for index, nxt in enumerate(bg.pending):
            parent = old[nxt.parent]
            child = self._new_beam(group, index, [*parent.output_token_ids, nxt.token_id])
            children.append(child)
            computed = parent.num_computed_tokens
            if not parent.block_ids or computed != parent.num_known_tokens:
                continue
            copy = computed % bs != 0 and nxt.parent in has_child
            has_child.add(nxt.parent)
            while True:
                reply = yield ForkBlocks(parent.sample_id, child.sample_id, -(-computed // bs), copy)
                if isinstance(reply, BlocksForked):
                    break
                if not preempt or len(self._queue.running) == 1:
                    raise too_small(group, reply)  # a running group's forks fit by its cap
                victim = self._queue.running[-1]
                if victim is group:
                    for made in children:
                        if made.block_ids:
                            yield FreeRequest(made.sample_id)
                        del self._beam_owner[made.sample_id]
                    bg.generation -= 1
                    yield from self._preempt(group)
                    return "self"
                yield from self._preempt(victim)
                outcome = "preempted"
            child.block_ids = list(reply.block_ids)
            child.num_computed_tokens = computed
            child.num_cached_tokens = parent.num_cached_tokens
            bg.forked.add(child.sample_id)
            step.block_copies.extend(reply.copies)
        for beam in old:
            yield from self._drop_beam(group, beam)
        bg.beams = children
        bg.pending = []
        return outcome

    def _drop_beam(self, group: Request, beam: Request) -> Generator[AllocatorCall, AllocatorReply, None]:
        """Forget one beam: its table, its runner state, its key."""
        yield FreeRequest(beam.sample_id)  # see _drop_beam_tables
        if beam.seen_by_runner:
            self._finished_ids.append(beam.sample_id)
        self._beam_owner.pop(beam.sample_id, None)
        group.beam.forked.discard(beam.sample_id)

    def _drop_beam_tables(self, group: Request) -> Generator[AllocatorCall, AllocatorReply, None]:
        """Free every beam's table; each beam recomputes from the prompt (the runner keeps
        its tokens). Chunks planned before this write to freed blocks and are void."""
        for beam in group.beam.beams:
            # Unconditionally: a beam given its first blocks earlier in the plan that drops
            # it holds a table in the pool its block_ids do not show yet (they are taken
            # only once every beam's are); freeing an unknown table is a no-op.
            yield FreeRequest(beam.sample_id)
            beam.block_ids = []
            beam.num_computed_tokens = 0
            beam.last_chunk_end = 0
            beam.num_cached_blocks = 0
            beam.num_preemptions += 1
        group.beam.forked.clear()

    def _apply_beam_chunk(
        self, group: Request, chunk: ScheduledChunk, epochs: dict[str, int],
        sampled: dict[str, list[SampledToken]], failed: dict[str, str], calls: list[AllocatorCall],
    ) -> list[TokenDelta]:
        """One beam's chunk of a step's result; the group's deltas once its search ends."""
        bg = group.beam
        index = next((i for i, b in enumerate(bg.beams) if b.sample_id == chunk.sample_id), None)
        if index is None:
            return []
        beam = bg.beams[index]
        if chunk.sample_id in failed:
            calls.extend(self._finish(group, RequestStatus.FINISHED_ERROR))
            reason = failed[chunk.sample_id]
            return [TokenDelta(out, (), (), "error", reason) for out in bg.output_ids]
        if epochs[chunk.sample_id] == beam.num_preemptions and beam.sample_id not in bg.forked:
            calls.extend(self._computed(beam, chunk.start + chunk.num_tokens))
        if not chunk.sample:
            return []
        beam.num_pending_tokens -= 1
        tokens = sampled.get(chunk.sample_id)
        if not tokens:
            raise ProtocolError(f"no logprobs came back for beam {chunk.sample_id!r}")
        # The report stands even if the group was preempted since: the logprobs were
        # computed from the beam's tokens, whatever happened to its blocks after.
        nxt = bg.collect(index, tokens[0].top_logprobs)
        if nxt is None or nxt:
            return []
        calls.extend(self._finish(group, RequestStatus.FINISHED_STOPPED))
        return self._beam_deltas(group)

    def _beam_deltas(self, group: Request) -> list[TokenDelta]:
        """The finished search's answers, best first, one per output sample."""
        bg = group.beam
        best = bg.search.best(len(bg.output_ids))
        deltas = []
        for i, out in enumerate(bg.output_ids):
            if i >= len(best):  # a vocabulary smaller than the width: nothing more to return
                deltas.append(TokenDelta(out, (), (), "length", None, max(group.num_cached_tokens, 0)))
                continue
            hyp = best[i]
            reason, stop = bg.finish_reason(hyp)
            deltas.append(TokenDelta(out, hyp.token_ids, (), reason, stop,
                                     max(group.num_cached_tokens, 0),
                                     cumulative_logprob=hyp.cumulative_logprob,
                                     beam_score=hyp.score))
        return deltas

