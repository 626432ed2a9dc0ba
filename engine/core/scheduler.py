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
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Awaitable, Callable, Generator, Iterable

from engine.config import EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.request import ProtocolError, Request, RequestStatus
from engine.core.spec import propose
from engine.errors import InputTooLongError, InvalidParamError, PromptTooLongError
from engine.messages import (
    NULL_BLOCK,
    AllocateSlots,
    AllocatorCall,
    AllocatorReply,
    BlocksReleased,
    CacheBlocks,
    FreeRequest,
    NewRequest,
    ReleaseBlocks,
    SampledToken,
    ScheduledChunk,
    SchedulerRequest,
    SlotsAllocated,
    StepPlan,
    StepResult,
    TokenDelta,
)

POLICIES = ("fcfs", "priority")

ScheduleGenerator = Generator[AllocatorCall, AllocatorReply, StepPlan]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's part of the engine configuration.

    ``num_kv_blocks`` must equal the allocator's pool size: a request is admitted only if
    it fits the pool alone, which is what guarantees that preemption always ends.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    num_kv_blocks: int
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    # The window every layer of the model slides (0: some layer attends to everything).
    # Blocks wholly before a request's next window are released to the pool as it grows.
    sliding_window: int = 0
    # A pooling model: a request ends once its prompt is computed (the runner pools it in
    # the step of its last chunk), with no token drawn; its blocks are freed then.
    pooling: bool = False
    # False for a bidirectional encoder: no KV cache at all, so no allocator call, and a
    # prompt runs whole in one step (it cannot be chunked: every token sees every token).
    paged_kv: bool = True
    # Speculative decoding (engine/core/spec.py): tokens proposed per decode step by
    # prompt lookup (0: off), and the lookup's suffix lengths.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Tokens proposed per step from a Predicted Outputs request's prediction (with or
    # without prompt lookup configured).
    num_prediction_tokens: int = 8
    # A vision model's encoder budget: image placeholder tokens whose encoder output a
    # step may compute (0: max_num_batched_tokens). See Scheduler._encoder_cut.
    max_num_encoder_input_tokens: int = 0
    # draft_model: the runner's draft model proposes num_speculative_tokens tokens for a
    # speculating decode step (the chunk reserves the positions; the runner fills them).
    draft_model: bool = False

    def __post_init__(self) -> None:
        # A plain ValueError: EngineConfig has checked the user's options and the KV sizing
        # the pool (ConfigError both); a bad value here is a caller's bug, not configuration.
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_encoder_input_tokens < 0:
            raise ValueError("max_num_encoder_input_tokens must be >= 0, got "
                             f"{self.max_num_encoder_input_tokens!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")

    @classmethod
    def from_engine_config(
        cls, config: EngineConfig, *, max_model_len: int, num_kv_blocks: int, sliding_window: int = 0,
        pooling: bool = False, paged_kv: bool = True,
    ) -> SchedulerConfig:
        """Take the scheduling fields of ``config``; the context length, the pool size and
        the window are resolved elsewhere (from the model and the memory budget)."""
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            policy=config.scheduling_policy,
            enable_prefix_caching=config.enable_prefix_caching,
            sliding_window=sliding_window,
            pooling=pooling,
            paged_kv=paged_kv,
            max_num_encoder_input_tokens=config.max_num_encoder_input_tokens or 0,
            **_speculative_fields(config),
        )

    @property
    def encoder_budget(self) -> int:
        """Image placeholder tokens whose encoder output one step may compute."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def max_request_len(self) -> int:
        """Prompt plus outputs of one request: the context, or the whole pool if smaller."""
        if not self.paged_kv:
            return self.max_model_len
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)


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


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerUpdate:
    """What one step's result changed: a delta per sampled token of a live request, and
    the allocator calls (cache commits, then frees) to send before the next ``schedule()``."""

    deltas: tuple[TokenDelta, ...]
    allocator_calls: tuple[AllocatorCall, ...]


@dataclasses.dataclass(slots=True)
class _Step:
    """A plan being built."""

    step_id: int
    budget: int
    new_requests: list[NewRequest] = dataclasses.field(default_factory=list)
    chunks: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    epochs: dict[str, int] = dataclasses.field(default_factory=dict)
    # Images: what is left of the encoder budget, the images the runner holds an encoder
    # output of when the step starts, and those this step's chunks encode (by key).
    encoder_budget: int = 0
    encoder_held: frozenset[int] = frozenset()
    encoding: set[int] = dataclasses.field(default_factory=set)


class Scheduler:
    """Continuous batching with chunked prefill, preemption by recompute and async
    scheduling; FCFS or priority queues. Pure: no I/O, no trio.

    Call order: :meth:`schedule` (drive the generator to its end before calling anything
    else), then for each plan, in plan order, :meth:`update_from_output`; send the
    allocator calls every method returns before the next ``schedule()``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []
        self._running: list[Request] = []  # kept in queue order: the victim is the last
        self._waiters: dict[str, list[Request]] = {}  # request id -> samples waiting for its prompt
        self._prompt_pending: set[str] = set()  # live requests whose prompt is not all computed
        self._finished_ids: list[str] = []  # for the next plan: runner state to drop
        self._in_flight: dict[int, dict[str, int]] = {}  # step id -> request id -> epoch
        self._next_step_id = 0
        self._next_arrival = 0
        self._preemptions = 0
        self._scheduled_tokens = 0
        self._finished = 0
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted = 0
        self._spec_per_pos = [0] * max(config.num_speculative_tokens, config.num_prediction_tokens)
        self._key: Callable[[Request], tuple[int, ...]] = (
            _priority_key if config.policy == "priority" else _fcfs_key
        )

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, request: SchedulerRequest) -> Request:
        """Queue one sample. Raises :class:`PromptTooLongError` when the prompt leaves no
        room for an output in the context or in the KV pool; ``max_tokens`` is cut to fit."""
        if request.sample_id in self._requests:
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
        req = Request(
            request.sample_id,
            request.prompt_token_ids,
            request.params,
            # Pooling: one "sample" step (the pooled output), whatever the caller asked.
            max_tokens=1 if self.config.pooling else min(request.max_tokens, limit - prompt_len),
            eos_token_ids=request.eos_token_ids,
            priority=request.priority,
            arrival=self._next_arrival,
            cache_salt=request.cache_salt,
            wait_for=self._waitable(request.wait_for),
            prediction=request.prediction_token_ids,
            images=request.images,
        )
        self._next_arrival += 1
        self._requests[req.sample_id] = req
        self._prompt_pending.add(req.sample_id)
        if req.wait_for is not None:
            self._waiters.setdefault(req.wait_for, []).append(req)
        self._enqueue_waiting(req, front=False)
        return req

    def finish_requests(self, sample_ids: Iterable[str], status: RequestStatus) -> list[AllocatorCall]:
        """Finish live requests from outside (abort, a stop string seen by the detokenizer).
        Unknown or already finished ids are ignored. Returns the frees to send."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        calls: list[AllocatorCall] = []
        for sample_id in sample_ids:
            req = self._requests.get(sample_id)
            if req is not None:
                calls.extend(self._finish(req, status))
        return calls

    def get_request(self, sample_id: str) -> Request | None:
        return self._requests.get(sample_id)

    @property
    def has_work(self) -> bool:
        """Live requests, or finished ones the runner has not been told about yet. An empty
        plan while this is true means: wait for the step in flight."""
        return bool(self._requests or self._finished_ids)

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            preemptions=self._preemptions,
            steps=self._next_step_id,
            scheduled_tokens=self._scheduled_tokens,
            finished=self._finished,
            spec_drafts=self._spec_drafts,
            spec_draft_tokens=self._spec_draft_tokens,
            spec_accepted_tokens=self._spec_accepted,
            spec_accepted_per_pos=tuple(self._spec_per_pos),
        )

    # -- planning -------------------------------------------------------------------------

    def schedule(self) -> ScheduleGenerator:
        """Plan one step; yields allocator calls, receives their replies, returns the plan."""
        step = _Step(self._next_step_id, self.config.max_num_batched_tokens,
                     encoder_budget=self.config.encoder_budget, encoder_held=self._encoder_held())
        self._next_step_id += 1
        preempted = yield from self._schedule_running(step)
        # Like vLLM: after a preemption this step, admitting new work would only thrash.
        if not preempted:
            yield from self._schedule_waiting(step)
        if step.chunks:
            self._in_flight[step.step_id] = step.epochs
        plan = StepPlan(step.step_id, tuple(step.new_requests), tuple(step.chunks), tuple(self._finished_ids))
        self._finished_ids.clear()
        self._scheduled_tokens += self.config.max_num_batched_tokens - step.budget
        return plan

    def _schedule_running(self, step: _Step) -> Generator[AllocatorCall, AllocatorReply, bool]:
        preempted = False
        i = 0
        while i < len(self._running) and step.budget > 0:
            req = self._running[i]
            if not req.can_sample:
                i += 1  # every output is drawn; its last results are in flight
                continue
            if req.num_pending_tokens and self._speculates(req):
                i += 1  # not planned ahead: its proposal needs its last token (async scheduling)
                continue
            yield from self._release_out_of_window(req)
            budget = self._encoder_cut(step, req, req.num_computed_tokens, step.budget)
            if budget == 0:
                i += 1  # its next image's encoder does not fit this step's encoder budget
                continue
            drafts, n_drafts = self._propose(req, budget)
            reply: AllocatorReply | None = self._fits_table(req, budget, n_drafts)
            while not isinstance(reply, SlotsAllocated):
                reply = yield self._allocate_call(req, budget, lookup=False, n_drafts=n_drafts)
                if isinstance(reply, SlotsAllocated):
                    break
                # Refused: the victim is last in queue order, so never a request already planned.
                victim = self._running[-1]
                if victim is req and len(self._running) == 1:
                    raise _too_small(req, reply)  # reply: the refusal just received
                yield from self._preempt(victim)
                preempted = True
                if victim is req:
                    return preempted  # it was the last one; nothing after it is running
            self._add_chunk(step, req, reply, drafts, n_drafts)
            i += 1
        return preempted

    def _speculates(self, req: Request) -> bool:
        """Whether ``req`` gets proposals: prompt lookup is on or it has a prediction, and
        no thinking budget forces its tokens (the runner masks one row per request). Under
        a grammar the runner verifies the prefix of the proposal the grammar takes."""
        return bool(self.config.num_speculative_tokens or req.prediction) and (
            req.params.thinking_token_budget is None)

    def _propose(self, req: Request, budget: int) -> tuple[tuple[int, ...], int]:
        """The tokens to verify after ``req``'s next one this step, and how many: a decode
        step of a request whose every token is known (none in flight), with room left in
        ``max_tokens`` and the budget. With a draft model the runner proposes them in the
        step: ``((), k)``."""
        config = self.config
        if req.prediction:
            k = config.num_prediction_tokens
        else:
            k = config.num_speculative_tokens
        k = min(k, req.max_tokens - req.num_sampled - 1, budget - 1)
        if (k < 1 or req.num_pending_tokens or req.num_known_tokens - req.num_computed_tokens != 1
                or not self._speculates(req)):
            return (), 0
        if req.prediction:
            drafts, start = propose(req.known_token_ids(), req.prediction, k, config.prompt_lookup_max,
                                    config.prompt_lookup_min, after=req.prediction_pos)
            if start >= 0:
                req.prediction_pos = start
            return drafts, len(drafts)
        if config.draft_model:
            return (), k
        drafts = propose(req.known_token_ids(), None, k, config.prompt_lookup_max,
                         config.prompt_lookup_min)[0]
        return drafts, len(drafts)

    def _schedule_waiting(self, step: _Step) -> Generator[AllocatorCall, AllocatorReply, None]:
        for req in tuple(self._waiting):
            if step.budget == 0 or len(self._running) >= self.config.max_num_seqs:
                return
            if req.wait_for is not None or not req.can_sample:
                continue
            # A prompt_logprobs request computes every prompt position: a cached block's
            # logits would be missing.
            # A pooling request pools every position (mean, max) or at least the last: its
            # hidden states, not the cache's K/V, are what it needs.
            lookup = (self.config.enable_prefix_caching and req.params.prompt_logprobs is None
                      and not self.config.pooling)
            budget = step.budget
            if req.images and not lookup:  # its start is known: cut before allocating
                budget = self._encoder_cut(step, req, req.num_computed_tokens, budget)
                if budget == 0:
                    continue  # its first image's encoder does not fit this step
            if not self.config.paged_kv:
                if req.num_prompt_tokens > step.budget:
                    return  # whole prompts only; it goes first in the next step
                reply: AllocatorReply = SlotsAllocated(req.sample_id, 0, req.num_prompt_tokens, ())
            else:
                reply = yield self._allocate_call(req, budget, lookup=lookup)
            if not isinstance(reply, SlotsAllocated):
                if not self._running:
                    raise _too_small(req, reply)
                return  # no overtaking: later requests wait for blocks too
            self._waiting.remove(req)
            req.status = RequestStatus.RUNNING
            bisect.insort(self._running, req, key=self._key)
            if not req.seen_by_runner:
                req.seen_by_runner = True
                step.new_requests.append(
                    NewRequest(req.sample_id, req.prompt_token_ids, req.params, req.eos_token_ids,
                               req.images)
                )
            self._add_chunk(step, req, reply, (), 0)

    def _fits_table(self, req: Request, budget: int, n_drafts: int) -> SlotsAllocated | None:
        """The chunk when the request's blocks already hold it (most decode steps): no
        allocator round trip; ``None`` when blocks must be allocated."""
        count = min(req.num_known_tokens + n_drafts - req.num_computed_tokens, budget)
        if req.num_computed_tokens + count > len(req.block_ids) * self.config.block_size:
            return None
        return SlotsAllocated(req.sample_id, 0, count, ())

    def _release_out_of_window(self, req: Request) -> Generator[AllocatorCall, AllocatorReply, None]:
        """Give back the blocks no layer will read again. The next chunk's first query sits
        at ``num_computed_tokens`` and sees keys from ``num_computed_tokens - window + 1``
        on; later queries see later keys. Chunks planned earlier and still in flight run
        before any step that could reuse a released block, so they still read it intact."""
        window = self.config.sliding_window
        if not window:
            return
        first_seen = max(0, req.num_computed_tokens - window + 1)
        releasable = min(first_seen // self.config.block_size, len(req.block_ids))
        if releasable <= req.num_released_blocks:
            return
        reply = yield ReleaseBlocks(req.sample_id, releasable)
        if not isinstance(reply, BlocksReleased) or reply.num_released_blocks != releasable:
            raise ProtocolError(f"expected {releasable} blocks of {req.sample_id!r} released, got {reply!r}")
        for i in range(req.num_released_blocks, releasable):
            req.block_ids[i] = NULL_BLOCK
        req.num_released_blocks = releasable

    def _allocate_call(
        self, req: Request, budget: int, *, lookup: bool, n_drafts: int = 0
    ) -> AllocateSlots:
        first = not req.block_ids
        return AllocateSlots(
            req.sample_id,
            req.num_computed_tokens,
            req.num_known_tokens + n_drafts,
            budget,
            req.known_token_ids() if lookup and first else (),
            req.cache_salt if first else None,
        )

    def _add_chunk(
        self, step: _Step, req: Request, reply: AllocatorReply, drafts: tuple[int, ...],
        n_drafts: int,
    ) -> None:
        """Plan ``req``'s chunk: ``n_drafts`` positions past its known tokens verify a
        proposal, ``drafts`` (from prompt lookup or a prediction) or, where that is empty,
        the runner's draft model's."""
        if not isinstance(reply, SlotsAllocated) or reply.sample_id != req.sample_id:
            raise ProtocolError(f"expected SlotsAllocated for {req.sample_id!r}, got {reply!r}")
        if not req.block_ids:  # a new table: its cached prefix is what the pool shared
            req.num_computed_tokens += reply.num_cached_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = reply.num_cached_tokens
            req.num_cached_blocks = reply.num_cached_tokens // self.config.block_size
        req.block_ids.extend(reply.block_ids)
        start, count = req.num_computed_tokens, reply.num_new_tokens
        known = req.num_known_tokens + n_drafts
        if not 0 < count <= step.budget or start + count > known:
            raise ProtocolError(f"{reply!r} does not fit {req!r} with budget {step.budget}")
        if req.images:
            # A new request's start is known only now (its prefix-cache hit): the blocks of
            # tokens cut here stay in its table for its next chunk.
            count = self._encoder_cut(step, req, start, count, commit=True)
            if count == 0:
                return
        sample = start + count == known
        if n_drafts and not sample:
            raise ProtocolError(f"{reply!r} cuts the proposal of {req!r}")
        req.draft_token_ids = drafts
        model_drafts = 0 if drafts else n_drafts
        req.num_model_drafts = model_drafts
        step.chunks.append(ScheduledChunk(req.sample_id, start, count, tuple(req.block_ids), sample,
                                          drafts, model_drafts))
        step.epochs[req.sample_id] = req.num_preemptions
        step.budget -= count
        req.num_computed_tokens += count
        req.last_chunk_end = req.num_computed_tokens
        if sample:
            req.num_pending_tokens += 1

    # -- the encoder budget -----------------------------------------------------------------

    def _encoder_held(self) -> frozenset[int]:
        """The images whose encoder output the runner keeps into the next step: those a
        running request's last chunk ended inside of (the runner drops an output once no
        request has placeholders of it left to prefill; see ModelRunner._image_embeds)."""
        return frozenset(
            image.key
            for req in self._running if req.images
            for image in req.images
            if image.offset < req.last_chunk_end < image.offset + image.length
        )

    def _encoder_cut(self, step: _Step, req: Request, start: int, count: int, *,
                     commit: bool = False) -> int:
        """How many of the ``count`` tokens from ``start`` of ``req`` fit the step's encoder
        budget: every image whose placeholders the chunk reaches must have its encoder
        output held by the runner, be encoded by this step already, or be encoded in this
        step whole; the chunk stops before the first image that cannot. An image larger
        than the whole budget runs alone in a step (else it never would). ``commit``: the
        chunk is taken, spend the budget."""
        budget, encoding = step.encoder_budget, set()
        end = start + count
        for image in req.images:
            if image.offset >= end:
                break  # in prompt order: the rest lie past the chunk
            if (image.offset + image.length <= start or image.key in step.encoder_held
                    or image.key in step.encoding or image.key in encoding):
                continue
            alone = budget == self.config.encoder_budget and not step.encoding and not encoding
            if image.length > budget and not alone:
                end = max(start, image.offset)
                break
            budget -= min(image.length, budget)
            encoding.add(image.key)
        if commit:
            step.encoder_budget = budget
            step.encoding |= encoding
        return end - start

    def _preempt(self, req: Request) -> Generator[AllocatorCall, AllocatorReply, None]:
        self._running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.last_chunk_end = 0
        req.block_ids = []
        req.num_cached_blocks = 0
        req.num_released_blocks = 0
        req.num_preemptions += 1  # chunks planned before this now write to freed blocks
        self._preemptions += 1
        self._enqueue_waiting(req, front=True)
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
        sampled: dict[str, list[SampledToken]] = {}
        for s in result.sampled:
            sampled.setdefault(s.sample_id, []).append(s)
        failed = {f.sample_id: f.reason for f in result.failed}
        pooled = {p.sample_id: p.data for p in result.pooled}
        deltas: list[TokenDelta] = []
        calls: list[AllocatorCall] = []
        for chunk in plan.chunks:
            req = self._requests.get(chunk.sample_id)
            if req is None:
                continue
            if chunk.sample_id in failed:
                # Its chunk's KV writes are not trusted: nothing of it is cached, and its
                # blocks go back to the pool before the next plan.
                calls.extend(self._finish(req, RequestStatus.FINISHED_ERROR))
                deltas.append(TokenDelta(req.sample_id, (), (), "error", failed[chunk.sample_id]))
                continue
            current = epochs[chunk.sample_id] == req.num_preemptions
            if chunk.num_proposed:
                req.num_pending_tokens -= 1
                req.draft_token_ids = ()
                req.num_model_drafts = 0
                tokens = sampled.get(chunk.sample_id)
                if not tokens:
                    raise ProtocolError(f"step {plan.step_id} drew no token for {chunk.sample_id!r}")
                deltas.append(self._apply_verified(req, chunk, tokens, current, calls))
                continue
            if current:
                calls.extend(self._computed(req, chunk.start + chunk.num_tokens))
            if chunk.sample and self.config.pooling:
                req.num_pending_tokens -= 1
                data = pooled.get(chunk.sample_id)
                if data is None:
                    raise ProtocolError(f"step {plan.step_id} pooled nothing for {chunk.sample_id!r}")
                calls.extend(self._finish(req, RequestStatus.FINISHED_STOPPED))
                deltas.append(TokenDelta(req.sample_id, (), (), "stop", None, pooled=data))
            elif chunk.sample:
                req.num_pending_tokens -= 1
                tokens = sampled.get(chunk.sample_id)
                if tokens is None:
                    raise ProtocolError(f"step {plan.step_id} drew no token for {chunk.sample_id!r}")
                deltas.append(self._apply_token(req, tokens[0], calls))
        return SchedulerUpdate(tuple(deltas), tuple(calls))

    def _computed(self, req: Request, end: int) -> list[AllocatorCall]:
        """Positions below ``end`` are in the KV cache: commit full blocks, wake samples
        waiting for this prompt."""
        if end >= req.num_prompt_tokens:
            self._release_waiters(req.sample_id)
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
        drafts = chunk.draft_token_ids  # empty for a draft model's proposal (never sent back)
        proposed = chunk.num_proposed
        accepted = len(tokens) - 1
        if not 0 <= accepted <= proposed or any(
                t.token_id != d for t, d in zip(tokens[:-1], drafts, strict=False)):
            raise ProtocolError(f"tokens {[t.token_id for t in tokens]} do not follow the "
                                f"proposal {drafts or proposed} of {req.sample_id!r}")
        self._spec_drafts += 1
        self._spec_draft_tokens += proposed
        self._spec_accepted += accepted
        for i in range(accepted):
            self._spec_per_pos[i] += 1
        req.num_draft_tokens += proposed
        req.num_accepted_tokens += accepted
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
        return TokenDelta(
            req.sample_id,
            tuple(t.token_id for t in applied),
            tuple(applied) if req.params.logprobs is not None else (),
            status.finish_reason if status else None,
            req.stop_reason if status else None,
            max(req.num_cached_tokens, 0),
            prediction_tokens=_prediction_usage(req, status),
        )

    def _apply_token(self, req: Request, token: SampledToken, calls: list[AllocatorCall]) -> TokenDelta:
        status = req.append_output(token.token_id)
        if status is not None:
            calls.extend(self._finish(req, status))
        return TokenDelta(
            req.sample_id,
            (token.token_id,),
            (token,) if req.params.logprobs is not None else (),
            status.finish_reason if status else None,
            req.stop_reason if status else None,
            max(req.num_cached_tokens, 0),
            prediction_tokens=_prediction_usage(req, status),
        )

    # -- queues ---------------------------------------------------------------------------

    def _finish(self, req: Request, status: RequestStatus) -> list[AllocatorCall]:
        req.status = status
        del self._requests[req.sample_id]
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._release_waiters(req.sample_id)
        if req.seen_by_runner:
            self._finished_ids.append(req.sample_id)
        self._finished += 1
        had_blocks = bool(req.block_ids)
        req.block_ids = []
        req.num_released_blocks = 0
        return [FreeRequest(req.sample_id)] if had_blocks else []

    def _enqueue_waiting(self, req: Request, *, front: bool) -> None:
        if self.config.policy == "priority":
            bisect.insort(self._waiting, req, key=self._key)
        elif front:
            self._waiting.insert(0, req)
        else:
            self._waiting.append(req)

    def _waitable(self, sample_id: str | None) -> str | None:
        """Wait only for a live request still computing its prompt, and only when the
        prefix cache can share that prompt."""
        if sample_id is None or not self.config.enable_prefix_caching:
            return None
        return sample_id if sample_id in self._prompt_pending else None

    def _release_waiters(self, sample_id: str) -> None:
        self._prompt_pending.discard(sample_id)
        for waiter in self._waiters.pop(sample_id, ()):
            waiter.wait_for = None


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


def _speculative_fields(config: EngineConfig) -> dict[str, int | bool]:
    spec = config.speculative
    if spec is None:
        return {}
    return {"num_speculative_tokens": spec.num_speculative_tokens,
            "prompt_lookup_max": spec.prompt_lookup_max,
            "prompt_lookup_min": spec.prompt_lookup_min,
            "num_prediction_tokens": spec.num_speculative_tokens,
            "draft_model": spec.method == "draft_model"}


def _prediction_usage(req: Request, status: RequestStatus | None) -> tuple[int, int] | None:
    """``(accepted, rejected)`` prediction tokens, on a Predicted Outputs request's last delta."""
    if status is None or not req.prediction:
        return None
    return req.num_accepted_tokens, req.num_draft_tokens - req.num_accepted_tokens


def _fcfs_key(req: Request) -> tuple[int, ...]:
    return (req.arrival,)


def _priority_key(req: Request) -> tuple[int, ...]:
    return (req.priority, req.arrival)


def _token_slice(req: Request, start: int, end: int) -> tuple[int, ...]:
    prompt_len = req.num_prompt_tokens
    head = req.cache_prompt_ids[start:end]
    if end <= prompt_len:
        return head
    return head + tuple(req.output_token_ids[max(0, start - prompt_len) : end - prompt_len])


def _too_small(req: Request, reply: AllocatorReply) -> ProtocolError:
    return ProtocolError(
        f"{req!r} alone does not fit the KV pool ({reply!r}): SchedulerConfig.num_kv_blocks "
        "must equal the pool's size"
    )
