"""The model runner: turns a :class:`StepPlan` into one forward pass and one sampling call.

It runs in the executor's worker thread and owns the model, the paged KV cache and each
request's tokens (prompt plus the outputs it sampled). A chunk names only ``(request,
start, num_tokens, block table, sample)``; the runner reads the tokens from its own copy,
which lets the scheduler plan step N+1 before step N's token is known, and lets a
preempted request be recomputed from position 0 with nothing resent.

Its parts, one module each: the request state (``request_state``), the step's flat batch
(``batch``, whose docstring has the layout), sampling and speculative verification
(``verify``), a draft model's proposals (``draft``), prompt logprobs (``prompt_logprobs``),
a pooling model's outputs (``pooling``) and LoRA adapters (``lora``: each request's
adapter held read, the step's adapters in the model's slots, each token's slot). The runner itself keeps the request table,
the vision encoder's cache and the order of a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import EngineError, LoraAdapterError
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
)
from engine.models.pooling import PoolerConfig, read_dense
from engine.models.registry import build_model
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel
from engine.params import SamplingParams
from engine.pixels import unpack
from engine.runner.batch import BatchBuilder
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes, describe
from engine.runner.draft import DraftModel, Proposal, track_draft
from engine.runner.kv_cache import allocate_kv_caches, copy_blocks, release_pages, resident_bytes
from engine.runner.logits_processors import ProcessorBatch, ProcessorConfig
from engine.runner.lora import LoraManager, LoraSettings
from engine.runner.pooling import pool_outputs
from engine.runner.prompt_logprobs import collect_prompt_logprobs
from engine.runner.request_state import RequestState, StepPlanError
from engine.runner.sampler import Sampler
from engine.runner.sleep import LEVEL_TAGS, check_tags, trim_heap
from engine.runner.state_slots import StateSlots
from engine.runner.verify import Verifier
from engine.structured import GrammarBackend

logger = logging.getLogger("engine")

# What a client is told when the step its request was in raised; the exception itself
# goes to the log, never into a response.
STEP_FAILED = "internal error: the model step running this request failed"


class StepFailedError(EngineError):
    """A warm-up step failed; its cause is in the log."""


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
        logits_processors: Sequence[type] = (),
        lora: LoraSettings | None = None,
        decode_graphs: bool = False,
        max_model_len: int | None = None,
        state_checkpoints: int = 0,
        reload: Any = None,
        reload_draft: Any = None,
    ) -> None:
        self.device = torch.device(device)
        # Sleep mode: what sleeps now (engine.runner.sleep's tags), and how the weights are
        # read again after a level 2 sleep (a callable giving the checkpoint's tensors, as
        # the model was built from; None: level 2 is refused).
        self._reload, self._reload_draft = reload, reload_draft
        self.sleeping: set[str] = set()
        self._lora_settings = lora
        self._lora_kept: Any = None  # a level 2 sleep's adapters read (host weights, pins)
        self.tp = tp
        self.config = loaded.config
        self.dtype = loaded.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self._ops = ops
        self.model = build_model(loaded.config, loaded.weights, ops, dtype=loaded.dtype, device=self.device, tp=tp)
        # A pooling model's requests end with their prompt: the step of the last chunk
        # pools the hidden states (see _run_pooling) instead of sampling.
        self.pooler = pooler
        # sentence-transformers' Dense modules after the pooling, fp32 on the device.
        self._dense = [dataclasses.replace(d, weight=d.weight.to(self.device),
                                           bias=None if d.bias is None else d.bias.to(self.device))
                       for d in (read_dense(loaded.folder, p) for p in (pooler.dense if pooler else ()))]
        # An encoder keeps nothing between steps: no KV cache (its chunks carry no blocks).
        self.paged_kv = not loaded.config.is_encoder
        self.kv_caches = allocate_kv_caches(
            loaded.config, num_blocks, block_size, loaded.dtype, self.device, kv_cache_dtype=kv_cache_dtype, tp=tp,
            state_slots=max_num_seqs + state_checkpoints,
        ) if self.paged_kv else []
        # A hybrid model's recurrent layers: each running request's state slot, then the
        # prefix cache's state checkpoints.
        self.state_slots = (StateSlots(max_num_seqs, self.device, state_checkpoints)
                            if getattr(loaded.config, "recurrent", None) is not None else None)
        # The server's logits processors (--logits-processors: classes, built here once).
        self.sampler = Sampler(ops, seed=seed, processors=ProcessorBatch.build(
            logits_processors, ProcessorConfig(loaded.config.vocab_size, max_num_seqs), self.device))
        # LoRA adapters (--enable-lora): slots beside the model's projections, filled from
        # the adapters' folders as requests name them.
        self.lora = None if lora is None else LoraManager(self.model, loaded.config, lora)
        # Speculative decoding's draft model (a LoadedModel given as ``draft``): its KV
        # cache has this pool's blocks, indexed by the same block tables.
        self.drafter = None if draft is None else DraftModel(
            draft, device=self.device, ops=ops, num_blocks=num_blocks, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, sampler=self.sampler, seed=seed)
        # Compiles structured-output specs and makes matchers; None: such requests fail.
        self.grammar = grammar
        # The sampling half of a step: logits, grammar masks, speculative verification.
        self.verifier = Verifier(
            self.model, self.sampler, device=self.device, vocab_size=self.config.vocab_size,
            max_num_seqs=max_num_seqs, grammar=grammar, drafter=self.drafter)
        self._requests: dict[str, RequestState] = {}
        # A vision model's encoder outputs by image key ([num_image_tokens, hidden]), kept
        # while some request still has placeholder tokens of that image to prefill: a
        # chunk boundary inside an image, or the same image in two requests at once, runs
        # the encoder once.
        self._encoder_cache: dict[int, torch.Tensor] = {}
        self.encoder_runs = 0  # images encoded (tests and the benchmark read it)
        # Requests that failed in a step: their state is gone, chunks already planned for
        # them (async scheduling) are skipped until the scheduler's finished_ids names them.
        self._failed: set[str] = set()
        # The KV store (engine.runner.kv_store, --kv-transfer-config): the plans' blocks read
        # are copied in before a step, its prompt blocks written after it. None: off.
        self.kv_store: Any = None
        # The flat batch of a step's chunks (its index tensors reused on CPU).
        self._batch = BatchBuilder(
            block_size=block_size, device=self.device, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, mrope=bool(loaded.config.mrope))
        # CUDA graphs of the decode forward (captured at the end of warm_up); None: eager.
        self.graphs: DecodeGraphs | None = None
        if decode_graphs and self._graphs_apply():
            self.graphs = DecodeGraphs(
                lambda ids, pos, meta: self.model.forward(ids, pos, meta, self.kv_caches),
                device=self.device, sizes=capture_sizes(max_num_seqs), block_size=block_size,
                max_model_len=max_model_len or self.config.max_position_embeddings)

    def _graphs_apply(self) -> bool:
        """Whether this runner's decode steps can replay graphs, with the reason logged
        when not: a single-rank decoder on Triton kernels, without adapters."""
        why = None
        if not self.paged_kv or self.pooler is not None:
            why = "a pooling or encoder model has no decode steps"
        elif self.config.mrope:
            why = "M-RoPE positions are computed per step"
        elif getattr(self.model, "cross_attention", False):
            why = "each request's rows attend to its own clip's encoder output"
        elif self.state_slots is not None:
            why = "recurrent layers' states are read by slot per step"
        elif self.lora is not None:
            why = "LoRA steps set each token's adapter slot per step"
        elif self.tp.enabled or self.tp.stage.enabled:
            why = "tensor- and pipeline-parallel ranks run eagerly"
        elif type(self._ops).__name__ != "TritonOps":
            why = "only the Triton kernels take a replayed step's metadata from device buffers"
        if why is not None:
            logger.info("CUDA graphs off: %s", why)
        return why is None

    def sleep(self, level: int) -> int:
        """Sleep mode (engine.runner.sleep): level 1 gives back the KV cache's memory, level
        2 the weights' too. No step may run until :meth:`wake_up` has woken everything; the
        scheduler has dropped its prefix cache (the KV contents are forgotten). Returns how
        far this process's resident memory fell."""
        if level not in LEVEL_TAGS:
            raise ValueError(f"sleep level must be 0, 1 or 2, not {level}")
        before = resident_bytes()
        if "kv_cache" in LEVEL_TAGS[level] and "kv_cache" not in self.sleeping:
            release_pages(self.kv_caches)
            if self.drafter is not None:
                release_pages(self.drafter.kv_caches)
            self._encoder_cache.clear()
            self.sleeping.add("kv_cache")
        if "weights" in LEVEL_TAGS[level] and "weights" not in self.sleeping:
            self._let_go_of_weights()
            self.sleeping.add("weights")
        return before - resident_bytes()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back what sleeps of ``tags`` (None: everything): the KV cache's pages come
        back zeroed as they are touched; the weights are read again and the model rebuilt
        as startup built it (its adapters' slots empty, filled again as steps need them)."""
        wanted = check_tags(tuple(tags) if tags else None)
        if "weights" in wanted and "weights" in self.sleeping:
            self._build_weights()
            self.sleeping.discard("weights")
        if "kv_cache" in wanted:
            self.sleeping.discard("kv_cache")

    def reload_weights(self) -> None:
        """Read the checkpoint again and rebuild the model from it (vLLM's
        ``reload_weights``: a trainer wrote new weights). The scheduler has preempted the
        running requests and dropped the prefix cache: KV computed with the old weights is
        never read again. A model whose weights sleep is woken instead. Should the
        checkpoint not load, the weights are left asleep (no step runs; a ``wake_up``
        tries again)."""
        if "weights" not in self.sleeping:
            self._let_go_of_weights()  # the old model goes before the new one is built
            self.sleeping.add("weights")
        self._build_weights()
        self.sleeping.discard("weights")

    def _let_go_of_weights(self) -> None:
        if self._reload is None or (self.drafter is not None and self._reload_draft is None):
            raise ValueError("this runner cannot read its weights again")
        # The adapters read stay in host memory (and the requests holding them), the slots
        # go with the model they sit in.
        self._lora_kept = None if self.lora is None else (self.lora._host, self.lora._pins)
        self.model = self.verifier.model = self.lora = None
        if self.drafter is not None:
            self.drafter.model = None
        trim_heap()

    def _build_weights(self) -> None:
        """The model (and a draft model) built again from the checkpoint, as startup built
        it, its adapters' slots empty (filled again as steps need them)."""
        weights = self._reload()
        self.model = build_model(self.config, weights, self._ops, dtype=self.dtype,
                                 device=self.device, tp=self.tp)
        del weights
        self.verifier.model = self.model
        if self.kv_store is not None:  # new weights: blocks of a folder of their own
            self.kv_store.refresh()
        if self.drafter is not None:
            self.drafter.rebuild(self._reload_draft())
        if self._lora_settings is not None:
            self.lora = LoraManager(self.model, self.config, self._lora_settings)
            if self._lora_kept is not None:
                self.lora._host, self.lora._pins = self._lora_kept
            self._lora_kept = None

    def reset(self) -> None:
        """Forget every request (the engine restarts its actors after a crash). The KV
        tensors are kept: the new block pool shares no cached block, so no stale entry is
        ever read before it is written."""
        for rid in list(self._requests):
            self._forget(rid)
        self._failed.clear()
        self._encoder_cache.clear()
        if self.sampler.processors is not None:
            self.sampler.processors.reset()

    @property
    def num_requests(self) -> int:
        """Requests whose state the runner holds."""
        return len(self._requests)

    @property
    def mask_fill_seconds(self) -> float:
        """Time spent filling structured-output bitmasks (the benchmark's per-token mask cost)."""
        return self.verifier.mask_fill_seconds

    @property
    def mask_rows(self) -> int:
        """Bitmask rows filled."""
        return self.verifier.mask_rows

    def execute(self, plan: StepPlan) -> StepResult:
        """Forget ``plan.finished_ids``, learn ``plan.new_requests``, run ``plan.chunks``.

        Never raises for a fault of the step: if the forward or the sampling raises, every
        request of the step is reported in ``StepResult.failed`` (and forgotten), and the
        exception is logged. A row that cannot be sampled fails only its request.
        """
        t0 = time.perf_counter()
        for rid in plan.finished_ids:
            self._forget(rid)
            self._failed.discard(rid)
        if self.state_slots is not None:
            for rid in plan.preempted_ids:  # recomputed from position 0: a fresh slot then
                self.state_slots.release(rid)
        refused: list[RequestFailure] = []
        for new in plan.new_requests:
            try:
                self._add(new)
            except LoraAdapterError as exc:  # its adapter's folder changed since it was checked
                refused.append(RequestFailure(new.sample_id, str(exc)))
                self._failed.add(new.sample_id)
        # Before any chunk writes: a copy's source may be the block a sibling beam writes
        # into this very step.
        copy_blocks(self.kv_caches, plan.block_copies, self.device)
        if self.drafter is not None and plan.block_copies:
            copy_blocks(self.drafter.kv_caches, plan.block_copies, self.device)
        if plan.kv_loads:  # blocks a request holds even where its chunk waits (an image's)
            self.kv_store.load(self.kv_caches, plan.kv_loads)
        chunks = tuple(c for c in plan.chunks if c.sample_id not in self._failed)
        if chunks and self.sleeping:
            # The scheduler plans nothing while the engine sleeps; a step that comes anyway
            # fails its requests rather than read forgotten memory.
            logger.error("step %d planned while the model sleeps (%s)", plan.step_id,
                         ", ".join(sorted(self.sleeping)))
            refused += [RequestFailure(c.sample_id, STEP_FAILED) for c in chunks]
            for c in chunks:
                self._forget(c.sample_id)
                self._failed.add(c.sample_id)
            chunks = ()
        if not chunks:
            return StepResult(plan.step_id, (), 0.0, failed=tuple(refused))
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
        failed = (*refused, *failed)
        for failure in failed:
            self._forget(failure.sample_id)
            self._failed.add(failure.sample_id)
        if plan.kv_saves:
            self._save_blocks(plan, failed)
        if self._encoder_cache:
            self._evict_encoder_outputs()
        return StepResult(plan.step_id, sampled, time.perf_counter() - t0, prompt_logprobs, failed,
                          pooled)

    def _save_blocks(self, plan: StepPlan, failed: Sequence[RequestFailure]) -> None:
        """Write the plan's completed prompt blocks to the KV store, but a failed request's;
        a store that cannot take them costs the sharing, never the step."""
        bad = {f.sample_id for f in failed}
        try:
            self.kv_store.save(self.kv_caches, [(b, d) for s, b, d in plan.kv_saves if s not in bad])
        except Exception:
            logger.exception("step %d: writing its KV blocks to the store failed", plan.step_id)

    def _run(
        self, chunks: tuple[ScheduledChunk, ...]
    ) -> tuple[tuple[SampledToken, ...], tuple[RequestFailure, ...], tuple[PromptLogprobs, ...]]:
        states = [self._state(c) for c in chunks]
        drafted_q: dict[str, Proposal] = {}  # the proposals of sampled, unconstrained requests
        if self.drafter is not None:
            drafted = self.drafter.propose(chunks, states)
            # The draft's tokens become the chunks' proposals, verified as any other.
            chunks = tuple(c if d is None else dataclasses.replace(
                c, draft_token_ids=d.token_ids, num_model_drafts=0) for c, d in zip(chunks, drafted, strict=True))
            drafted_q = {c.sample_id: d for c, d, s in zip(chunks, drafted, states, strict=True)
                         if d is not None and d.probs is not None
                         and s.params.structured_outputs is None}
        input_ids, positions, meta, sample_rows = self._batch.prepare(chunks, states)
        meta = self._with_state_slots(meta, chunks)
        mm = self._image_embeds(chunks, states)
        with self._lora_step(chunks, states):
            if getattr(self.model, "cross_attention", False):  # Whisper
                hidden = self.model.forward(input_ids, positions, meta, self.kv_caches,
                                            cross=self._cross_spans(chunks, states))
            elif mm is not None:
                hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, mm_embeds=mm)
            elif self.graphs is None or (hidden := self.graphs.run(input_ids, positions, meta)) is None:
                hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        if hidden is None:
            # A pipeline stage before the last: its hidden states went to the next stage;
            # the last stage samples, and its tokens come back through accept().
            return (), (), ()
        prompt_logprobs = collect_prompt_logprobs(self.model, hidden, chunks, states, self.device)
        before = [len(s.outputs) for s in states]
        sampled: tuple[SampledToken, ...] = ()
        failed: tuple[RequestFailure, ...] = ()
        if sample_rows:
            sampled, failed = self.verifier.sample(hidden, chunks, states, sample_rows, drafted_q)
        if self.drafter is not None:
            track_draft(chunks, states, before, model_drafted={
                c.sample_id for c, d in zip(chunks, drafted, strict=True) if d is not None})
        return sampled, failed, prompt_logprobs

    def accept(self, sampled: Sequence[tuple[str, int]], failed: Sequence[str]) -> None:
        """A pipeline stage before the last: take the tokens the last stage sampled (and
        forget the requests it failed), so that the next chunks of those requests find
        their tokens here. Each request's step must be accepted before its next chunk
        runs (the scheduler plans a request's next step only after its tokens return)."""
        for sample_id, token_id in sampled:
            state = self._requests.get(sample_id)
            if state is not None:
                state.outputs.append(token_id)
                state.tokens.append(token_id)
        for sample_id in failed:
            self._forget(sample_id)
            self._failed.add(sample_id)

    def _lora_step(self, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState]):
        """The forward's adapters: each token's slot for the step (a no-op without LoRA)."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.slots.step(self.lora.segments(chunks, states))

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
        images: tuple[ImageInput, ...] = ()
        if getattr(self.model, "cross_attention", False):  # Whisper reads a clip: silence
            audio = self.config.vision
            shape = (audio.num_mel_bins, audio.max_frames)  # type: ignore[union-attr]
            images = (ImageInput(0, 0, 0, bytes(4 * shape[0] * shape[1]), shape, (shape[1],)),)
        steps = [StepPlan(0, (NewRequest(rid, (0,) * prompt_len, params, (), images=images),),
                          (prefill,), ()),
                 StepPlan(1, (), (decode,), ())]
        if self.pooler is not None:
            steps = steps[:1]  # a pooling request ends with its prompt
        for plan in steps:
            result = self.execute(plan)
            if result.failed:
                # execute() logged the cause and dropped the request; fail loudly, not spin.
                raise StepFailedError(f"warm-up step {plan.step_id} failed: {result.failed[0].reason}")
            if not self.tp.stage.last:
                # The last stage samples; a throwaway request's token value does not matter
                # here, only that the next chunk finds a token.
                self.accept([(rid, 0)], ())
        self.execute(StepPlan(2, (), (), (rid,)))
        if self.graphs is not None:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Capture the decode graphs (after the warm-up compiled the kernels); a capture
        that fails leaves the runner eager, with the cause logged."""
        assert self.graphs is not None
        try:
            self.graphs.capture()
        except Exception:
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            self.graphs = None
            return
        if self.graphs.captured:
            logger.info(describe(self.graphs))

    # -- request state ------------------------------------------------------------------

    def _add(self, new: NewRequest) -> None:
        prompt = tuple(new.prompt_token_ids)
        state = RequestState(
            prompt, [], list(prompt), new.params, tuple(new.eos_token_ids), images=tuple(new.images),
            pool_tokens=new.pool_tokens,
        )
        if new.lora is not None:
            if self.lora is None:
                raise LoraAdapterError(new.lora.name, "this engine was started without --enable-lora")
            self.lora.acquire(new.lora)  # held read until the request ends
            state.lora = new.lora
        if self.config.mrope:
            state.mrope, state.mrope_delta = self.model.prompt_positions(len(prompt), state.images)  # type: ignore[attr-defined]
        self._requests[new.sample_id] = state

    def _with_state_slots(self, meta: AttentionMetadata, chunks: Sequence[ScheduledChunk]) -> AttentionMetadata:
        """``meta`` with each chunk's recurrent-state slot (a hybrid model's), else as is."""
        if self.state_slots is None:
            return meta
        slots, host = self.state_slots.assign(chunks)
        loads, saves = self.state_slots.checkpoint_copies(chunks) if self.state_slots.checkpoints else ((), ())
        return dataclasses.replace(meta, state_slots=slots, state_slots_host=host, state_loads=loads,
                                   state_saves=saves)

    def _forget(self, sample_id: str) -> None:
        if self.state_slots is not None:
            self.state_slots.release(sample_id)
        state = self._requests.pop(sample_id, None)
        if state is not None and state.lora is not None and self.lora is not None:
            self.lora.release(state.lora)

    # -- images --------------------------------------------------------------------------

    def _image_embeds(
        self, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState]
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
        for key in [k for k, image in missing.items() if image.embeds]:
            # prompt_embeds: the "encoder output" is given.
            image = missing.pop(key)
            self._encoder_cache[key] = torch.frombuffer(
                bytearray(image.pixels), dtype=torch.float32).view(image.shape).to(self.device)
        if missing:
            encoded: Sequence[torch.Tensor]
            if hasattr(self.model, "encode_image_inputs"):  # Qwen-VL, Qwen2-Audio: inputs
                # of their own sizes, one list
                encoded = self.model.encode_image_inputs(list(missing.values()))
            else:
                pixels = torch.stack([unpack(image.pixels, image.shape) for image in missing.values()])
                encoded = self.model.encode_images(pixels)  # type: ignore[attr-defined]
            self.encoder_runs += len(missing)
            for key, out in zip(missing, encoded, strict=True):
                self._encoder_cache[key] = out
        rows = torch.cat([torch.arange(r, r + hi - lo) for r, _, lo, hi in spans]).to(self.device)
        values = torch.cat([self._encoder_cache[image.key][lo:hi] for _, image, lo, hi in spans])
        return rows, values

    def _cross_spans(self, chunks: Sequence[ScheduledChunk],
                     states: Sequence[RequestState]) -> list[tuple[int, int, torch.Tensor]]:
        """Each chunk's rows and its request's clip's cross-attention keys and values
        (Whisper), encoding the clips not in the encoder cache (kept while their requests
        live)."""
        missing = {s.images[0].key: s.images[0] for s in states
                   if s.images[0].key not in self._encoder_cache}
        if missing:
            encoded = self.model.encode_image_inputs(list(missing.values()))
            self.encoder_runs += len(missing)
            self._encoder_cache.update(zip(missing, encoded, strict=True))
        spans, row = [], 0
        for c, s in zip(chunks, states, strict=True):
            spans.append((row, row + c.num_tokens, self._encoder_cache[s.images[0].key]))
            row += c.num_tokens
        return spans

    def _evict_encoder_outputs(self) -> None:
        """Drop the encoder outputs no live request still has placeholders of to prefill
        (or, for Whisper's cross-attention, no live request reads)."""
        cross = getattr(self.model, "cross_attention", False)
        needed = {
            image.key
            for s in self._requests.values()
            for image in s.images
            if cross or s.prefilled < image.offset + image.length
        }
        for key in [k for k in self._encoder_cache if k not in needed]:
            del self._encoder_cache[key]

    def _state(self, chunk: ScheduledChunk) -> RequestState:
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

    # -- pooling ---------------------------------------------------------------------------

    def _run_pooling(self, chunks: tuple[ScheduledChunk, ...]) -> tuple[PooledOutput, ...]:
        """Forward the chunks; each one's rows add to its request's pool, and each chunk
        that ends its prompt (``sample``) gives the request's output."""
        assert self.pooler is not None
        states = [self._state(c) for c in chunks]
        input_ids, positions, meta, _ = self._batch.prepare(chunks, states)
        meta = self._with_state_slots(meta, chunks)
        with self._lora_step(chunks, states):  # a decoder embedder's adapters
            hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        return pool_outputs(self.pooler, self.model, self.dtype, hidden, chunks, states, self._dense)
