"""The embedded trio API: open an engine in your own program and stream tokens from it.

::

    import engine

    async with engine.open_engine(dtype="float32") as eng:
        async for out in eng.generate("The capital of France is", engine.SamplingParams(max_tokens=8)):
            print(out.text, end="")

The contract is written down in ``docs/architecture.md`` ("Actors and the embedded API").

Why this module is one room: :class:`Engine` is the embedded API's one object, and its
request paths (prepare and enqueue, the pooling calls), its statistics and its restart
loop share its private state (the actors' handles, the parts, the request serials, the
compile pool, the counters carried over restarts); split over modules, each part would
reach into the others' attributes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from engine import multimodal
from engine.actors.model_thread import run_in_model_thread, then_release_team
from engine.actors.parts import EngineParts
from engine.actors.router import OutputMailbox
from engine.actors.system import (
    ActorHandles,
    EngineStatistics,
    carry_counters,
    combined_statistics,
    run_actors,
)
from engine.api import prompt_embeds as embeds_input
from engine.api.lora import LoraRegistry
from engine.api.outputs import BeamSearchOutput, GenerationAccumulator, beam_search_output
from engine.api.sleep_mode import SleepMode
from engine.api.streams import RequestStream, _Generation
from engine.api.tracing import Tracer
from engine.chat import session as chat_session
from engine.chat.request import TemplateOptions
from engine.chat.session import ChatChunk, ChatResult
from engine.chat.template import ChatTokenizer, resolve_content_format
from engine.config import EngineConfig
from engine.core import admission, pooling
from engine.core.pooling import Pooled
from engine.errors import (
    ConfigError,
    EngineDeadError,
    InvalidParamError,
    PromptTooLongError,
    RequestFailedError,
)
from engine.messages import AdmittedRequest, ControlProfiler, ResetPrefixCache
from engine.models.chat_sandbox import RenderBudget
from engine.params import (
    ENGINE_EXTRA_ARGS,
    BeamSearchParams,
    SamplingParams,
    generation_defaults,
    generation_max_tokens,
)
from engine.process.workers import WorkerLostError
from engine.runner.logits_processors import load_logits_processors
from engine.structured import GrammarHold, StructuredStatistics
from engine.structured.pool import CompilePool

logger = logging.getLogger("engine")

# Where a pooling model's requests go, by its task (a generation route's 400 names them).
_POOLING_ROUTES = {"embed": "/v1/embeddings (or /pooling)",
                   "classify": "/classify, /v1/score or /v1/rerank"}

# Worker threads for prompt work (chat templates, long tokenizations) at once, apart from
# trio's default pool (grammar compiles and the rest): a few slow prompts (each bounded by
# --chat-template-timeout and the context's length) queue behind each other instead of
# taking every thread. A chat render is Python, so more threads would not render faster.
PROMPT_THREADS = 4
# How long reset_prefix_cache waits for every engine core's answer (a core lost meanwhile
# never answers): one step and a frame each way, with room for a slow step.
RESET_ANSWER_SECONDS = 30.0
# How long start_profile / stop_profile wait: a stop writes the trace first (vLLM's guide
# warns of minutes for large traces).
PROFILE_ANSWER_SECONDS = 600.0


async def tokenize_prompt(
    tokenizer: Any, prompt: admission.Prompt, *, limiter: trio.CapacityLimiter,
    template_seconds: float, max_model_len: int | None, content_format: str,
    image_text: str | None = None, **options: Any,
) -> tuple[int, ...]:
    """:func:`admission.prompt_token_ids` (with ``options``: ``add_special_tokens``, ...)
    off the event loop when it is more than a short text: in a worker thread under
    ``limiter``, the chat template bounded by ``template_seconds`` (and sizes:
    :mod:`engine.models.chat_sandbox`). A cancelled caller stops waiting at once; its
    render stops at its next step. ``tokenizer`` is the model's; chat messages render
    with its chat template (:class:`engine.chat.template.ChatTokenizer`), their content
    as ``content_format`` says (``--chat-template-content-format``; ``image_text``: the
    model's image placeholder, for messages whose images the engine took out)."""
    options["max_model_len"] = max_model_len
    chat_tokenizer = ChatTokenizer(tokenizer, content_format=content_format,
                                   image_text=image_text)
    if not admission.needs_thread(prompt):
        return admission.prompt_token_ids(chat_tokenizer, prompt, **options)
    # What a template makes of the messages (and tools) may be a few times their size.
    size = admission.prompt_chars(prompt) + len(getattr(prompt, "options_json", ""))
    budget = RenderBudget(template_seconds, max_chars=4 * size)

    def work() -> tuple[int, ...]:
        with budget.active():
            return admission.prompt_token_ids(chat_tokenizer, prompt, **options)

    try:
        # Pure and quick to drop: a cancelled caller need not wait for it.
        return await trio.to_thread.run_sync(work, limiter=limiter, abandon_on_cancel=True)
    finally:
        budget.cancel()


class PreparedRequest:
    """A request past every admission check but the queue's (:meth:`Engine.prepare`),
    ready for :meth:`Engine.enqueue`. ``prompt_token_ids`` is the prompt as the model
    reads it (chat template applied, image tokens widened)."""

    __slots__ = ("admitted", "enqueued", "grammar_hold", "prompt_token_ids", "trace_headers")

    def __init__(self, admitted: AdmittedRequest, prompt_token_ids: tuple[int, ...]) -> None:
        self.admitted = admitted
        self.prompt_token_ids = prompt_token_ids
        self.enqueued = False
        self.grammar_hold: GrammarHold | None = None  # until enqueued (or dropped)
        # The caller's W3C trace context, for the request's span (otlp_traces_endpoint).
        self.trace_headers: Mapping[str, str] | None = None

    @property
    def samples(self) -> int:
        """How many samples it runs as (``n``): what it adds to the waiting queue."""
        return len(self.admitted.samples)


def generation_source(setting: str, tokenizer: Any) -> dict[str, Any]:
    """The generation_config.json whose sampling fields are the defaults:
    ``--generation-config`` auto (the model's), none or vllm (none), or a folder holding
    one (vLLM's three forms). :class:`ConfigError` for a folder without one."""
    if setting == "auto":
        return dict(tokenizer.generation_config)
    if setting in ("none", "vllm"):
        return {}
    path = Path(setting).expanduser() / "generation_config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"generation_config: {setting!r} is auto, none, vllm or a folder "
                          f"holding a readable generation_config.json ({exc})",
                          field="generation_config") from None
    if not isinstance(value, dict):
        raise ConfigError(f"generation_config: {path} holds no JSON object",
                          field="generation_config")
    return value


class Engine(SleepMode):
    """A running engine: submit requests, read statistics, abort. Made by :func:`open_engine`.

    Attributes: ``config`` (resolved), ``model_name``, ``tokenizer``, ``max_model_len``,
    ``sampling_defaults`` (the model's generation_config.json sampling fields in force,
    ``{}`` with ``generation_config="none"``, with ``override_generation_config`` set over
    them; a request submitted without params uses them, and the HTTP server fills the
    fields a body leaves out), ``default_max_tokens`` (a chat request's max_tokens when it
    sets none: the override's max_new_tokens, else generation_config.json's; None: up to
    the context), ``max_tokens_cap`` (the override's max_new_tokens: the most an HTTP
    request gets, as vLLM's serving layer caps it), ``dead`` and
    ``dead_reason`` (the exception that killed it, or the closing error), ``restarting``
    (true while its actors restart in place after a crash) and ``restarts`` (how many times
    they have).
    """

    def __init__(self, parts: EngineParts) -> None:
        self.config: EngineConfig = parts.config
        self.model_name: str = parts.model_name
        # otlp_traces_endpoint (vLLM's): a span per finished request (api/tracing.py).
        self.tracer: Tracer | None = (Tracer(parts.config.otlp_traces_endpoint, parts.model_name)
                                      if parts.config.otlp_traces_endpoint else None)
        self.tokenizer = parts.tokenizer
        self.max_model_len: int = parts.limits.max_model_len
        model_defaults = generation_source(parts.config.generation_config, parts.tokenizer)
        override = json.loads(parts.config.override_generation_config or "{}")
        self.max_tokens_cap: int | None = override.pop("max_new_tokens", None)
        self.default_max_tokens: int | None = (
            self.max_tokens_cap if self.max_tokens_cap is not None
            else generation_max_tokens(model_defaults))
        self.sampling_defaults: dict[str, Any] = {**generation_defaults(model_defaults),
                                                  **override}
        self.pooler = parts.pooler
        self.dead = False
        self.dead_reason: BaseException | None = None
        # Self-healing: a crash restarts the actors in place (weights kept, a fresh KV pool
        # and scheduler) up to config.max_engine_restarts times; while that runs, submits
        # fail with EngineDeadError and /health answers 503.
        self.restarting = False
        self.restarts = 0
        self._dead_event = trio.Event()
        self._parts = parts
        # LoRA adapters by name (--lora-modules, and those loaded at runtime): open_engine
        # reads the startup ones before the engine serves.
        self.loras = LoraRegistry(parts.config, parts.model_config, parts.model_name)
        self._handles: ActorHandles | None = None
        # What the actors before the last in-place restart had counted (a fresh scheduler
        # and KV pool count from zero): added to every snapshot, so counters never go back.
        self._carried: EngineStatistics | None = None
        self._pool: Any = None  # engine.process.cores.CorePool when the cores run apart
        self._token = trio.lowlevel.current_trio_token()
        config = parts.config
        self._compiles = (CompilePool(
            parts.grammar, workers=config.grammar_compile_workers,
            timeout=config.grammar_compile_timeout, max_bytes=config.grammar_max_bytes)
            if parts.grammar is not None else None)
        if self._compiles is not None and parts.runner is not None:
            # A grammar the runner finds missing compiles through the pool (its budgets and
            # limiter), never on the model thread by itself.
            parts.grammar.recompile = lambda spec: trio.from_thread.run(
                self._compiles.recompile, spec, trio_token=self._token)  # the step waits
        # Numbers every admitted request (across restarts too): its sample ids carry it, so
        # they never collide whatever request ids callers pick (admission.sample_ids).
        self._serials = itertools.count()
        self._prompt_limiter = trio.CapacityLimiter(PROMPT_THREADS)
        if parts.tokenizer.chat_template is not None:
            option = config.chat_template_content_format
            logger.info("chat message content reaches the model's chat template as %s%s",
                        "a string" if resolve_content_format(
                            parts.tokenizer.chat_template, option) == "string" else "parts",
                        " (read from the template)" if option == "auto" else "")
        # The server's logits processor classes: their validate_params sees every request.
        self._processors = load_logits_processors(config.logits_processor_names)

    # -- requests ---------------------------------------------------------------------------

    async def submit(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        chat_options: TemplateOptions | None = None,
        lora: str | None = None,
        prompt_embeds: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestStream:
        """Validate, tokenize and queue a request; returns its stream once admitted.

        ``prompt`` is a string (tokenized with special tokens), a list of token ids, or a
        list of chat messages (``{"role", "content"}`` dicts; the chat template applies,
        with ``chat_options``: tools, template, template kwargs, generation prompt or
        prefill). ``lora`` names a served LoRA adapter to run with (None: the base model).
        ``trace_headers`` (``traceparent``, ``tracestate``) make the request's span (with
        ``otlp_traces_endpoint``) a child of the caller's trace.
        Raises :class:`InvalidParamError`, :class:`UnknownLoraAdapterError`, :class:`PromptTooLongError`,
        :class:`QueueFullError` (the request is not queued) or :class:`EngineDeadError`.
        Admission runs here, in the caller's task; a cancellation before it returns leaves
        nothing behind (nothing is sent before the last await). It is :meth:`prepare`
        then :meth:`enqueue`.
        """
        prepared = await self.prepare(prompt, params, request_id=request_id, priority=priority,
                                      cache_salt=cache_salt, chat_options=chat_options, lora=lora,
                                      prompt_embeds=prompt_embeds,
                                      mm_processor_kwargs=mm_processor_kwargs)
        prepared.trace_headers = trace_headers
        return self.enqueue(prepared)

    def default_sampling_params(self) -> SamplingParams:
        """What a request submitted without params runs with: ``sampling_defaults`` and
        ``default_max_tokens`` (the engine's own max_tokens without one)."""
        extra = {"max_tokens": self.default_max_tokens} if self.default_max_tokens else {}
        return SamplingParams(**self.sampling_defaults, **extra)

    async def prepare(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        chat_options: TemplateOptions | None = None,
        images: Sequence[Any] = (),
        lora: str | None = None,
        prompt_embeds: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> PreparedRequest:
        """Everything :meth:`submit` does short of queueing: check, tokenize (chat template,
        images), compile a structured output's grammar, and pass every admission check but
        the queue's. Nothing is sent; a prepared request that is never enqueued leaves
        nothing behind. A batch (:class:`engine.LLM`) prepares all its prompts first, so a
        bad one is refused before any runs.

        ``images`` go with a text or token-id ``prompt`` that holds the model's image token
        once per image, in order (vLLM's ``multi_modal_data``): bytes or PIL images. Chat
        messages carry theirs in their content parts instead.

        ``prompt_embeds`` (with ``prompt`` None, and ``enable_prompt_embeds``): the prompt
        as its input embeddings, a ``[tokens, hidden]`` torch tensor (vLLM's; see
        :mod:`engine.api.prompt_embeds`). ``mm_processor_kwargs``: this request's image
        processor options over the server's (Qwen-VL's ``min_pixels`` / ``max_pixels``).
        """
        await trio.lowlevel.checkpoint()
        self._alive()
        if self.pooler is not None:
            raise InvalidParamError(
                f"the model {self.model_name} is a pooling model ({self.pooler.task}): it does "
                f"not generate text; use "
                f"{_POOLING_ROUTES.get(self.pooler.task, '/pooling')}",
                param="model")
        if params is None:
            params = self.default_sampling_params()
        else:
            # The caller's object may change after this (vLLM's SamplingParams is mutable,
            # and so is this one): the request keeps the values it was submitted with.
            params = params.clone() if isinstance(params, SamplingParams) else params
        embeds = None
        if prompt_embeds is not None:
            prompt, embeds = self._embeds_prompt(prompt, prompt_embeds, params, images)
        raw_images: list[Any] = []
        if multimodal.has_images(prompt):
            if images:
                raise InvalidParamError("chat messages carry their images in their content "
                                        "parts, not beside them", param="multi_modal_data")
            prompt, raw_images = self._split_images(prompt)
        elif images:
            prep = self._parts.images
            raw_images = multimodal.prompt_images(
                images, prep.kinds if prep is not None else (), prep.limits if prep is not None
                else multimodal.MediaLimits(), model=self.model_name, where="multi_modal_data")
        if getattr(self._parts.images, "cross_attention", False) and len(raw_images) != 1:
            raise InvalidParamError(f"the model {self.model_name} (Whisper) transcribes one audio "
                                    "clip a request: use /v1/audio/transcriptions", param="model")
        submit = admission.submit_request(
            prompt, params, request_id=request_id if request_id is not None else uuid.uuid4().hex,
            priority=priority, cache_salt=cache_salt, arrival_time=time.monotonic(),
            chat_options=chat_options.to_json() if chat_options is not None else None,
            lora=self.loras.resolve(lora),
        )
        whisper = getattr(self._parts.images, "cross_attention", False)
        params = admission.request_params(
            submit.params, processors=self._processors, images=bool(raw_images),
            encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            engine_keys=ENGINE_EXTRA_ARGS if whisper else frozenset())
        submit = dataclasses.replace(submit, params=params)
        ids, images_in = await self._prompt_ids(submit.prompt, raw_images,
                                                truncate=params.truncate_prompt_tokens,
                                                side=params.truncation_side,
                                                mm_options=mm_processor_kwargs)
        if embeds is not None:
            images_in = (embeds,)
        grammar = self._parts.grammar
        spec = params.structured_outputs
        # In-process the runner reads the grammar from this backend's cache: the request
        # holds it there from before its compile until it is enqueued (or dropped), then
        # each sample until the scheduler sees it end (engine.structured.backend), so no
        # other compile evicts it before its matchers are made.
        in_process = grammar is not None and self._pool is None
        hold = grammar.held(spec) if spec is not None and in_process else None
        try:
            prepared = await self._prepared(submit, params, ids, images_in)
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        prepared.grammar_hold = hold
        return prepared

    async def _prepared(self, submit: Any, params: SamplingParams, ids: tuple[int, ...],
                        images_in: tuple[Any, ...]) -> PreparedRequest:
        """The rest of :meth:`prepare`: compile the grammar, pass the admission checks."""
        if params.structured_outputs is not None and self._compiles is not None:
            admission.check_min_tokens(params)
            # In a worker process, under a time budget; leaving (a cancel) kills it.
            await self._compiles.compile(params.structured_outputs)
        else:
            admission.compile_structured(self._parts.grammar, params)  # none, or refused
        prediction: tuple[int, ...] = ()
        if params.prediction:
            text = params.prediction
            prediction = await self._tokenize(len(text), lambda: tuple(
                self.tokenizer.encode(text, add_special_tokens=False)))
        if params.beam_width:
            self._check_beam_group(params.beam_width, len(ids))
        # The queue is checked when the request is enqueued: here, every other check.
        admitted = admission.admit(submit, ids, self._parts.limits, waiting=0,
                                   serial=next(self._serials), images=images_in,
                                   prediction=prediction)
        if any(image.embeds for image in images_in):
            # No text for the detokenizer to continue from (placeholders).
            admitted = dataclasses.replace(admitted, outputs=tuple(
                dataclasses.replace(o, prompt_is_text=False) for o in admitted.outputs))
        return PreparedRequest(admitted, ids)

    def _embeds_prompt(self, prompt: Any, tensor: Any, params: SamplingParams,
                       images: Sequence[Any]) -> tuple[list[int], Any]:
        """``prepare``'s prompt for ``prompt_embeds``: the placeholder ids and the
        embeddings' input, after the checks of :mod:`engine.api.prompt_embeds`."""
        param = embeds_input.PARAM
        if not self.config.enable_prompt_embeds:
            raise InvalidParamError("prompt_embeds needs a server started with "
                                    "--enable-prompt-embeds", param=param)
        if prompt is not None or images:
            raise InvalidParamError("give prompt or prompt_embeds, not both", param=param)
        embeds_input.check_model(self._parts.model_config, self.pooler is not None,
                                  self.config.pipeline_parallel_size)
        for name, refused in (("prompt_logprobs", params.prompt_logprobs is not None),
                              ("repetition_penalty", params.repetition_penalty != 1.0),
                              ("use_beam_search", params.beam_width > 0)):
            if refused:
                raise InvalidParamError(f"{name} cannot be combined with prompt_embeds (the "
                                        "prompt has no token ids)", param=name)
        truncate = params.truncate_prompt_tokens
        if truncate is not None and params.truncation_side != "left":
            raise InvalidParamError("prompt_embeds keep their last rows: truncation_side "
                                    "must be left", param="truncation_side")
        ids, embeds = embeds_input.embeds_input(
            tensor, hidden_size=self._parts.model_config.hidden_size,
            truncate=None if truncate is None else admission.truncation_limit(
                truncate, self.max_model_len))
        if len(embeds.pixels) * params.n > admission.MAX_IMAGE_BYTES:
            raise InvalidParamError(
                f"prompt_embeds is {len(embeds.pixels)} bytes as float32 for each of {params.n} "
                f"sample(s); at most {admission.MAX_IMAGE_BYTES} are taken", param=param)
        return list(ids), embeds

    def _check_beam_group(self, width: int, prompt_len: int) -> None:
        """The scheduler's own bounds on a beam search, checked here so that they are the
        caller's 400s (the scheduler would only end the request): every beam is a batch
        row, and the group's beams must fit one core's KV pool unshared (with a block
        each for the forks' copies) for at least one token."""
        if width > self.config.max_num_seqs:
            raise InvalidParamError(f"the beam width ({width}) exceeds max_num_seqs "
                                    f"({self.config.max_num_seqs}): every beam is a row of the "
                                    "batch", param="n")
        room = (self._parts.num_blocks - width) // width * self.config.block_size
        if prompt_len >= room:
            raise PromptTooLongError(prompt_tokens=prompt_len, max_tokens=1,
                                     max_model_len=max(room, 0))

    def enqueue(self, prepared: PreparedRequest) -> RequestStream:
        """Queue a prepared request and return its stream (no await: nothing can cancel
        between the mailbox opening and the samples going to the scheduler). Raises
        :class:`QueueFullError` (not queued; it may be enqueued later) or
        :class:`EngineDeadError`. A prepared request is enqueued once."""
        if prepared.enqueued:
            raise RuntimeError("this prepared request was enqueued already")
        handles = self._alive()
        admission.check_queue(handles.queue_depth(), self._parts.limits)
        prepared.enqueued = True
        mailbox = handles.router.open(prepared.admitted)
        try:
            handles.send(prepared.admitted)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            handles.router.close(mailbox)
            raise self._dead_error() from self.dead_reason
        if prepared.grammar_hold is not None:
            prepared.grammar_hold.pass_to(len(prepared.admitted.samples))
        if self.config.enable_log_requests:
            self._log_request(prepared)
        trace = None if self.tracer is None else self.tracer.request(
            mailbox.request_id, len(prepared.prompt_token_ids), len(mailbox.sample_ids),
            prepared.admitted.samples[0].params, prepared.trace_headers)
        return RequestStream(self, mailbox, trace)

    def _log_request(self, prepared: PreparedRequest) -> None:
        """vLLM's request log line (``enable_log_requests``): the prompt as the model reads
        it (decoded from its ids, special tokens shown), cut to ``max_log_len``."""
        limit = self.config.max_log_len
        ids = list(prepared.prompt_token_ids[:limit] if limit is not None else prepared.prompt_token_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        sample = prepared.admitted.samples[0]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
                    "lora: %s", prepared.admitted.request_id,
                    text if limit is None else text[:limit], sample.params, ids,
                    sample.lora.name if sample.lora is not None else None)

    async def tokenize_chat(self, messages: Sequence[dict[str, Any]],
                            chat_options: TemplateOptions | None = None,
                            mm_processor_kwargs: dict[str, Any] | None = None) -> tuple[int, ...]:
        """The prompt token ids ``submit`` would run chat ``messages`` as, each image part
        widened to its placeholder tokens (``/tokenize``, ``count_tokens``; with the
        request's ``mm_processor_kwargs``). Refuses what ``submit`` refuses of the images
        (:class:`InvalidParamError` naming the part)."""
        raw_images: list[Any] = []
        if multimodal.has_images(messages):
            messages, raw_images = self._split_images(messages)
        prompt = admission.prompt_message(
            messages, chat_options.to_json() if chat_options is not None else None)
        return (await self._prompt_ids(prompt, raw_images, mm_options=mm_processor_kwargs))[0]

    async def _prompt_ids(self, prompt: admission.Prompt, raw_images: Sequence[Any],
                          truncate: int | None = None, side: str = "left",
                          mm_options: dict[str, Any] | None = None,
                          ) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        ids = await tokenize_prompt(
            self.tokenizer, prompt, limiter=self._prompt_limiter,
            template_seconds=self.config.chat_template_timeout,
            max_model_len=self.max_model_len,
            content_format=self.config.chat_template_content_format,
            truncate=None if truncate is None else admission.truncation_limit(
                truncate, self.max_model_len), truncation_side=side,
            special_tokens_in_content=self.config.allow_special_tokens_in_content,
            # The image parts split_images left: a string template gets the model's
            # placeholder text for each.
            image_text=self._parts.images.image_text if raw_images else None)
        images: tuple[Any, ...] = ()
        if raw_images:
            # Decoding and the image processor take milliseconds per image: off the trio
            # thread, abandoned (pure) on cancel.
            # (Whisper's log-mel features are torch's STFT: its team is handed back.)
            ids, images = await trio.to_thread.run_sync(
                then_release_team, self._parts.images.expand, ids, list(raw_images), mm_options,
                abandon_on_cancel=True)
        return ids, images

    def _split_images(self, prompt: Any) -> tuple[list[Any], list[Any]]:
        """The chat messages with each image part left as ``{"type": "image"}`` (the chat
        template writes its placeholder), and the images; a text-only model refuses them
        (a 400 naming the part)."""
        prep = self._parts.images
        limits = prep.limits if prep is not None else multimodal.MediaLimits()
        return multimodal.split_images(prompt, prep.kinds if prep is not None else (), limits,
                                       model=self.model_name)

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> _Generation:
        """``submit`` then iterate, as one async iterator (submits on first iteration).

        Leaving the loop early aborts the request; use ``async with eng.generate(...) as
        gen:`` to make the abort happen exactly when the block is left.
        """
        return _Generation(self, (prompt, params), kwargs)

    async def beam_search(self, prompt: str | Sequence[int], params: BeamSearchParams,
                          **kwargs: Any) -> BeamSearchOutput:
        """A beam search of ``params.beam_width`` beams (see :class:`BeamSearchParams`):
        every beam, best score first, once the search ends. ``kwargs`` as :meth:`submit`'s."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidParamError("params must be an engine.BeamSearchParams", param="params")
        stream = await self.submit(prompt, params.sampling_params(), **kwargs)
        acc = GenerationAccumulator(stream.request_id, None, stream.prompt_token_ids,
                                    logprobs=False, decode=str)
        async with stream:
            async for out in stream:
                acc.add(out)
        return beam_search_output(acc.result())

    async def chat(self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None,
                   **options: Any) -> ChatResult:
        """One chat turn with tools and reasoning parsed into typed values; see
        :func:`engine.chat.session.chat` for ``options`` (tools, tool_choice, ...)."""
        return await chat_session.chat(self, messages, params, **options)

    def chat_stream(self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None,
                    **options: Any) -> AsyncIterator[ChatChunk]:
        """:meth:`chat` streamed as :class:`engine.chat.session.ChatChunk` values."""
        return chat_session.chat_stream(self, messages, params, **options)

    # -- pooling ---------------------------------------------------------------------------

    async def embed(
        self, input: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]], *,
        dimensions: int | None = None, normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None, add_special_tokens: bool = True,
        request_id: str | None = None, priority: int = 0, lora: str | None = None,
    ) -> list[Pooled]:
        """Embed a string, a list of token ids, or a list of either (one embedding each,
        in order). The inputs run as separate requests batched into the same steps;
        ``lora`` names a served adapter they run with (a decoder embedder's).

        ``dimensions`` keeps the first N values where the model is a Matryoshka model,
        else :class:`InvalidParamError`; ``normalize`` L2-normalises each embedding (None:
        as the model does); ``truncate_prompt_tokens`` as vLLM's (keep the last k tokens;
        -1: the model's limit); ``add_special_tokens`` false tokenizes text without the
        tokenizer's [CLS] and [SEP]. An input longer than the model takes raises
        :class:`InputTooLongError` naming the limit."""
        pooler = self._pooler("embed", "embed")
        pooling.check_dimensions(dimensions, pooler.matryoshka_dimensions, pooler.size)
        _check_flags(normalize=normalize, add_special_tokens=add_special_tokens)
        pooled = await self._pool_inputs(input, truncate_prompt_tokens, add_special_tokens,
                                         request_id, priority, lora=lora)
        keep = pooler.normalizes(normalize)
        return [pooling.embedding(p, dimensions, keep) for p in pooled]

    async def embed_tokens(
        self, input: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]], *,
        normalize: bool | None = None, truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True, request_id: str | None = None, priority: int = 0,
        lora: str | None = None,
    ) -> list[Pooled]:
        """vLLM's ``token_embed``: for each input, the last hidden state of every one of
        its tokens (``Pooled.matrix()``: a row a token, the model's width), L2-normalised
        row by row as :meth:`embed` normalises (``normalize``; None: as the model's
        pipeline does). Inputs and the other options as :meth:`embed`'s."""
        pooler = self._pooler("embed tokens", "embed")
        _check_flags(normalize=normalize, add_special_tokens=add_special_tokens)
        pooled = await self._pool_inputs(input, truncate_prompt_tokens, add_special_tokens,
                                         request_id, priority, tokens=True, lora=lora)
        keep = pooler.normalizes(normalize)
        return [pooling.token_embeddings(p, keep) for p in pooled]

    async def classify(
        self, input: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]], *,
        use_activation: bool = True, truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True, request_id: str | None = None, priority: int = 0,
    ) -> list[tuple[list[float], int]]:
        """``(probabilities, input tokens)`` of each input with a classification model,
        in order: the softmax of its logits (the sigmoid of a one-label model's logit), or
        with ``use_activation`` false the logits. Inputs and the other options as
        :meth:`embed`'s; the label names are ``self.pooler.labels``."""
        self._pooler("classify", "classify")
        _check_flags(use_activation=use_activation, add_special_tokens=add_special_tokens)
        pooled = await self._pool_inputs(input, truncate_prompt_tokens, add_special_tokens,
                                         request_id, priority)
        return [(pooling.class_probs(p, use_activation), p.prompt_tokens) for p in pooled]

    async def classify_tokens(
        self, input: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]], *,
        use_activation: bool = True, truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True, request_id: str | None = None, priority: int = 0,
    ) -> list[Pooled]:
        """vLLM's ``token_classify`` with a token classifier (``BertForTokenClassification``):
        for each input, every token's class probabilities (``Pooled.matrix()``: a row a
        token, one column a label of ``self.pooler.labels``), or with ``use_activation``
        false its logits. Inputs and the other options as :meth:`embed`'s."""
        self._pooler("classify tokens", "token_classify")
        _check_flags(use_activation=use_activation, add_special_tokens=add_special_tokens)
        pooled = await self._pool_inputs(input, truncate_prompt_tokens, add_special_tokens,
                                         request_id, priority, tokens=True)
        return [pooling.token_class_probs(p, use_activation) for p in pooled]

    async def _pool_inputs(self, input: Any, truncate: int | None, add_special_tokens: bool,
                           request_id: str | None, priority: int, *,
                           tokens: bool = False, lora: str | None = None) -> list[Pooled]:
        items = _inputs(input)
        ids = await self._tokenize(
            sum(len(i) for i in items if isinstance(i, str)),
            lambda: pooling.input_ids_many(self.tokenizer, items, truncate=truncate,
                                           max_model_len=self.max_model_len,
                                           add_special_tokens=add_special_tokens))
        return await self.pool(ids, request_id=request_id, priority=priority, tokens=tokens,
                               lora=lora)

    async def score(
        self, first: str | Sequence[str], second: str | Sequence[str], *,
        truncate_prompt_tokens: int | None = None, request_id: str | None = None,
        priority: int = 0, lora: str | None = None,
    ) -> list[tuple[float, int]]:
        """``(score, input tokens)`` of each pair: ``first`` against every ``second`` when
        ``first`` is one text, else pairwise (equal lengths). An embedding model scores
        by cosine similarity (of the embeddings ``lora``'s adapter gives, for a decoder
        embedder); a cross-encoder reads each pair together and scores it by the sigmoid
        of its logit, as sentence-transformers' CrossEncoder."""
        pooler = self._pooler("score", ("embed", "classify"))
        firsts = [first] if isinstance(first, str) else list(first)
        seconds = [second] if isinstance(second, str) else list(second)
        if not seconds or not firsts or not all(isinstance(t, str) for t in firsts + seconds):
            raise InvalidParamError("score needs non-empty texts", param="text_1")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(firsts) != len(seconds):
            raise InvalidParamError(
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 or "
                "as many as text_2", param="text_2")
        if pooler.task == "classify":
            if pooler.size != 1:
                raise InvalidParamError(
                    f"score needs a cross-encoder with one output label; this model has "
                    f"{pooler.size}", param="model")
            ids = await self._tokenize(
                sum(len(a) + len(b) for a, b in zip(firsts, seconds, strict=True)),
                lambda: [pooling.pair_ids(self.tokenizer, a, b, truncate=truncate_prompt_tokens,
                                          max_model_len=self.max_model_len)
                         for a, b in zip(firsts, seconds, strict=True)])
            pooled = await self.pool(ids, request_id=request_id, priority=priority)
            return [(pooling.classifier_score(p), p.prompt_tokens) for p in pooled]
        texts = list(dict.fromkeys(firsts + seconds))
        ids = await self._tokenize(
            sum(map(len, texts)),
            lambda: pooling.input_ids_many(self.tokenizer, texts, truncate=truncate_prompt_tokens,
                                           max_model_len=self.max_model_len))
        by_text = dict(zip(texts, await self.pool(ids, request_id=request_id, priority=priority,
                                                  lora=lora), strict=True))
        return [(pooling.cosine(by_text[a], by_text[b]),
                 by_text[a].prompt_tokens + by_text[b].prompt_tokens)
                for a, b in zip(firsts, seconds, strict=True)]

    async def pool(
        self, prompts: Sequence[tuple[int, ...]], *, request_id: str | None = None,
        priority: int = 0, tokens: bool = False, lora: str | None = None,
    ) -> list[Pooled]:
        """Run token-id prompts through a pooling model; their pooled outputs in order
        (with ``tokens``, every prompt token's hidden state: ``Pooled.matrix()``), with the
        served LoRA adapter ``lora`` names (None: the base model).
        All are admitted before any is awaited, so they share steps; leaving early (a
        cancellation, one failing) aborts the rest and frees their blocks."""
        await trio.lowlevel.checkpoint()
        if self.pooler is None:
            raise InvalidParamError(f"the model {self.model_name} generates; it has no pooler",
                                    param="model")
        limit = self._parts.limits.max_queued_requests
        if len(prompts) > limit:
            # Each input is a request in the queue: more than it ever holds could not run.
            raise InvalidParamError(f"{len(prompts)} inputs in one request; at most {limit} "
                                    "(--max-queued-requests)", param="input")
        adapter = self.loras.resolve(lora)
        base = request_id if request_id is not None else uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                handles = self._alive()
                if tokens or self.pooler.pooling == "all":  # a row a token comes back
                    pooling.check_token_output(len(ids), self.pooler.size)
                admitted = pooling.admit(
                    base if len(prompts) == 1 else f"{base}-{i}", tuple(ids), self._parts.limits,
                    waiting=handles.queue_depth(), priority=priority, arrival_time=time.monotonic(),
                    tokens=tokens, lora=adapter)
                mailbox = handles.router.open(admitted)
                try:
                    handles.send(admitted)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    handles.router.close(mailbox)
                    raise self._dead_error() from self.dead_reason
                trace = None if self.tracer is None else self.tracer.request(
                    mailbox.request_id, len(ids), len(mailbox.sample_ids), None, None)
                streams.append(RequestStream(self, mailbox, trace))
            results = []
            for stream in streams:
                data = None
                async for out in stream:
                    data = out.pooled
                if data is None:
                    raise RequestFailedError("the request ended without a pooled output")
                results.append(Pooled(data, len(stream.prompt_token_ids)))
            return results
        finally:
            for stream in streams:
                stream._release()

    @staticmethod
    async def _tokenize(chars: int, work: Any) -> Any:
        """``work()`` (tokenizing ``chars`` characters): on this thread when short, in a
        worker thread when long, as admission does for prompts."""
        if chars > admission.THREAD_PROMPT_CHARS:
            return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        return work()

    def _pooler(self, what: str, task: str | tuple[str, ...] | None) -> Any:
        """The pooler, if this model can ``what`` (``task``: the task it needs, or one of
        them; None: any)."""
        self._alive()
        tasks = (task,) if isinstance(task, str) else task
        if self.pooler is None or (tasks is not None and self.pooler.task not in tasks):
            kind = "a generation model" if self.pooler is None else f"a {self.pooler.task} model"
            hint = ("; serve it with --convert embed to use it as an embedder"
                    if self.pooler is None and what.startswith("embed") else "")
            raise InvalidParamError(f"the model {self.model_name} is {kind}: it does not "
                                    f"{what}{hint}", param="model")
        return self.pooler

    def abort(self, request_id: str) -> None:
        """Abort from outside their streams every open request submitted under
        ``request_id`` (idempotent; ids are the callers' labels, several requests may share
        one). Each stream gets a last output with ``finish_reason == "abort"`` for each
        unfinished sample."""
        if self._handles is not None:
            for mailbox in self._handles.router.find(request_id):
                self._handles.abort(mailbox.abort())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block, in each engine core (vLLM's
        ``reset_prefix_cache``): later prompts compute their prefixes afresh. Refused, as
        vLLM refuses it, while a request holds KV blocks: then nothing is dropped and the
        answer is False; True once every core has dropped its cache. With
        ``reset_running_requests`` (vLLM's) each core first preempts its running requests:
        their blocks are freed, and they recompute their prompts and outputs when they run
        again, giving the tokens they would have. The hit and query counters keep counting.
        Raises :class:`EngineDeadError` if the engine is not serving."""
        answers, complete = await self._ask_cores(
            lambda token: ResetPrefixCache(token, reset_running=reset_running_requests),
            RESET_ANSWER_SECONDS)
        # A core lost before it answers never will: past the bound, not reset everywhere.
        return complete and all(answer.done for answer in answers)

    async def start_profile(self) -> None:
        """Start tracing the engine's steps (vLLM's ``start_profile``), in every engine
        core, with the engine's ``profiler_config``: torch.profiler on the model thread
        (engine.runner.profiler), or CUDA's capture range. A second start while a trace
        runs changes nothing. Raises :class:`ConfigError` when the engine was opened
        without ``profiler_config``."""
        await self._control_profiler(start=True)

    async def stop_profile(self) -> list[str]:
        """Stop tracing and write the traces (vLLM's ``stop_profile``); the files written,
        one a core (none when nothing was traced)."""
        return await self._control_profiler(start=False)

    async def _control_profiler(self, *, start: bool) -> list[str]:
        if self.config.profiler is None:
            raise ConfigError("profiling is off: open the engine with profiler_config "
                              "(vLLM's --profiler-config)", field="profiler_config")
        answers, complete = await self._ask_cores(lambda token: ControlProfiler(token, start),
                                                  PROFILE_ANSWER_SECONDS)
        errors = [answer.error for answer in answers if answer.error]
        if errors or not complete:
            raise RequestFailedError(errors[0] if errors else "an engine core did not answer "
                                     f"the profiler's {'start' if start else 'stop'}")
        return [path for answer in answers for path in answer.traces]

    async def _ask_cores(self, make: Any, seconds: float) -> tuple[list[Any], bool]:
        """Send ``make(token)`` to every serving engine core and gather their answers
        (:class:`PrefixCacheReset`, :class:`ProfilerControlled`) for up to ``seconds``;
        the answers, and whether every core answered."""
        handles = self._alive()
        expected = self._pool.serving if self._pool is not None else 1
        if expected == 0:
            return [], False
        answers_in, answers = trio.open_memory_channel[Any](math.inf)
        token = uuid.uuid4().hex
        handles.router.listen_answers(token, answers_in)
        try:
            handles.send(make(token))
            got: list[Any] = []
            with trio.move_on_after(seconds):
                for _ in range(expected):
                    got.append(await answers.receive())
            return got, len(got) == expected
        finally:
            handles.router.listen_answers(token, None)

    def structured_statistics(self) -> StructuredStatistics | None:
        """Structured output counters (requests by kind, grammar compiles, cache hits,
        compile times), or None for an engine built without a grammar backend."""
        grammar = self._parts.grammar
        return grammar.statistics() if grammar is not None else None

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the scheduler's and the KV pool's counters. Counters are
        cumulative over the engine's life: an in-place restart, or an engine core's, does
        not set them back."""
        if self._handles is None:
            raise self._dead_error()
        return carry_counters(self._carried, self._handles.statistics())

    def core_statistics(self) -> list[tuple[int, EngineStatistics]]:
        """:meth:`statistics` per engine core, by core index (one core, 0, in-process).
        A core's ``waiting`` counts what it has received; its counters include what it
        counted before a restart, and a core that has run no step since it (re)started
        reports those and an idle pool."""
        if self._pool is None:
            return [(0, self.statistics())]
        idle = self._parts.num_blocks
        return [(index, combined_statistics([s] if s is not None else [],
                                            waiting=s.waiting if s is not None else 0,
                                            idle_blocks=idle))
                for index, s in self._pool.core_statistics()]

    # -- internals --------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """True while the engine takes requests (not dead, not restarting)."""
        return not (self.dead or self.restarting) and self._handles is not None

    def _alive(self) -> ActorHandles:
        if self.restarting:
            raise EngineDeadError("the engine is restarting after a crash; retry shortly")
        if self.dead or self._handles is None:
            raise self._dead_error() from self.dead_reason
        return self._handles

    def _dead_error(self) -> EngineDeadError:
        if isinstance(self.dead_reason, EngineDeadError):
            return EngineDeadError(str(self.dead_reason))
        return EngineDeadError(f"the engine died: {self.dead_reason!r}")

    def _drop(self, mailbox: OutputMailbox) -> None:
        """The caller no longer reads this request: forget its outputs, abort it."""
        if self._handles is not None:
            self._handles.abort(self._handles.router.close(mailbox))

    def _drop_soon(self, mailbox: OutputMailbox) -> None:
        try:
            self._token.run_sync_soon(self._drop, mailbox)
        except trio.RunFinishedError:
            pass  # the trio run is over; so is the engine

    async def wait_dead(self) -> None:
        """Wait until the engine is dead for good: a crash past its restart limit, or the
        ``open_engine`` block being left. (A server exits then, for a supervisor to act.)"""
        await self._dead_event.wait()

    def _die(self, reason: BaseException) -> None:
        if self.dead:
            return
        if self._pool is not None:
            self._pool.stopping()
        self.dead = True
        self.restarting = False
        self.dead_reason = reason
        self._dead_event.set()
        if self._handles is not None:
            error = self._dead_error()
            error.__cause__ = reason
            self._handles.router.fail_all(error)

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the actors until cancelled. A crash never propagates: the requests in
        flight fail with :class:`EngineDeadError` (chained from the crash), and the actors
        restart in place, up to ``config.max_engine_restarts`` times; past that the engine
        stays dead, so the caller's ``async with`` block goes on (an HTTP server keeps
        answering /health with 503 and its CLI exits non-zero)."""
        started = False

        def ready(handles: ActorHandles) -> None:
            nonlocal started
            if self._handles is not None:
                # The crashed actors' counters are final now (they stopped); the new ones
                # start from zero.
                self._carried = carry_counters(self._carried, self._handles.statistics())
            self._handles = handles
            self.restarting = False
            if not started:
                started = True
                task_status.started()

        while True:
            crash: BaseException | None = None
            try:
                # A pause the engine is in survives the restart (its sleeping model does anyway).
                await run_actors(self._parts, ready=ready, paused=self._pause_state[:2])
            except* Exception as group:
                if not started:
                    raise
                crash = _single(group)
            if crash is None:
                self._die(EngineDeadError("the engine's actors stopped"))
                return
            limit = self.config.max_engine_restarts
            if self.restarts >= limit:
                logger.error("engine actor crashed; restart limit (%d) reached, the engine "
                             "stays dead: %r", limit, crash, exc_info=crash)
                self._die(crash)
                return
            self.restarts += 1
            logger.error("engine actor crashed; restarting its actors (restart %d of %d): %r",
                         self.restarts, limit, crash, exc_info=crash)
            self.restarting = True
            self._fail_in_flight(crash)
            # The executor never abandons a step, so the runner is idle here; it forgets
            # every request, and the new actors bring a fresh KV pool and scheduler. (In a
            # model thread: a tensor-parallel runner restarts its workers, in seconds.)
            try:
                await run_in_model_thread(self._parts.runner.reset)
            except Exception as exc:  # the tensor-parallel workers could not restart
                logger.error("the engine could not restart: %r", exc, exc_info=exc)
                self._die(exc)
                return

    def _fail_in_flight(self, crash: BaseException) -> None:
        if self._handles is not None:
            if isinstance(crash, WorkerLostError):
                error = EngineDeadError(f"{crash}; the engine is restarting")
            else:
                error = EngineDeadError("the engine crashed while serving this request; it is restarting")
            error.__cause__ = crash
            self._handles.router.fail_all(error)


# An actor that crashes closes its channel ends on the way out, so a neighbour blocked on
# one of them fails too; those failures are consequences, not the cause.
_CONSEQUENCES = (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel)


def _check_flags(**flags: Any) -> None:
    """A pooling call's switches are bools (``normalize`` may also be None: the model's
    choice); anything else is an :class:`InvalidParamError` naming it, never a truth value."""
    for name, value in flags.items():
        if not (isinstance(value, bool) or value is None and name == "normalize"):
            raise InvalidParamError(f"{name} must be true or false, got {value!r}", param=name)


def _inputs(input: Any) -> list[str | Sequence[int]]:
    """OpenAI's ``input``: a string, token ids, or a non-empty list of either."""
    if isinstance(input, str):
        return [input]
    if isinstance(input, (list, tuple)) and input:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in input):
            return [tuple(input)]
        if all(isinstance(t, str) for t in input):
            return list(input)
        if all(isinstance(x, (list, tuple)) and x and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x) for x in input):
            return [tuple(x) for x in input]
    raise InvalidParamError("input must be a string, a list of token ids, or a non-empty list "
                            "of strings or of token-id lists", param="input")


def _single(group: BaseExceptionGroup[Exception]) -> BaseException:
    """The crash inside nested groups, or the group when several actors failed on their own."""
    leaves = list(_leaves(group))
    causes = [e for e in leaves if not isinstance(e, _CONSEQUENCES)] or leaves
    return causes[0] if len(causes) == 1 else group


def _leaves(exc: BaseException) -> Any:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
