"""The scheduler: which tokens of which requests each engine step computes.

One rule makes the whole policy: every step, each request is given tokens so that its
computed tokens catch up with its known tokens, under a token budget
(``max_num_batched_tokens``) and a sequence budget (``max_num_seqs``); running requests
first, in queue order, then waiting ones. A prompt longer than what is left of the budget
is split over steps (chunked prefill); a decode is a one-token catch-up. Only a chunk that
reaches the end of the known tokens samples.

:meth:`Scheduler.schedule` is a sans-IO generator: it yields allocator calls
(``engine.messages.AllocateSlots``, ``ReleaseBlocks`` and ``FreeRequest``), receives their replies and
returns the :class:`StepPlan`. The scheduler actor forwards the calls to the KV-allocator
actor; tests answer them with a :class:`BlockPool` through :func:`run_with_pool`.

Async scheduling: ``schedule()`` may run again before the previous plan's result arrived.
A request whose last chunk sampled counts one placeholder token per step in flight
(``Request.num_pending_tokens``), so its next position can be planned before its id is
known; the model runner holds the real ids.

When the allocator refuses blocks to a running request, the newest running request
(``fcfs``) or the lowest-priority, newest one (``priority``: a larger value is a lower
priority) is preempted: its blocks are freed and it returns to the front of the waiting
queue with nothing computed; its outputs are kept and recomputed as known tokens.

The policy's parts live beside it: the queues (``request_queue.py``), one step's plan and
one request's chunk (``planning.py``), the images' encoder budget (``encoder_budget.py``),
speculative decoding (``speculation.py``) and the configuration (``scheduler_config.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Generator, Iterable

from engine.core.beam_scheduling import BeamScheduling
from engine.core.block_pool import BlockPool
from engine.core.encoder_budget import EncoderBudget
from engine.core.kv_tier import KVTier, offer
from engine.core.planning import (
    StepDraft,
    add_chunk,
    allocate_call,
    fits_table,
    prefill_cap,
    release_out_of_window,
    too_small,
)
from engine.core.request import ProtocolError, Request, RequestStatus
from engine.core.request_queue import RequestQueue
from engine.core.scheduler_config import SchedulerConfig
from engine.core.speculation import (
    SpecCounters,
    accepted_count,
    choose_proposal,
    prediction_usage,
    speculates,
)
from engine.errors import InputTooLongError, InvalidParamError, PromptTooLongError
from engine.messages import (
    AllocatorCall,
    AllocatorReply,
    CacheBlocks,
    FreeRequest,
    NewRequest,
    SampledToken,
    ScheduledChunk,
    SchedulerRequest,
    SlotsAllocated,
    StepPlan,
    StepResult,
    TokenDelta,
)

__all__ = [
    "ScheduleGenerator",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SchedulerUpdate",
    "drive",
    "run_with_pool",
]

ScheduleGenerator = Generator[AllocatorCall, AllocatorReply, StepPlan]


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerStats:
    running: int
    waiting: int  # preempted requests included
    preemptions: int  # cumulative
    steps: int  # plans returned
    scheduled_tokens: int  # cumulative, over all plans
    finished: int  # cumulative, aborts included
    # Speculative decoding, cumulative (vLLM's spec_decode counters): verification steps
    # of requests with a proposal, tokens proposed, tokens accepted, and accepted tokens by
    # their place in the proposal.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA adapters (names, sorted) of the running and of the waiting requests (vLLM's
    # lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerUpdate:
    """What one step's result changed: a delta per sampled token of a live request, and
    the allocator calls (cache commits, then frees) to send before the next ``schedule()``."""

    deltas: tuple[TokenDelta, ...]
    allocator_calls: tuple[AllocatorCall, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Outcome:
    """One step's result by sample id."""

    sampled: dict[str, list[SampledToken]]
    failed: dict[str, str]
    pooled: dict[str, bytes]

    @classmethod
    def of(cls, result: StepResult) -> _Outcome:
        sampled: dict[str, list[SampledToken]] = {}
        for s in result.sampled:
            sampled.setdefault(s.sample_id, []).append(s)
        return cls(sampled, {f.sample_id: f.reason for f in result.failed},
                   {p.sample_id: p.data for p in result.pooled})


class Scheduler(BeamScheduling):
    """Continuous batching with chunked prefill, preemption by recompute and async
    scheduling; FCFS or priority queues. Pure: no I/O, no trio.

    Call order: :meth:`schedule` (drive the generator to its end before calling anything
    else), then for each plan, in plan order, :meth:`update_from_output`; send the
    allocator calls every method returns before the next ``schedule()``.
    """

    def __init__(self, config: SchedulerConfig, kv_tier: KVTier | None = None) -> None:
        self.config = config
        self.kv_tier = kv_tier  # the KV store's side (--kv-transfer-config), None: off
        self._queue = RequestQueue(config.policy)
        self._finished_ids: list[str] = []  # for the next plan: runner state to drop
        self._preempted_ids: list[str] = []  # for the next plan: recomputed from position 0
        self._in_flight: dict[int, dict[str, int]] = {}  # step id -> request id -> epoch
        self._next_step_id = 0
        self._step_cap = config.max_num_seqs  # this step's chunks at most (see _batch_cap)
        self._next_arrival = 0
        self._preemptions = 0
        self._scheduled_tokens = 0
        self._finished = 0
        self._spec = SpecCounters.for_config(config)
        self._beam_owner: dict[str, Request] = {}  # beam key -> its group's request

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, request: SchedulerRequest) -> Request:
        """Queue one sample. Raises :class:`PromptTooLongError` when the prompt leaves no
        room for an output in the context or in the KV pool; ``max_tokens`` is cut to fit."""
        limit = self._check_request(request)
        req = Request(
            request.sample_id,
            request.prompt_token_ids,
            request.params,
            # Pooling: one "sample" step (the pooled output), whatever the caller asked.
            max_tokens=1 if self.config.pooling else min(request.max_tokens, limit - len(request.prompt_token_ids)),
            eos_token_ids=request.eos_token_ids,
            priority=request.priority,
            arrival=self._next_arrival,
            cache_salt=request.cache_salt,
            wait_for=self._waitable(request.wait_for),
            prediction=request.prediction_token_ids,
            images=request.images,
            lora=request.lora,
            pool_tokens=request.pool_tokens,
        )
        self._next_arrival += 1
        if request.params.beam_width:
            self._start_beam_group(req, request)
        if self.kv_tier is not None:
            self.kv_tier.track(req, reads=self._prefix_lookup(req))
        self._queue.add(req)
        return req

    def _check_request(self, request: SchedulerRequest) -> int:
        """Refuse what can never run; return the longest the request may grow (its
        prompt and outputs)."""
        if request.sample_id in self._queue:
            raise InvalidParamError(f"sample id {request.sample_id!r} is in use", param="request_id")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise InvalidParamError("the prompt is empty", param="prompt")
        if request.max_tokens < 1:
            raise InvalidParamError(f"max_tokens must be >= 1, got {request.max_tokens}", param="max_tokens")
        limit = self.config.max_request_len
        # A pooling request draws no token: its prompt may fill the context.
        if self.config.pooling:
            if not self.config.paged_kv:  # whole in one step
                limit = min(limit, self.config.max_num_batched_tokens)
            if prompt_len > limit:
                raise InputTooLongError(prompt_tokens=prompt_len, max_model_len=limit)
        elif prompt_len >= limit:
            raise PromptTooLongError(prompt_tokens=prompt_len, max_tokens=request.max_tokens, max_model_len=limit)
        return limit

    def _waitable(self, sample_id: str | None) -> str | None:
        """Wait only for a live request still computing its prompt, and only when the
        prefix cache can share that prompt."""
        if sample_id is None or not self.config.enable_prefix_caching:
            return None
        return sample_id if self._queue.computing_prompt(sample_id) else None

    def finish_requests(self, sample_ids: Iterable[str], status: RequestStatus) -> list[AllocatorCall]:
        """Finish live requests from outside (abort, a stop string seen by the detokenizer).
        Unknown or already finished ids are ignored. Returns the frees to send."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        calls: list[AllocatorCall] = []
        for sample_id in sample_ids:
            req = self._queue.get(sample_id)
            if req is not None:
                calls.extend(self._finish(req, status))
        return calls

    def get_request(self, sample_id: str) -> Request | None:
        return self._queue.get(sample_id)

    def live_sample_ids(self) -> tuple[str, ...]:
        """Every live request (waiting or running), by sample id."""
        return self._queue.ids()

    def chunk_request(self, sample_id: str) -> Request | None:
        """The live request a chunk's ``sample_id`` computes for: itself, or a beam's group."""
        return self._queue.get(sample_id) or self._beam_owner.get(sample_id)

    @property
    def has_work(self) -> bool:
        """Live requests, or finished ones the runner has not been told about yet. An empty
        plan while this is true means: wait for the step in flight."""
        return bool(len(self._queue) or self._finished_ids or self._preempted_ids)

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._queue.running),
            waiting=len(self._queue.waiting),
            preemptions=self._preemptions,
            steps=self._next_step_id,
            scheduled_tokens=self._scheduled_tokens,
            finished=self._finished,
            spec_drafts=self._spec.drafts,
            spec_draft_tokens=self._spec.draft_tokens,
            spec_accepted_tokens=self._spec.accepted,
            spec_accepted_per_pos=tuple(self._spec.per_pos),
            running_loras=_lora_names(self._queue.running),
            waiting_loras=_lora_names(self._queue.waiting),
        )

    # -- planning -------------------------------------------------------------------------

    def schedule(self) -> ScheduleGenerator:
        """Plan one step; yields allocator calls, receives their replies, returns the plan."""
        encoder = EncoderBudget.for_step(self.config.encoder_budget, self._queue.running,
                                         whole=self.config.whole_images)
        step = StepDraft(self._next_step_id, self.config.max_num_batched_tokens, encoder)
        self._next_step_id += 1
        self._step_cap = self._batch_cap()
        preempted = yield from self._schedule_running(step)
        # Like vLLM: after a preemption this step, admitting new work would only thrash.
        if not preempted:
            yield from self._schedule_waiting(step)
        if step.chunks:
            self._in_flight[step.step_id] = step.epochs
            if self.kv_tier is not None:
                step.kv_saves = self.kv_tier.saves(step.chunks, self._queue.get)
        plan = step.plan(self._finished_ids, self._preempted_ids)
        self._finished_ids.clear()
        self._preempted_ids.clear()
        self._scheduled_tokens += self.config.max_num_batched_tokens - step.budget
        return plan

    def _schedule_running(self, step: StepDraft) -> Generator[AllocatorCall, AllocatorReply, bool]:
        """Give each running request its next chunk, in queue order, preempting from the
        back when the allocator refuses; returns whether anything was preempted."""
        config, running = self.config, self._queue.running
        preempted = False
        i = 0
        while i < len(running) and step.budget > 0:
            req = running[i]
            if req.beam is not None:
                outcome = yield from self._schedule_group(step, req, preempt=True)
                preempted = preempted or outcome is not None
                if outcome == "self":
                    return preempted  # it was the last one; nothing after it is running
                i += 1
                continue
            if not req.can_sample:
                i += 1  # every output is drawn; its last results are in flight
                continue
            if self._busy(req):
                i += 1  # pipeline: its step in flight has not come back
                continue
            if len(step.chunks) >= self._step_cap:
                return preempted  # pipeline: the rest go in the next batch
            if req.num_pending_tokens and speculates(config, req):
                i += 1  # not planned ahead: its proposal needs its last token (async scheduling)
                continue
            yield from release_out_of_window(req, config.sliding_window, config.block_size)
            budget = step.encoder.cut(req, req.num_computed_tokens, prefill_cap(req, step.budget, config.long_prefill_token_threshold))
            if budget == 0:
                i += 1  # its next image's encoder does not fit this step's encoder budget
                continue
            drafts, n_drafts = choose_proposal(config, req, budget, self._spec)
            reply = fits_table(req, budget, n_drafts, config.block_size, config.state_checkpoints)
            if reply is None:
                reply, preempted_here = yield from self._allocate_or_preempt(req, budget, n_drafts)
                preempted = preempted or preempted_here
                if reply is None:
                    return preempted  # it was the last one; nothing after it is running
            add_chunk(step, req, reply, drafts, n_drafts, config.block_size)
            i += 1
        return preempted

    def _batch_cap(self) -> int:
        """The most chunks one step takes. Under pipeline parallelism the live requests are
        spread over ``pipeline_parallel_size`` batches (a step takes a share of them), so
        that while one batch is in a later stage the next fills the first: one batch of
        every request would leave all stages but one idle. Otherwise no cap beyond
        ``max_num_seqs``."""
        if not self.config.one_step_per_request:
            return self.config.max_num_seqs
        live = min(self.config.max_num_seqs, len(self._queue.running) + len(self._queue.waiting))
        return max(1, -(-live // self.config.pipeline_stages))

    def _busy(self, req: Request) -> bool:
        """Whether ``req`` must sit this step out: under pipeline parallelism a request
        belongs to one step in flight at a time (vLLM's batch queue), since its next chunk
        reads tokens and KV that the stages hold only once that step has come back. A step
        in flight is one of at most ``pipeline_parallel_size``."""
        return self.config.one_step_per_request and any(
            req.sample_id in epochs for epochs in self._in_flight.values())

    def _allocate_or_preempt(
        self, req: Request, budget: int, n_drafts: int,
    ) -> Generator[AllocatorCall, AllocatorReply, tuple[SlotsAllocated | None, bool]]:
        """Allocate a running request's chunk, preempting the last running request while
        the allocator refuses: the slots (``None`` once ``req`` itself is preempted), and
        whether anything was preempted."""
        preempted = False
        while True:
            reply = yield allocate_call(req, budget, lookup=False, n_drafts=n_drafts)
            if isinstance(reply, SlotsAllocated):
                return reply, preempted
            # Refused: the victim is last in queue order, so never a request already planned.
            victim = self._queue.running[-1]
            if victim is req and len(self._queue.running) == 1:
                raise too_small(req, reply)  # reply: the refusal just received
            yield from self._preempt(victim)
            preempted = True
            if victim is req:
                return None, preempted

    def _schedule_waiting(self, step: StepDraft) -> Generator[AllocatorCall, AllocatorReply, None]:
        """Start waiting requests, in queue order, while the step has room and the
        allocator gives blocks (no overtaking)."""
        for req in tuple(self._queue.waiting):
            seats = sum(r.num_seats for r in self._queue.running)
            if (step.budget == 0 or seats + req.num_seats > self.config.max_num_seqs
                    or len(step.chunks) >= self._step_cap):
                return
            if req.wait_for is not None or not req.can_sample or self._busy(req) or KVTier.waiting(req):
                continue
            if not self._lora_fits(req):
                continue  # its adapter would be one too many this step; others may start
            if req.beam is not None:
                self._queue.start(req)
                req.status = RequestStatus.RUNNING
                if (yield from self._schedule_group(step, req, preempt=False)) == "refused":
                    return  # no overtaking: later requests wait for blocks too
                continue
            lookup = self._prefix_lookup(req)
            budget = prefill_cap(req, step.budget, self.config.long_prefill_token_threshold)
            if req.images and not lookup:  # its start is known: cut before allocating
                budget = step.encoder.cut(req, req.num_computed_tokens, budget)
                if budget == 0:
                    continue  # its first image's encoder does not fit this step
            if self.config.whole_prompts and req.num_known_tokens - req.num_computed_tokens > step.budget:
                return  # whole prompts only; it goes first in the next step
            if not self.config.paged_kv:
                if req.num_prompt_tokens > step.budget:
                    return  # whole prompts only; it goes first in the next step
                reply: AllocatorReply = SlotsAllocated(req.sample_id, 0, req.num_prompt_tokens, ())
            else:
                reply = yield allocate_call(req, budget, lookup=lookup, external=offer(self.kv_tier, req))
            if not isinstance(reply, SlotsAllocated):
                if not self._queue.running:
                    raise too_small(req, reply)
                return  # no overtaking: later requests wait for blocks too
            self._start(step, req, reply)
            if self.kv_tier is not None:
                self.kv_tier.took(req, reply, step.kv_loads)

    def _lora_fits(self, req: Request) -> bool:
        """Whether starting ``req`` keeps the running requests within ``max_loras`` distinct
        LoRA adapters (every running request may be in a step: their adapters must all
        have a slot at once)."""
        if req.lora is None or not self.config.max_loras:
            return True
        running = {r.lora.id for r in self._queue.running if r.lora is not None}
        return req.lora.id in running or len(running) < self.config.max_loras

    def _prefix_lookup(self, req: Request) -> bool:
        """Whether a waiting request's first table may start from the prefix cache."""
        # A prompt_logprobs request computes every prompt position: a cached block's
        # logits would be missing.
        # A pooling request pools every position (mean, max) or at least the last: its
        # hidden states, not the cache's K/V, are what it needs.
        return (self.config.enable_prefix_caching and req.params.prompt_logprobs is None
                and not self.config.pooling)

    def _start(self, step: StepDraft, req: Request, reply: SlotsAllocated) -> None:
        """Move a waiting request to running with its first chunk of this step."""
        self._queue.start(req)
        req.status = RequestStatus.RUNNING
        if not req.seen_by_runner:
            req.seen_by_runner = True
            step.new_requests.append(
                NewRequest(req.sample_id, req.prompt_token_ids, req.params, req.eos_token_ids,
                           req.images, req.lora, req.pool_tokens)
            )
        add_chunk(step, req, reply, (), 0, self.config.block_size)

    def preempt_running(self) -> Generator[AllocatorCall, AllocatorReply, int]:
        """Preempt every running request, last first, so that they wait again in their
        order ahead of the rest (vLLM's ``reset_running_requests``); how many were. Their
        blocks are freed; each recomputes its prompt and outputs when it runs again. An
        encoder's requests hold no block (each runs whole in one step): none is preempted."""
        if not self.config.paged_kv:
            return 0
        victims = list(self._queue.running)
        for req in reversed(victims):
            yield from self._preempt(req)
        return len(victims)

    def _preempt(self, req: Request) -> Generator[AllocatorCall, AllocatorReply, None]:
        if req.beam is not None:
            yield from self._drop_beam_tables(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.last_chunk_end = 0
        req.block_ids = []
        req.num_cached_blocks = 0
        req.num_released_blocks = 0
        req.num_preemptions += 1  # chunks planned before this now write to freed blocks
        self._preemptions += 1
        if req.seen_by_runner:
            self._preempted_ids.append(req.sample_id)
        self._queue.requeue(req)
        yield FreeRequest(req.sample_id)

    # -- results --------------------------------------------------------------------------

    def update_from_output(self, plan: StepPlan, result: StepResult) -> SchedulerUpdate:
        """Apply one step's sampled tokens, in plan order. Tokens of requests finished in
        the meantime are dropped; every other token is kept, even for a preempted request,
        because the runner already appended it to its copy. A request in
        ``result.failed`` finishes as ``"error"`` (the reason in the delta's
        ``stop_reason``) with none of its blocks cached."""
        if result.step_id != plan.step_id:
            raise ProtocolError(f"result of step {result.step_id} given for plan {plan.step_id}")
        epochs = self._in_flight.pop(plan.step_id, None)
        if epochs is None:
            if plan.chunks:
                raise ProtocolError(f"step {plan.step_id} is not in flight")
            return SchedulerUpdate((), ())
        outcome = _Outcome.of(result)
        deltas: list[TokenDelta] = []
        calls: list[AllocatorCall] = []
        for chunk in plan.chunks:
            req = self._queue.get(chunk.sample_id)
            if req is None:
                group = self._beam_owner.get(chunk.sample_id)
                if group is not None:
                    deltas.extend(self._apply_beam_chunk(group, chunk, epochs, outcome.sampled,
                                                          outcome.failed, calls))
                continue
            delta = self._apply_chunk(plan.step_id, req, chunk, epochs, outcome, calls)
            if delta is not None:
                deltas.append(delta)
        return SchedulerUpdate(tuple(deltas), tuple(calls))

    def _apply_chunk(
        self, step_id: int, req: Request, chunk: ScheduledChunk, epochs: dict[str, int],
        outcome: _Outcome, calls: list[AllocatorCall],
    ) -> TokenDelta | None:
        """Apply one live request's chunk of a step's result; the delta it causes, if any.
        The allocator calls it causes are appended to ``calls``."""
        if chunk.sample_id in outcome.failed:
            # Its chunk's KV writes are not trusted: nothing of it is cached, and its
            # blocks go back to the pool before the next plan.
            calls.extend(self._finish(req, RequestStatus.FINISHED_ERROR))
            return TokenDelta(req.sample_id, (), (), "error", outcome.failed[chunk.sample_id])
        current = epochs[chunk.sample_id] == req.num_preemptions
        if chunk.num_proposed:
            req.num_pending_tokens -= 1
            req.draft_token_ids = ()
            req.num_model_drafts = 0
            tokens = outcome.sampled.get(chunk.sample_id)
            if not tokens:
                raise ProtocolError(f"step {step_id} drew no token for {chunk.sample_id!r}")
            return self._apply_verified(req, chunk, tokens, current, calls)
        if current:
            calls.extend(self._computed(req, chunk.start + chunk.num_tokens))
        if not chunk.sample:
            return None
        req.num_pending_tokens -= 1
        if self.config.pooling:
            data = outcome.pooled.get(chunk.sample_id)
            if data is None:
                raise ProtocolError(f"step {step_id} pooled nothing for {chunk.sample_id!r}")
            calls.extend(self._finish(req, RequestStatus.FINISHED_STOPPED))
            return TokenDelta(req.sample_id, (), (), "stop", None, pooled=data)
        tokens = outcome.sampled.get(chunk.sample_id)
        if tokens is None:
            raise ProtocolError(f"step {step_id} drew no token for {chunk.sample_id!r}")
        return self._apply_token(req, tokens[0], calls)

    def _computed(self, req: Request, end: int) -> list[AllocatorCall]:
        """Positions below ``end`` are in the KV cache: commit full blocks, wake samples
        waiting for this prompt."""
        if end >= req.num_prompt_tokens:
            self._queue.prompt_computed(req.sample_id)
        if not self.config.enable_prefix_caching or not self.config.paged_kv:
            return []
        bs = self.config.block_size
        full = min(end, req.num_prompt_tokens + len(req.output_token_ids)) // bs
        if full <= req.num_cached_blocks:
            return []
        tokens = _token_slice(req, req.num_cached_blocks * bs, full * bs)
        req.num_cached_blocks = full
        return [CacheBlocks(req.sample_id, tokens)]

    def _apply_verified(
        self, req: Request, chunk: ScheduledChunk, tokens: list[SampledToken], current: bool,
        calls: list[AllocatorCall],
    ) -> TokenDelta:
        """A speculative step's result: the accepted proposal tokens then the model's own.

        The chunk computed the request's last token and the proposal; of those, the last
        token and the accepted proposal tokens (``tokens[:-1]``) are verified. The rejected
        ones' KV slots lie past ``num_computed_tokens`` and are overwritten by the next
        step; only verified tokens' blocks enter the prefix cache (the cache commit comes
        before the free when a token ends the request)."""
        self._spec.record(req, chunk.num_proposed, accepted_count(req, chunk, tokens))
        status = None
        applied: list[SampledToken] = []
        for token in tokens:
            applied.append(token)
            status = req.append_output(token.token_id)
            if status is not None:
                break
        if current:
            # Positions chunk.start .. chunk.start + len(applied) - 1 hold verified tokens.
            req.num_computed_tokens = chunk.start + len(applied)
            calls.extend(self._computed(req, req.num_computed_tokens))
        if status is not None:
            calls.extend(self._finish(req, status))
        return _delta(req, applied, status)

    def _apply_token(self, req: Request, token: SampledToken, calls: list[AllocatorCall]) -> TokenDelta:
        """A plain step's result: the one token it drew."""
        status = req.append_output(token.token_id)
        if status is not None:
            calls.extend(self._finish(req, status))
        return _delta(req, [token], status)

    def _finish(self, req: Request, status: RequestStatus) -> list[AllocatorCall]:
        calls: list[AllocatorCall] = []
        if req.beam is not None:
            for beam in req.beam.beams:
                calls.extend(self._drop_beam(req, beam))  # yields only FreeRequest
            req.beam.beams = []
        req.status = status
        self._queue.remove(req)
        if req.seen_by_runner:
            self._finished_ids.append(req.sample_id)
        self._finished += 1
        self._spec.finished(req)  # suffix decoding keeps its answer
        had_blocks = bool(req.block_ids)
        req.block_ids = []
        req.num_released_blocks = 0
        return calls + ([FreeRequest(req.sample_id)] if had_blocks else [])


async def drive(
    gen: ScheduleGenerator, call: Callable[[AllocatorCall], Awaitable[AllocatorReply]]
) -> StepPlan:
    """Run a sans-IO :meth:`Scheduler.schedule` generator to its plan, answering each
    allocator call it yields with ``await call(...)`` (the actor: a round trip to the
    KV-allocator actor)."""
    try:
        request = next(gen)
        while True:
            request = gen.send(await call(request))
    except StopIteration as stop:
        return stop.value


def run_with_pool(gen: ScheduleGenerator, pool: BlockPool) -> StepPlan:
    """:func:`drive` against a local pool, without an event loop (tests): the coroutine
    never suspends, so one ``send`` runs it to the end."""

    async def handle(call: AllocatorCall) -> AllocatorReply:
        return pool.handle(call)

    coroutine = drive(gen, handle)
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise ProtocolError("drive() suspended without an event loop")


def _lora_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


def _delta(req: Request, tokens: list[SampledToken], status: RequestStatus | None) -> TokenDelta:
    """The delta of ``tokens`` appended to ``req``, with the finish ``status`` they caused."""
    return TokenDelta(
        req.sample_id,
        tuple(t.token_id for t in tokens),
        tuple(tokens) if req.params.logprobs is not None else (),
        status.finish_reason if status else None,
        req.stop_reason if status else None,
        max(req.num_cached_tokens, 0),
        prediction_tokens=prediction_usage(req, status),
    )


def _token_slice(req: Request, start: int, end: int) -> tuple[int, ...]:
    prompt_len = req.num_prompt_tokens
    head = req.cache_prompt_ids[start:end]
    if end <= prompt_len:
        return head
    return head + tuple(req.output_token_ids[max(0, start - prompt_len) : end - prompt_len])
