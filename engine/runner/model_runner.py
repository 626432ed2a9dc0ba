"""The model runner: turns a :class:`StepPlan` into one forward pass and one sampling call.

It runs in the executor's worker thread and owns the model, the paged KV cache and each
request's tokens (prompt plus the outputs it sampled). A chunk names only ``(request,
start, num_tokens, block table, sample)``; the runner reads the tokens from its own copy,
which lets the scheduler plan step N+1 before step N's token is known, and lets a
preempted request be recomputed from position 0 with nothing resent.

One step's flat varlen batch (``B`` chunks, ``T`` tokens)::

    input_ids      [T]    chunk 0's tokens | chunk 1's tokens | ...
    positions      [T]    start .. start + num_tokens - 1 of each chunk
    slot_mapping   [T]    block_ids[pos // block_size] * block_size + pos % block_size
    query_start_loc[B+1]  0, n0, n0 + n1, ...
    seq_lens       [B]    start + num_tokens
    block_tables   [B, max_blocks], padded with 0
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import EngineError
from engine.messages import (
    ImageInput,
    NewRequest,
    PooledOutput,
    PromptLogprobs,
    RequestFailure,
    SampledToken,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from engine.models.llama import build_model
from engine.models.pooling import PoolerConfig
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel
from engine.params import SamplingParams, thinking_forced_token
from engine.runner.draft import DraftModel, Proposal
from engine.runner.kv_cache import allocate_kv_caches
from engine.runner.sampler import Sampler, SamplingFailure, SamplingRow, TokenBitmask
from engine.structured import GrammarBackend, Matcher, bitmask_words

logger = logging.getLogger("engine")

# What a client is told when the step its request was in raised; the exception itself
# goes to the log, never into a response.
STEP_FAILED = "internal error: the model step running this request failed"


class StepFailedError(EngineError):
    """A warm-up step failed; its cause is in the log."""


class StepPlanError(EngineError):
    """A plan the runner cannot execute (unknown request, tokens it does not have, over
    budget). It means the scheduler and the runner disagree: a bug, not a bad request."""


@dataclasses.dataclass(slots=True)
class _RequestState:
    prompt: tuple[int, ...]
    outputs: list[int]
    tokens: list[int]  # prompt + outputs, kept in step so chunks slice one list
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    # The next prompt token whose logprob is owed (prompt_logprobs requests); a chunk
    # recomputed after preemption does not report its tokens twice.
    prompt_logprobs_next: int = 1
    # Structured output: the sample's place in its grammar, having accepted every token of
    # ``outputs`` (built at its first sampling step; see ModelRunner._matcher).
    matcher: Matcher | None = None
    # Pooling: what the chunks so far add up to (fp32: a sum, a max or a chosen row).
    pool: torch.Tensor | None = None
    # A vision model's images (ImageInput, prompt order) and how far its prompt has been
    # run (the end of its last chunk): an image whose placeholders all lie below it no
    # longer needs its encoder output.
    images: tuple[ImageInput, ...] = ()
    prefilled: int = 0
    # M-RoPE (Qwen-VL): the prompt's [3, len(prompt)] positions (int64, host), and the
    # offset of every later token's position from its index (the same on all streams).
    mrope: torch.Tensor | None = None
    mrope_delta: int = 0
    # A draft model's progress (engine/runner/draft.py): where the target's verified
    # positions end after the last chunk, and where the draft's do (it may lag: the
    # positions between are run by the draft at the start of the next chunk).
    target_end: int = 0
    draft_end: int = 0


class ModelRunner:
    """Forward + sample over a paged KV cache, one :meth:`execute` per engine step.

    ``loaded`` is a :class:`engine.models.loader.LoadedModel` (``config``, ``weights``,
    ``dtype``). ``num_blocks`` KV blocks of ``block_size`` tokens (in ``kv_cache_dtype``:
    "auto" for the model dtype, or "int8"/"fp8" codes with scales) are allocated on
    ``device`` up front. Not thread-safe: call :meth:`execute` from one thread at a time.

    ``tp``: this runner is rank ``tp.rank`` of a tensor-parallel group. It holds that
    rank's slice of the model and of the KV pool (its KV heads), and every rank must be
    given the same plans in the same order (the collectives of a step pair up). The logits
    are the gathered full-vocabulary ones, bitwise the same on every rank, so with the same
    ``seed`` every rank samples the same tokens and keeps the same request state; the
    executor reads rank 0's :class:`StepResult` (the others' are equal).
    """

    def __init__(
        self,
        loaded: Any,
        *,
        device: torch.device | str,
        ops: Ops,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        grammar: GrammarBackend | None = None,
        pooler: PoolerConfig | None = None,
        tp: TensorParallel = SINGLE,
        draft: Any = None,
    ) -> None:
        self.device = torch.device(device)
        self.tp = tp
        self.config = loaded.config
        self.dtype = loaded.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.model = build_model(loaded.config, loaded.weights, ops, dtype=loaded.dtype, device=self.device, tp=tp)
        # A pooling model's requests end with their prompt: the step of the last chunk
        # pools the hidden states (see _pool) instead of sampling.
        self.pooler = pooler
        # An encoder keeps nothing between steps: no KV cache (its chunks carry no blocks).
        self.paged_kv = not loaded.config.is_encoder
        self.kv_caches = allocate_kv_caches(
            loaded.config, num_blocks, block_size, loaded.dtype, self.device, kv_cache_dtype=kv_cache_dtype, tp=tp
        ) if self.paged_kv else []
        self.sampler = Sampler(ops, seed=seed)
        # Speculative decoding's draft model (a LoadedModel given as ``draft``): its KV
        # cache has this pool's blocks, indexed by the same block tables.
        self.drafter = None if draft is None else DraftModel(
            draft, device=self.device, ops=ops, num_blocks=num_blocks, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, sampler=self.sampler, seed=seed)
        # Compiles structured-output specs and makes matchers; None: such requests fail.
        self.grammar = grammar
        # One row per sequence a step can hold, filled only for the constrained rows; reused
        # every step (int32, on the CPU where the grammar libraries write it). Speculative
        # verification samples several rows of a request: it grows to the widest step's rows.
        self._bitmask = torch.zeros(
            (max_num_seqs, bitmask_words(self.config.vocab_size)), dtype=torch.int32)
        # Time spent filling bitmasks and rows filled (the benchmark's per-token mask cost).
        self.mask_fill_seconds = 0.0
        self.mask_rows = 0
        self._requests: dict[str, _RequestState] = {}
        # A vision model's encoder outputs by image key ([num_image_tokens, hidden]), kept
        # while some request still has placeholder tokens of that image to prefill: a
        # chunk boundary inside an image, or the same image in two requests at once, runs
        # the encoder once.
        self._encoder_cache: dict[int, torch.Tensor] = {}
        self.encoder_runs = 0  # images encoded (tests and the benchmark read it)
        # Requests that failed in a step: their state is gone, chunks already planned for
        # them (async scheduling) are skipped until the scheduler's finished_ids names them.
        self._failed: set[str] = set()
        # The index tensors of small CPU steps, reused step after step (build_batch).
        self._host_batch = HostBatch() if self.device.type == "cpu" else None

    def reset(self) -> None:
        """Forget every request (the engine restarts its actors after a crash). The KV
        tensors are kept: the new block pool shares no cached block, so no stale entry is
        ever read before it is written."""
        self._requests.clear()
        self._failed.clear()
        self._encoder_cache.clear()

    @property
    def num_requests(self) -> int:
        """Requests whose state the runner holds."""
        return len(self._requests)

    def execute(self, plan: StepPlan) -> StepResult:
        """Forget ``plan.finished_ids``, learn ``plan.new_requests``, run ``plan.chunks``.

        Never raises for a fault of the step: if the forward or the sampling raises, every
        request of the step is reported in ``StepResult.failed`` (and forgotten), and the
        exception is logged. A row that cannot be sampled fails only its request.
        """
        t0 = time.perf_counter()
        for rid in plan.finished_ids:
            self._requests.pop(rid, None)
            self._failed.discard(rid)
        for new in plan.new_requests:
            self._add(new)
        chunks = tuple(c for c in plan.chunks if c.sample_id not in self._failed)
        if not chunks:
            return StepResult(plan.step_id, (), 0.0)
        sampled: tuple[SampledToken, ...] = ()
        failed: tuple[RequestFailure, ...] = ()
        prompt_logprobs: tuple[PromptLogprobs, ...] = ()
        pooled: tuple[PooledOutput, ...] = ()
        try:
            if self.pooler is not None:
                pooled = self._run_pooling(chunks)
            else:
                sampled, failed, prompt_logprobs = self._run(chunks)
        except Exception:
            logger.exception("model step %d failed; failing its %d requests", plan.step_id, len(chunks))
            failed = tuple(RequestFailure(c.sample_id, STEP_FAILED) for c in chunks)
            sampled, prompt_logprobs, pooled = (), (), ()
        for failure in failed:
            self._requests.pop(failure.sample_id, None)
            self._failed.add(failure.sample_id)
        if self._encoder_cache:
            self._evict_encoder_outputs()
        return StepResult(plan.step_id, sampled, time.perf_counter() - t0, prompt_logprobs, failed,
                          pooled)

    def _run(
        self, chunks: tuple[ScheduledChunk, ...]
    ) -> tuple[tuple[SampledToken, ...], tuple[RequestFailure, ...], tuple[PromptLogprobs, ...]]:
        states = [self._state(c) for c in chunks]
        drafted_q: dict[str, Proposal] = {}  # the proposals of sampled, unconstrained requests
        if self.drafter is not None:
            drafted = self.drafter.propose(chunks, states, build_batch)
            # The draft's tokens become the chunks' proposals, verified as any other.
            chunks = tuple(c if d is None else dataclasses.replace(
                c, draft_token_ids=d.token_ids, num_model_drafts=0) for c, d in zip(chunks, drafted, strict=True))
            drafted_q = {c.sample_id: d for c, d, s in zip(chunks, drafted, states, strict=True)
                         if d is not None and d.probs is not None
                         and s.params.structured_outputs is None}
        input_ids, positions, meta, sample_rows = self._prepare(chunks, states)
        mm = self._image_embeds(chunks, states)
        if mm is not None:
            hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, mm_embeds=mm)
        else:
            hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        prompt_logprobs = self._prompt_logprobs(hidden, chunks, states)
        before = [len(s.outputs) for s in states]
        sampled: tuple[SampledToken, ...] = ()
        failed: tuple[RequestFailure, ...] = ()
        if sample_rows:
            sampled, failed = self._sample(hidden, chunks, states, sample_rows, drafted_q)
        if self.drafter is not None:
            _track_draft(chunks, states, before, model_drafted={
                c.sample_id for c, d in zip(chunks, drafted, strict=True) if d is not None})
        return sampled, failed, prompt_logprobs

    def warm_up(self, prompt_len: int = 16) -> None:
        """One prefill and one decode step of a throwaway greedy request in the pool's
        first blocks, so the first real request does not pay for torch's first-call costs
        (thread pools, GEMM workspaces, kernel compilation). Leaves no request state
        behind; the blocks it wrote are free and are overwritten before any request reads
        them. A failing step raises :class:`StepFailedError` (its cause is logged)."""
        prompt_len = min(prompt_len, self.max_num_batched_tokens, self.num_blocks * self.block_size - 2)
        if prompt_len < 1:
            return  # a pool too small for even that: nothing worth warming
        rid = "warm-up"
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        table = tuple(range(-(-(prompt_len + 2) // self.block_size))) if self.paged_kv else ()
        prefill = ScheduledChunk(rid, 0, prompt_len, table, True)
        decode = ScheduledChunk(rid, prompt_len, 1, table, True)
        steps = [StepPlan(0, (NewRequest(rid, (0,) * prompt_len, params, ()),), (prefill,), ()),
                 StepPlan(1, (), (decode,), ())]
        if self.pooler is not None:
            steps = steps[:1]  # a pooling request ends with its prompt
        for plan in steps:
            result = self.execute(plan)
            if result.failed:
                # execute() logged the cause and dropped the request; fail loudly, not spin.
                raise StepFailedError(f"warm-up step {plan.step_id} failed: {result.failed[0].reason}")
        self.execute(StepPlan(2, (), (), (rid,)))

    # -- request state ------------------------------------------------------------------

    def _add(self, new: NewRequest) -> None:
        prompt = tuple(new.prompt_token_ids)
        state = _RequestState(
            prompt, [], list(prompt), new.params, tuple(new.eos_token_ids), images=tuple(new.images)
        )
        if self.config.mrope:
            from engine.models.qwen_vl import mrope_positions

            state.mrope, state.mrope_delta = mrope_positions(
                len(prompt), state.images, self.config.vision.spatial_merge_size)
        self._requests[new.sample_id] = state

    # -- images --------------------------------------------------------------------------

    def _image_embeds(
        self, chunks: Sequence[ScheduledChunk], states: Sequence[_RequestState]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rows, embeddings)`` of the step's image placeholder tokens, encoding each
        image not in the encoder cache once (all of them in one batch)."""
        spans: list[tuple[int, ImageInput, int, int]] = []  # (first row, image, from, to)
        row = 0
        for c, s in zip(chunks, states, strict=True):
            end = c.start + c.num_tokens
            for image in s.images:
                lo, hi = max(c.start, image.offset), min(end, image.offset + image.length)
                if lo < hi:
                    spans.append((row + lo - c.start, image, lo - image.offset, hi - image.offset))
            s.prefilled = end if c.start == 0 else max(s.prefilled, end)
            row += c.num_tokens
        if not spans:
            return None
        missing = {image.key: image for _, image, _, _ in spans if image.key not in self._encoder_cache}
        if missing:
            encoded: Sequence[torch.Tensor]
            if self.config.mrope:  # Qwen-VL: images of their own sizes, one list
                encoded = self.model.encode_image_inputs(list(missing.values()))  # type: ignore[attr-defined]
            else:
                pixels = torch.stack([
                    torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(image.shape)
                    for image in missing.values()])
                encoded = self.model.encode_images(pixels)  # type: ignore[attr-defined]
            self.encoder_runs += len(missing)
            for key, out in zip(missing, encoded, strict=True):
                self._encoder_cache[key] = out
        rows = torch.cat([torch.arange(r, r + hi - lo) for r, _, lo, hi in spans]).to(self.device)
        values = torch.cat([self._encoder_cache[image.key][lo:hi] for _, image, lo, hi in spans])
        return rows, values

    def _evict_encoder_outputs(self) -> None:
        """Drop the encoder outputs no live request still has placeholders of to prefill."""
        needed = {
            image.key
            for s in self._requests.values()
            for image in s.images
            if s.prefilled < image.offset + image.length
        }
        for key in [k for k in self._encoder_cache if k not in needed]:
            del self._encoder_cache[key]

    def _state(self, chunk: ScheduledChunk) -> _RequestState:
        state = self._requests.get(chunk.sample_id)
        if state is None:
            raise StepPlanError(f"chunk for unknown request {chunk.sample_id!r}")
        end = chunk.start + chunk.num_tokens
        known = len(state.tokens) + chunk.num_proposed
        if chunk.num_tokens < 1 or chunk.start < 0 or end > known:
            raise StepPlanError(
                f"request {chunk.sample_id!r}: chunk [{chunk.start}, {end}) is outside its "
                f"{known} known tokens"
            )
        if chunk.num_model_drafts and self.drafter is None:
            raise StepPlanError(f"request {chunk.sample_id!r}: a draft model's proposal "
                                "asked of a runner without a draft model")
        if chunk.num_proposed and (not chunk.sample or chunk.start >= len(state.tokens)
                                      or state.params.thinking_token_budget is not None):
            raise StepPlanError(f"request {chunk.sample_id!r}: a proposal on a chunk that "
                                "does not sample, or on a thinking-budget request")
        if chunk.sample and end != known:
            raise StepPlanError(
                f"request {chunk.sample_id!r}: sampling after token {end} but it has "
                f"{len(state.tokens)}"
            )
        if self.paged_kv and len(chunk.block_ids) * self.block_size < end:
            raise StepPlanError(
                f"request {chunk.sample_id!r}: {len(chunk.block_ids)} blocks cannot hold {end} tokens"
            )
        return state

    # -- batch ---------------------------------------------------------------------------

    def _prepare(
        self, chunks: Sequence[ScheduledChunk], states: Sequence[_RequestState]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The flat batch's tensors, built with a handful of ops whatever the batch size."""
        if len(chunks) > self.max_num_seqs:
            raise StepPlanError(f"{len(chunks)} chunks exceed max_num_seqs={self.max_num_seqs}")
        spans = []
        for c, s in zip(chunks, states, strict=True):
            end = c.start + c.num_tokens
            # The proposal follows the known tokens.
            spans.append((c.start, [*s.tokens[c.start : end], *c.draft_token_ids], c.block_ids))
        if sum(len(t) for _, t, _ in spans) > self.max_num_batched_tokens:
            raise StepPlanError(
                f"{sum(len(t) for _, t, _ in spans)} tokens exceed "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        input_ids, pos, meta = build_batch(spans, self.block_size, self.device, self._host_batch)
        if self.config.mrope:  # the rotary positions are M-RoPE's three streams
            pos = self._mrope_positions(chunks, states)
        ends = 0
        sample_rows = []
        for c in chunks:
            ends += c.num_tokens
            if c.sample:
                # A proposal of k tokens: the k + 1 last positions each draw a token.
                sample_rows.extend(range(ends - 1 - len(c.draft_token_ids), ends))
        return input_ids, pos, meta, sample_rows

    def _mrope_positions(
        self, chunks: Sequence[ScheduledChunk], states: Sequence[_RequestState]
    ) -> torch.Tensor:
        """[3, T]: each chunk's M-RoPE positions, the prompt's as computed at admission and
        every later token (outputs, proposals) at its index plus the request's delta."""
        streams: tuple[list[int], list[int], list[int]] = ([], [], [])
        for c, s in zip(chunks, states, strict=True):
            assert s.mrope is not None
            end = c.start + c.num_tokens
            cut = min(max(c.start, s.mrope.shape[1]), end)
            if cut > c.start:
                for out, rows in zip(streams, s.mrope[:, c.start : cut].tolist(), strict=True):
                    out.extend(rows)
            if end > cut:  # decode rows: plain Python, no tensor op per request
                later = range(cut + s.mrope_delta, end + s.mrope_delta)
                for out in streams:
                    out.extend(later)
        return torch.tensor(streams, dtype=torch.int64).to(self.device, non_blocking=True)

    # -- pooling ---------------------------------------------------------------------------

    def _run_pooling(self, chunks: tuple[ScheduledChunk, ...]) -> tuple[PooledOutput, ...]:
        """Forward the chunks; each one's rows add to its request's pool, and each chunk
        that ends its prompt (``sample``) gives the request's output."""
        assert self.pooler is not None
        states = [self._state(c) for c in chunks]
        input_ids, positions, meta, _ = self._prepare(chunks, states)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        done: list[tuple[str, torch.Tensor]] = []
        row = 0
        for c, s in zip(chunks, states, strict=True):
            rows = hidden[row : row + c.num_tokens]
            row += c.num_tokens
            s.pool = _pool_rows(self.pooler.pooling, s.pool, rows, c)
            if c.sample:
                assert s.pool is not None  # the last chunk always sets it
                pooled = s.pool
                if self.pooler.pooling == "mean":
                    pooled = pooled / len(s.prompt)
                done.append((c.sample_id, pooled))
        if not done:
            return ()
        vectors = torch.stack([v for _, v in done])
        if self.pooler.task == "classify":
            # Only a BertModel (models/bert.py) is built for a classify pooler.
            vectors = self.model.classify(vectors.to(self.dtype))  # type: ignore[attr-defined]
        elif self.pooler.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
        host = vectors.float().cpu().numpy().astype("<f4")
        return tuple(PooledOutput(sid, host[i].tobytes()) for i, (sid, _) in enumerate(done))

    # -- prompt logprobs -------------------------------------------------------------------

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        chunks: Sequence[ScheduledChunk],
        states: Sequence[_RequestState],
    ) -> tuple[PromptLogprobs, ...]:
        """What each ``prompt_logprobs`` request's chunk scores: the raw log-softmax of the
        logits at its positions, at the next prompt token and for the top-N."""
        out = []
        row = 0
        for chunk, state in zip(chunks, states, strict=True):
            top_n = state.params.prompt_logprobs
            if top_n is not None and state.prompt_logprobs_next < len(state.prompt):
                first, end, rows = _prompt_logprob_rows(chunk, state, row)
                if rows:
                    entries = self._score(hidden, rows, state.prompt[first:end], top_n)
                    out.append(PromptLogprobs(chunk.sample_id, first, entries))
                    state.prompt_logprobs_next = end
            row += chunk.num_tokens
        return tuple(out)

    def _score(
        self, hidden: torch.Tensor, rows: list[int], targets: Sequence[int], top_n: int
    ) -> tuple[TokenLogprob, ...]:
        entries: list[TokenLogprob] = []
        for at in range(0, len(rows), _PROMPT_LOGITS_ROWS):
            index = torch.tensor(rows[at : at + _PROMPT_LOGITS_ROWS], device=self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, index)), -1)
            want = torch.tensor(targets[at : at + _PROMPT_LOGITS_ROWS], device=self.device)
            chosen_t = logprobs.gather(1, want.unsqueeze(1))
            # 1 + how many tokens are more likely (ties share the better rank).
            ranks = ((logprobs > chosen_t).sum(-1) + 1).tolist()
            chosen = chosen_t.squeeze(1).tolist()
            if top_n:
                values, ids = logprobs.topk(top_n, dim=-1)
                tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
            else:
                tops = [()] * len(chosen)
            entries.extend(
                TokenLogprob(t, lp, top, rank)
                for t, lp, top, rank in zip(targets[at : at + _PROMPT_LOGITS_ROWS], chosen, tops,
                                            ranks, strict=True)
            )
        return tuple(entries)

    # -- sampling ------------------------------------------------------------------------

    def _sample(
        self,
        hidden: torch.Tensor,
        chunks: Sequence[ScheduledChunk],
        states: Sequence[_RequestState],
        sample_rows: list[int],
        drafted: dict[str, Proposal] | None = None,
    ) -> tuple[tuple[SampledToken, ...], tuple[RequestFailure, ...]]:
        """One token per sampling chunk, or, for a chunk with a proposal, the verification.

        Speculative verification: row ``j`` of a proposal ``d`` (k tokens) holds the
        logits after the known tokens and ``d[:j]``; it is sampled exactly as a decode step
        with those outputs would be (penalties, min_tokens and the seed's step counted
        with ``d[:j]``). The proposal is kept while each draw equals it: the tokens are the
        draws ``t_0 .. t_m`` where ``m`` is the first ``j`` with ``t_j != d[j]`` (or k).
        Each kept draw comes from the target's distribution given the verified tokens
        before it, so the output is distributed as without speculation (for a point-mass
        proposal this is the accept/resample rule: accept ``d[j]`` with probability
        ``p(d[j])``, else draw from ``p`` without ``d[j]``, renormalised).

        A draft model's proposal for a sampled request (``drafted``: its tokens and the
        distributions ``q`` they were drawn from) replaces the draws of its rows ``0 .. k-1``
        by the general rule (:func:`engine.runner.draft.accept_or_resample`): keep ``d[j]``
        with probability ``min(1, p/q)``, else draw from ``normalize(max(p - q, 0))``; row
        ``k`` is the plain draw (a structured-output request's proposal is verified as a
        point mass: its draws are masked, the draft's were not). Everything else (rows, penalties, logprobs, the keeping
        loop) is the shared path above."""
        picked = [(c, s) for c, s in zip(chunks, states, strict=True) if c.sample]
        # Under a grammar only the proposal's prefix the grammar takes is verified (the rows
        # after it are not sampled); each verified row is masked with the grammar's state
        # after the proposal tokens before it.
        proposals = [self._grammar_proposal(c, s) for c, s in picked]
        # One entry per sampled row: its chunk, state and place in the chunk's proposal.
        expanded = [(c, s, d, j) for (c, s), d in zip(picked, proposals, strict=True) for j in range(len(d) + 1)]
        kept_rows: list[int] = []
        at = 0
        for c, d in zip((c for c, _ in picked), proposals, strict=True):
            kept_rows.extend(sample_rows[at : at + len(d) + 1])
            at += len(c.draft_token_ids) + 1
        # The grammar masks are filled before the logits are computed: on a GPU the host
        # fills them while the device still runs the forward.
        bitmask, failed = self._fill_bitmask([(c, s, d[:j]) for c, s, d, j in expanded])
        if kept_rows == list(range(hidden.shape[0])):  # every row, in order (a decode step)
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(kept_rows, device=self.device)))
        sampling_rows = [
            SamplingRow(s.params, s.prompt, s.outputs if not j else [*s.outputs, *d[:j]], s.eos_token_ids)
            for c, s, d, j in expanded
        ]
        drawn_rows = self.sampler(logits, sampling_rows, bitmask)
        if drafted:
            self._apply_rejection_rule(logits, sampling_rows, picked, proposals, drawn_rows, drafted)
        out = []
        gone = {f.sample_id for f in failed}
        at = 0
        for (c, s), d in zip(picked, proposals, strict=True):
            k = len(d)
            draws, at = drawn_rows[at : at + k + 1], at + k + 1
            if c.sample_id in gone:
                continue
            kept: list[SampledToken] = []
            for j, drawn in enumerate(draws):
                if isinstance(drawn, SamplingFailure):
                    why = _dead_end(s) if j == 0 else None  # the matcher is at row 0
                    failed.append(RequestFailure(c.sample_id, why or drawn.reason))
                    kept = []
                    break
                token, logprob, top = drawn
                if s.matcher is not None and not s.matcher.ended and not s.matcher.accept(token):
                    # The mask allowed only tokens the grammar takes; this is a backend fault.
                    failed.append(RequestFailure(
                        c.sample_id, "the sampled token does not fit the structured output grammar"))
                    kept = []
                    break
                kept.append(SampledToken(c.sample_id, token, logprob, tuple(top)))
                if j == k or token != d[j]:
                    break  # the model's own token ends the step's output
            for t in kept:
                s.outputs.append(t.token_id)
                s.tokens.append(t.token_id)
            out.extend(kept)
        return tuple(out), tuple(failed)

    def _grammar_proposal(self, chunk: ScheduledChunk, state: _RequestState) -> tuple[int, ...]:
        """The part of ``chunk``'s proposal to verify: all of it, or under a grammar the
        prefix the grammar takes (none if the matcher cannot be had; ``_fill_bitmask``
        reports why)."""
        d = chunk.draft_token_ids
        if not d or state.params.structured_outputs is None:
            return d
        try:
            matcher = self._matcher(state)
        except (EngineError, ValueError):
            return ()
        return () if matcher.ended else d[: matcher.valid_prefix(d)]

    def _apply_rejection_rule(
        self, logits: torch.Tensor, sampling_rows: list[SamplingRow],
        picked: Sequence[tuple[ScheduledChunk, _RequestState]], verified: Sequence[tuple[int, ...]],
        drawn_rows: list[Any], drafted: dict[str, Proposal],
    ) -> None:
        """Replace, in ``drawn_rows``, the draws of the proposal rows of each chunk with a
        sampled draft model's proposal by the accept/resample rule's tokens (logprobs from
        the same adjusted logits as the draws'; top-N alternatives unchanged)."""
        assert self.drafter is not None
        at = 0
        for (c, s), d in zip(picked, verified, strict=True):
            k = len(d)  # the rows sampled: the whole proposal but under a grammar
            proposal = drafted.get(c.sample_id)
            if proposal is not None and k == len(proposal.token_ids) and not any(
                    isinstance(d, SamplingFailure) for d in drawn_rows[at : at + k]):
                index = torch.arange(at, at + k, device=logits.device)
                adjusted, p = self.sampler.distributions(
                    logits.index_select(0, index), sampling_rows[at : at + k])
                for j, (token, logprob) in enumerate(self.drafter.verify(proposal, p, adjusted, s)):
                    drawn_rows[at + j] = (token, logprob, drawn_rows[at + j][2])
            at += k + 1

    def _fill_bitmask(
        self, picked: Sequence[tuple[ScheduledChunk, _RequestState, tuple[int, ...]]]
    ) -> tuple[TokenBitmask | None, list[RequestFailure]]:
        """The token bitmask of the step's constrained rows (row ``i`` of the mask for
        batch row ``rows[i]``), and the requests whose grammar could not be set up.

        Each row comes with the proposal tokens before it (speculative verification): a
        constrained row is masked with the grammar's state after them (the matcher
        advances over them and is rolled back after the request's last row; they are
        accepted for real only once drawn). A row whose thinking budget is spent allows
        only the next token of the reasoning's end marker (ahead of any grammar: the
        grammar takes the marker where reasoning may end). A matcher that already ended
        (it accepted EOS; with async scheduling the step after may still be planned) gets
        no mask: its token is dropped by the scheduler."""
        constrained: list[int] = []
        failed: list[RequestFailure] = []
        if len(picked) > len(self._bitmask):
            self._bitmask = torch.zeros((len(picked), self._bitmask.shape[1]), dtype=torch.int32)
        t0 = time.perf_counter()
        for b, (c, s, before) in enumerate(picked):
            if s.params.thinking_token_budget is not None:
                # (Such a request carries no proposal: one row, after its outputs.)
                forced = thinking_forced_token(s.params, s.outputs)
                if forced is not None:
                    _allow_only(self._bitmask[len(constrained)], forced)
                    constrained.append(b)
                    continue
            if s.params.structured_outputs is None:
                continue
            if before:  # the request's earlier rows advanced its matcher over before[:-1]
                matcher = s.matcher
                if matcher is None or not matcher.accept(before[-1]):  # _grammar_proposal checked it
                    raise StepPlanError("a proposal token the grammar took is refused")
            else:
                try:
                    matcher = self._matcher(s)
                except (EngineError, ValueError) as exc:
                    failed.append(RequestFailure(c.sample_id, f"structured output: {exc}"))
                    continue  # (_grammar_proposal gave it no proposal: one row)
            last = b + 1 == len(picked) or picked[b + 1][0] is not c
            if not matcher.ended:
                matcher.fill(self._bitmask, len(constrained))
                constrained.append(b)
            if last:
                matcher.rollback(len(before))
        if not constrained:
            return None, failed
        self.mask_fill_seconds += time.perf_counter() - t0
        self.mask_rows += len(constrained)
        return TokenBitmask(self._bitmask[: len(constrained)], tuple(constrained)), failed

    def _matcher(self, state: _RequestState) -> Matcher:
        """The request's matcher, made on first use and fed the outputs it already has
        (none for a new request; all of them should one ever be rebuilt, e.g. after its
        state was recreated for a recompute)."""
        held = state.matcher
        if held is not None and (held.ended or held.accepted == len(state.outputs)):
            return held
        spec = state.params.structured_outputs
        if self.grammar is None or spec is None:
            raise StepPlanError("a structured-output request reached a runner without a "
                                "grammar backend")
        matcher = self.grammar.matcher(spec)
        for token in state.outputs:
            if matcher.ended:
                break  # tokens after EOS were planned ahead and are dropped
            if not matcher.accept(token):
                raise StepPlanError("the request's tokens do not fit its grammar")
        state.matcher = matcher
        return matcher


def _track_draft(
    chunks: Sequence[ScheduledChunk], states: Sequence[_RequestState], before: Sequence[int],
    model_drafted: set[str],
) -> None:
    """After a step: where each request's verified positions end for the target and for the
    draft. A proposal of ``k`` with ``m`` kept: the target verified the known tokens and
    ``m`` proposal tokens; the draft ran the known tokens and its own ``d_1 .. d_{k-1}``
    (none of a prediction's)."""
    for c, s, n in zip(chunks, states, before, strict=True):
        end = c.start + c.num_tokens
        k = c.num_proposed
        if not k:
            s.target_end = s.draft_end = end
            continue
        kept = len(s.outputs) - n
        if kept < 1:
            continue  # the request failed; its state is dropped
        known_end, m = end - k, kept - 1
        s.target_end = known_end + m
        s.draft_end = known_end + min(m, k - 1) if c.sample_id in model_drafted else known_end


def build_batch(
    spans: Sequence[tuple[int, Sequence[int], Sequence[int]]], block_size: int, device: torch.device,
    host: HostBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``(input_ids, positions, metadata)`` of a flat varlen batch (the module docstring's
    layout): one span ``(start, token ids, block table)`` per sequence, its tokens at
    positions ``start ..``. An empty block table everywhere: an encoder, no KV cache.
    With ``host``, a small CPU step's tensors are ``host``'s, reused by the next call."""
    ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    width = max(len(table) for _, _, table in spans)
    tables: list[int] = []
    for start, tokens, table in spans:
        ids.extend(tokens)
        positions.extend(range(start, start + len(tokens)))
        query_lens.append(len(tokens))
        seq_lens.append(start + len(tokens))
        tables.extend(table)
        tables.extend((0,) * (width - len(table)))
    batch = len(spans)
    if torch.device(device).type == "cpu" and len(ids) <= _HOST_BATCH_TOKENS and width:
        return _host_batch(ids, positions, tables, width, query_lens, seq_lens, block_size, host)
    # One host tensor holds every int index; slices of it go to the device in one copy.
    packed = torch.tensor(ids + positions + tables + query_lens + seq_lens, dtype=torch.int64)
    dev = packed.to(device, non_blocking=True)
    t = len(ids)
    input_ids, pos = dev[:t], dev[t : 2 * t]
    block_tables = dev[2 * t : 2 * t + batch * width].view(batch, width)
    qlens = dev[2 * t + batch * width : 2 * t + batch * width + batch]
    slens = dev[2 * t + batch * width + batch :]
    req = torch.repeat_interleave(torch.arange(batch, device=device), qlens, output_size=t)
    if width:
        blocks = block_tables[req, pos // block_size]
        slot_mapping = blocks * block_size + pos % block_size
    else:  # an encoder: no KV cache to write
        slot_mapping = pos.new_empty(0)
    query_start_loc = torch.nn.functional.pad(qlens.cumsum(0), (1, 0)).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=slens.to(torch.int32),
        block_tables=block_tables.to(torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return input_ids, pos, meta


# Steps of at most this many tokens on CPU (decode steps, speculative verification) get
# their index tensors from lists in Python: two tensor constructions instead of a dozen
# dispatched ops (~0.2 ms of a ~4 ms single-stream step on the 2-core dev machine).
_HOST_BATCH_TOKENS = 64


class HostBatch:
    """Index tensors a runner reuses for its small CPU steps (``build_batch``'s ``host``).

    After a decode step has streamed the model's weights through the caches, each torch op
    that builds the next step's tensors costs tens of microseconds; here the values are
    written through numpy views of two buffers, and the tensor views of a step's shape
    (tokens, rows, table width: the same for most steps of a stream) are made once. A
    step's tensors are valid until the next step is built (the runner runs one at a time).
    """

    def __init__(self) -> None:
        self._wide = self._narrow = None
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def fill(self, ids: list[int], positions: list[int], slots: list[int], tables: list[int],
             starts: list[int], seq_lens: list[int], width: int) -> tuple[torch.Tensor, ...]:
        t, batch = len(ids), len(seq_lens)
        wide_n, narrow_n = 3 * t, batch * width + 2 * batch + 1
        if self._wide is None or self._wide.numel() < wide_n or self._narrow.numel() < narrow_n:
            self._wide = torch.zeros(max(wide_n, 3 * _HOST_BATCH_TOKENS), dtype=torch.int64)
            self._narrow = torch.zeros(max(2 * narrow_n, 1024), dtype=torch.int32)
            self._wide_np, self._narrow_np = self._wide.numpy(), self._narrow.numpy()
            self._views.clear()
        w, n = self._wide_np, self._narrow_np
        w[:t], w[t : 2 * t], w[2 * t : 3 * t] = ids, positions, slots
        bw = batch * width
        n[:bw], n[bw : bw + batch + 1], n[bw + batch + 1 : narrow_n] = tables, starts, seq_lens
        key = (t, batch, width)
        views = self._views.get(key)
        if views is None:
            wide, narrow = self._wide, self._narrow
            views = (wide[:t], wide[t : 2 * t], wide[2 * t : 3 * t], narrow[:bw].view(batch, width),
                     narrow[bw : bw + batch + 1], narrow[bw + batch + 1 : narrow_n])
            if len(self._views) >= 64:
                self._views.clear()
            self._views[key] = views
        return views


def _host_batch(
    ids: list[int], positions: list[int], tables: list[int], width: int, query_lens: list[int],
    seq_lens: list[int], block_size: int, host: HostBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """build_batch's result for a small CPU batch, the same values computed on lists."""
    t, batch = len(ids), len(query_lens)
    slots: list[int] = []
    starts = [0]
    row = 0
    for b, q in enumerate(query_lens):
        for p in positions[row : row + q]:
            if p // block_size >= width:  # as indexing the padded table raises
                raise IndexError(f"position {p} is past the block table's {width} blocks")
            slots.append(tables[b * width + p // block_size] * block_size + p % block_size)
        row += q
        starts.append(row)
    if host is not None:
        input_ids, pos, slot_mapping, block_tables, query_start_loc, seq_lens_t = host.fill(
            ids, positions, slots, tables, starts, seq_lens, width)
    else:
        wide = torch.tensor(ids + positions + slots, dtype=torch.int64)
        narrow = torch.tensor(tables + starts + seq_lens, dtype=torch.int32)
        input_ids, pos, slot_mapping = wide[:t], wide[t : 2 * t], wide[2 * t :]
        block_tables = narrow[: batch * width].view(batch, width)
        query_start_loc = narrow[batch * width : batch * width + batch + 1]
        seq_lens_t = narrow[batch * width + batch + 1 :]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return input_ids, pos, meta


def _dead_end(state: _RequestState) -> str | None:
    """Why a constrained sample has nothing to sample, when its grammar is the cause: the
    output is complete (only EOS may follow) while min_tokens still forbids EOS. Admission
    refuses this where it can know it (a bounded regex or choice); a JSON schema's length
    is found out here."""
    matcher = state.matcher
    wanted = state.params.min_tokens
    if matcher is None or len(state.outputs) >= wanted or not matcher.complete():
        return None
    return (f"structured output: the constrained output is complete after "
            f"{len(state.outputs)} tokens and can only end there, but min_tokens asks for "
            f"{wanted}; no token can be sampled")


# Hidden rows turned into full-vocabulary logits at once for prompt logprobs: 256 rows of
# a 150k vocabulary are 150 MB of fp32, the most one step should add for a rare request.
_PROMPT_LOGITS_ROWS = 256


def _pool_rows(
    pooling: str, pool: torch.Tensor | None, rows: torch.Tensor, chunk: ScheduledChunk
) -> torch.Tensor | None:
    """A request's pool after one more chunk (fp32). A chunk from position 0 starts it
    afresh: a request recomputed after preemption pools its prompt once."""
    if chunk.start == 0:
        pool = None
    rows = rows.float()
    if pooling == "cls":
        return rows[0] if chunk.start == 0 else pool
    if pooling == "last":
        return rows[-1] if chunk.sample else pool
    if pooling == "mean":
        total = rows.sum(0)
        return total if pool is None else pool + total
    top = rows.max(0).values  # "max"
    return top if pool is None else torch.maximum(pool, top)


def _prompt_logprob_rows(
    chunk: ScheduledChunk, state: _RequestState, row: int
) -> tuple[int, int, list[int]]:
    """``(first, end, rows)``: the prompt tokens ``first .. end - 1`` this chunk scores and
    the hidden rows whose logits score them (position ``p`` scores prompt token ``p + 1``)."""
    first = max(state.prompt_logprobs_next, chunk.start + 1)
    end = min(chunk.start + chunk.num_tokens + 1, len(state.prompt))
    return first, end, [row + t - 1 - chunk.start for t in range(first, end)]


def _allow_only(row: torch.Tensor, token_id: int) -> None:
    """Make one bitmask row allow ``token_id`` alone (xgrammar's layout: bit ``t % 32`` of
    int32 word ``t // 32`` set means allowed)."""
    row.zero_()
    bit = token_id % 32
    # Bit 31 is the int32 sign bit.
    row[token_id // 32] = -(1 << 31) if bit == 31 else 1 << bit
