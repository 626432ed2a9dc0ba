"""Offline batches on the engine's trio thread: what :class:`engine.LLM` runs.

A batch is checked whole before any of it runs: each prompt in vLLM's forms (text, token
ids, ``{"prompt": ..., "multi_modal_data": {"image": ...}}``, ``{"prompt_token_ids":
...}``, a chat conversation) is read by :func:`generation_prompts` / :func:`chat_prompts`
and then prepared by :meth:`Engine.prepare` (tokenized, templated, every admission check
but the queue's); the first refusal raises :class:`BatchPromptError` naming its index.
Then every prompt is enqueued in order, as fast as the :class:`Window` lets it: at most
``max_queued_requests`` samples of the batch are in the engine at once, so the waiting
queue (whose limit answers 429 to a server's clients) never refuses one, and the
scheduler still sees far more than one step takes. Outputs are collected per request and
returned in the order given. Cancelling the batch (Ctrl-C, :meth:`engine.LLM.close`)
aborts every request still running; each frees its KV blocks before the next step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from engine import multimodal
from engine.api.engine import Engine, PreparedRequest
from engine.api.metrics import Metrics, RequestTimer
from engine.api.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    GenerationAccumulator,
    GenerationRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.chat.request import TemplateOptions
from engine.core import pooling
from engine.core.pooling import Pooled
from engine.errors import (
    BatchPromptError,
    EngineError,
    InputTooLongError,
    InvalidParamError,
    RequestError,
)
from engine.params import PoolingParams, SamplingParams

# What a batch reports per finished prompt: (prompt tokens, output tokens).
Progress = Callable[[int, int], None]

# The keys of a vLLM prompt dict this engine reads; any other is refused rather than
# silently ignored (it would change what the prompt asks for).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "prompt_embeds", "multi_modal_data",
                          "mm_processor_kwargs", "cache_salt"})


@dataclasses.dataclass(frozen=True, slots=True)
class BatchPrompt:
    """One prompt of a batch, read from the caller's form. ``prompt`` is what
    :meth:`Engine.prepare` takes (text, token ids, or chat messages); ``text`` is what the
    output reports as its ``prompt`` (None: the token ids were given; ``render``: the
    rendered chat template, decoded from the prompt's ids)."""

    prompt: str | tuple[int, ...] | list[Any] | None
    text: str | None
    images: tuple[Any, ...] = ()
    cache_salt: str | None = None
    chat_options: TemplateOptions | None = None
    render: bool = False
    embeds: Any = None  # vLLM's {"prompt_embeds": tensor}; ``prompt`` is then None
    mm_options: dict[str, Any] | None = None  # the prompt dict's mm_processor_kwargs


def _refused(index: int, message: str, param: str = "prompts") -> BatchPromptError:
    return BatchPromptError(index, InvalidParamError(message, param=param))


def _is_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def generation_prompts(prompts: Any) -> list[BatchPrompt]:
    """vLLM's ``generate`` prompts as a list: one prompt (a string, a list of token ids,
    a prompt dict) or a list of them. A bad one raises :class:`BatchPromptError`."""
    if isinstance(prompts, (str, Mapping)) or _is_ids(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidParamError("prompts must be a string, a list of token ids, a prompt dict "
                                "or a list of these", param="prompts")
    return [_generation_prompt(i, p) for i, p in enumerate(prompts)]


def _generation_prompt(index: int, prompt: Any) -> BatchPrompt:
    if isinstance(prompt, str):
        return BatchPrompt(prompt, prompt)
    if _is_ids(prompt):
        return BatchPrompt(tuple(prompt), None)
    if not isinstance(prompt, Mapping):
        raise _refused(index, "a prompt must be a string, a list of token ids, or a dict with "
                              "'prompt' or 'prompt_token_ids'")
    if "encoder_prompt" in prompt or "decoder_prompt" in prompt:
        prompt = _encoder_decoder_prompt(index, prompt)
    unknown = sorted(set(map(str, prompt)) - _PROMPT_KEYS)
    if unknown:
        raise _refused(index, f"unknown prompt key {unknown[0]!r} (this engine reads "
                              f"{', '.join(sorted(_PROMPT_KEYS))})", param=unknown[0])
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _refused(index, "cache_salt must be a string", param="cache_salt")
    options = prompt.get("mm_processor_kwargs")
    if options is not None and not isinstance(options, Mapping):
        raise _refused(index, "mm_processor_kwargs must be a dict", param="mm_processor_kwargs")
    options = dict(options) if options else None
    if prompt.get("prompt_embeds") is not None:
        if text is not None or ids is not None:
            raise _refused(index, "a prompt dict gives prompt_embeds, or prompt / "
                                  "prompt_token_ids, not both", param="prompt_embeds")
        return BatchPrompt(None, None, _images(index, prompt.get("multi_modal_data")),
                           salt, embeds=prompt["prompt_embeds"], mm_options=options)
    if ids is not None:
        if not _is_ids(ids):
            raise _refused(index, "prompt_token_ids must be a non-empty list of integers",
                           param="prompt_token_ids")
        body: str | tuple[int, ...] = tuple(ids)
    elif isinstance(text, str):
        body = text
    else:
        raise _refused(index, "a prompt dict needs 'prompt' (a string), 'prompt_token_ids' "
                              "or 'prompt_embeds'")
    return BatchPrompt(body, text if isinstance(text, str) else None,
                       _images(index, prompt.get("multi_modal_data")), salt, mm_options=options)


def _encoder_decoder_prompt(index: int, prompt: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's explicit encoder/decoder prompt (Whisper's offline form):
    ``{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": ...}},
    "decoder_prompt": "<|startoftranscript|>..."}`` as the one prompt dict it means: the
    decoder's prompt (text or ``{"prompt_token_ids": [...]}``) with the encoder's clip."""
    extra = sorted(set(map(str, prompt)) - {"encoder_prompt", "decoder_prompt"})
    if extra:
        raise _refused(index, f"an encoder/decoder prompt takes encoder_prompt and "
                              f"decoder_prompt only, not {extra[0]!r}", param=extra[0])
    encoder, decoder = prompt.get("encoder_prompt"), prompt.get("decoder_prompt")
    if not isinstance(encoder, Mapping) or "multi_modal_data" not in encoder:
        raise _refused(index, "encoder_prompt must be a dict with the clip in multi_modal_data",
                       param="encoder_prompt")
    if set(map(str, encoder)) - {"prompt", "multi_modal_data"} or encoder.get("prompt") not in (None, ""):
        raise _refused(index, "encoder_prompt takes multi_modal_data (and an empty prompt) only: "
                              "the encoder reads the clip, not text", param="encoder_prompt")
    if isinstance(decoder, str):
        out: dict[str, Any] = {"prompt": decoder}
    elif isinstance(decoder, Mapping) and set(map(str, decoder)) <= {"prompt", "prompt_token_ids"}:
        out = dict(decoder)
    else:
        raise _refused(index, "decoder_prompt must be a string or a dict with 'prompt' or "
                              "'prompt_token_ids'", param="decoder_prompt")
    return {**out, "multi_modal_data": encoder["multi_modal_data"]}


def _images(index: int, data: Any) -> tuple[Any, ...]:
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        raise _refused(index, "multi_modal_data must be a dict", param="multi_modal_data")
    for kind in data:
        if kind not in ("image", "audio"):
            raise _refused(index, f"multi_modal_data[{kind!r}]: this engine takes images and "
                                  "audio only", param="multi_modal_data")
    if len(data) > 1:
        raise _refused(index, "multi_modal_data gives images or audio, not both (no model "
                              "here takes both)", param="multi_modal_data")
    if "audio" in data:  # a clip, a (samples, rate) pair, or a list of them
        clips = data["audio"]
        if not isinstance(clips, list) and not (isinstance(clips, tuple) and not _is_clip(clips)):
            clips = [clips]
        return tuple(multimodal.AudioClip(c) for c in clips)
    images = data.get("image")
    return tuple(images) if isinstance(images, (list, tuple)) else (images,)


def _is_clip(data: tuple[Any, ...]) -> bool:
    """A ``(samples, rate)`` pair rather than a tuple of clips."""
    return len(data) == 2 and isinstance(data[1], (int, float)) and not isinstance(data[1], bool)


def chat_prompts(messages: Any, options: TemplateOptions,
                 mm_options: dict[str, Any] | None = None) -> list[BatchPrompt]:
    """vLLM's ``chat`` messages as a list of conversations: one conversation (a list of
    message dicts) or a list of them. vLLM's ``image_pil`` parts become the engine's
    ``image`` parts; ``mm_options`` (``mm_processor_kwargs``) shape every one's images."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidParamError("messages must be a conversation (a list of message dicts) "
                                "or a list of conversations", param="messages")
    conversations = messages if isinstance(messages[0], (list, tuple)) else [messages]
    out = []
    for i, conversation in enumerate(conversations):
        if not (isinstance(conversation, (list, tuple)) and conversation
                and all(isinstance(m, Mapping) for m in conversation)):
            raise _refused(i, "a conversation must be a non-empty list of message dicts",
                           param="messages")
        out.append(BatchPrompt([_message(m) for m in conversation], None,
                               chat_options=options, render=True, mm_options=mm_options))
    return out


def _message(message: Mapping[str, Any]) -> Any:
    content = message.get("content")
    if not isinstance(content, (list, tuple)):
        return message
    parts = [{"type": "image", "image": p["image_pil"]}
             if isinstance(p, Mapping) and p.get("type") == "image_pil" else p for p in content]
    return {**message, "content": parts}


class Window:
    """How many samples of this LLM's batches may be in the engine at once (admitted and
    not finished): a counting semaphore whose units are samples, shared by every batch
    of one :class:`engine.LLM` (several threads may run batches together)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._units = trio.Semaphore(size)
        self._lock = trio.Lock()  # one taker of several units at a time: no two half-full

    async def acquire(self, samples: int) -> int:
        """Take room for ``samples`` (a request of ``n`` larger than the window takes it
        all); returns the units taken, for :meth:`release`."""
        units = min(samples, self.size)
        if units == 1:
            await self._units.acquire()
            return 1
        taken = 0
        try:
            async with self._lock:
                while taken < units:
                    await self._units.acquire()
                    taken += 1
        finally:
            if taken < units:
                self.release(taken)  # cancelled half way: give back what was taken
        return units

    def release(self, units: int) -> None:
        for _ in range(units):
            self._units.release()


class _Failure:
    """The first error of a batch's requests, by prompt index; it cancels the rest."""

    def __init__(self, scope: trio.CancelScope) -> None:
        self._scope = scope
        self.index: int | None = None
        self.error: EngineError | None = None

    def record(self, index: int, error: EngineError) -> None:
        if self.error is None:
            self.index, self.error = index, error
        self._scope.cancel()

    def raise_if_any(self) -> None:
        if self.error is not None:
            self.error.add_note(f"(prompt {self.index} of the batch)")
            raise self.error


async def prepare_all(engine: Engine, prompts: Sequence[BatchPrompt],
                      params: Sequence[SamplingParams | None], priorities: Sequence[int],
                      request_ids: Sequence[str], loras: Sequence[str | None] = ()) -> list[PreparedRequest]:
    """Prepare every prompt (:meth:`Engine.prepare`) before any runs, prompt ``i`` with the
    LoRA adapter named ``loras[i]`` (none: the base model); the first refusal raises
    :class:`BatchPromptError` with its index."""
    if engine.pooler is not None:
        raise InvalidParamError(f"the model {engine.model_name} is a pooling model "
                                f"({engine.pooler.task}): use embed, classify or score",
                                param="model")
    prepared = []
    for i, prompt in enumerate(prompts):
        try:
            prepared.append(await engine.prepare(
                prompt.prompt, params[i], request_id=request_ids[i], priority=priorities[i],
                cache_salt=prompt.cache_salt, chat_options=prompt.chat_options,
                images=prompt.images, lora=loras[i] if loras else None,
                prompt_embeds=prompt.embeds, mm_processor_kwargs=prompt.mm_options))
        except RequestError as exc:
            raise BatchPromptError(i, exc) from exc
    return prepared


def _no_text(token: int) -> None:
    return None


async def generate(engine: Engine, prompts: Sequence[BatchPrompt],
                   prepared: Sequence[PreparedRequest], params: Sequence[SamplingParams | None],
                   *, window: Window, progress: Progress,
                   metrics: Metrics | None = None) -> list[GenerationRequestOutput]:
    """Run prepared requests, enqueued in order under ``window``; their outputs in order,
    each request timed into ``metrics`` (``LLM.get_metrics``) from its enqueueing."""
    results: list[GenerationRequestOutput | None] = [None] * len(prepared)
    decoded: dict[int, str] = {}

    def decode(token: int) -> str:
        text = decoded.get(token)
        if text is None:
            text = decoded[token] = engine.tokenizer.decode([token], skip_special_tokens=False)
        return text

    async def read(index: int, stream: Any, units: int, timer: RequestTimer | None) -> None:
        async with stream:  # first, before any checkpoint: a cancel here still aborts it
            try:
                prompt = prompts[index]
                wanted = params[index]
                ids = prepared[index].prompt_token_ids
                text = (engine.tokenizer.decode(list(ids), skip_special_tokens=False)
                        if prompt.render else prompt.text)
                acc = GenerationAccumulator(
                    # An embeddings prompt's ids are placeholders: None, as vLLM gives.
                    stream.request_id, text, None if prompt.embeds is not None else ids,
                    logprobs=wanted is not None and wanted.logprobs is not None,
                    # detokenize=False: no decoded tokens either, as vLLM's.
                    decode=decode if wanted is None or wanted.detokenize else _no_text)
                if timer is not None:
                    timer.prompt(len(ids))
                    first = prepared[index].admitted.samples[0].params
                    timer.params(prepared[index].samples, engine.max_model_len - len(ids)
                                 if first.max_tokens is None else first.max_tokens)
                async for out in stream:
                    acc.add(out)
                    if timer is not None:
                        timer.output(out.index, len(out.token_ids), out.finish_reason,
                                     out.scheduled_time)
                results[index] = acc.result()
                progress(len(ids), acc.output_tokens)
            except EngineError as exc:  # the request failed in the engine, or it died
                failure.record(index, exc)
            finally:
                window.release(units)
                if timer is not None:
                    timer.done()

    async with trio.open_nursery() as nursery:
        failure = _Failure(nursery.cancel_scope)
        for i, request in enumerate(prepared):
            units = await window.acquire(request.samples)
            timer = metrics.timer() if metrics is not None else None
            try:
                stream = engine.enqueue(request)
            except EngineError as exc:
                window.release(units)
                failure.record(i, exc)
                break
            nursery.start_soon(read, i, stream, units, timer)
    failure.raise_if_any()
    return [r for r in results if r is not None]


# -- pooling --------------------------------------------------------------------------------

def pooling_inputs(prompts: Any) -> list[str | tuple[int, ...]]:
    """vLLM's pooling prompts: a string, token ids, a prompt dict (no images), or a list."""
    out: list[str | tuple[int, ...]] = []
    for i, p in enumerate(generation_prompts(prompts)):
        if p.images:
            raise _refused(i, "a pooling model takes no images", param="multi_modal_data")
        out.append(p.prompt)  # type: ignore[arg-type]  # text or ids: never chat here
    return out


def _pooler(engine: Engine, task: str | tuple[str, ...] | None, what: str) -> Any:
    pooler = engine.pooler
    tasks = (task,) if isinstance(task, str) else task
    if pooler is None or (tasks is not None and pooler.task not in tasks):
        kind = "a generation model" if pooler is None else f"a {pooler.task} model"
        raise InvalidParamError(f"the model {engine.model_name} is {kind}: it does not {what}",
                                param="model")
    return pooler


async def _token_ids(engine: Engine, inputs: Sequence[str | tuple[int, ...]],
                     truncate: int | None | Sequence[int | None]) -> list[tuple[int, ...]]:
    """Every input tokenized (in a worker thread: a batch may be thousands of texts, and
    other batches' outputs flow through this trio thread meanwhile), with ``truncate``'s
    ``truncate_prompt_tokens`` (one for all, or one per input); the first bad one raises
    :class:`BatchPromptError`."""
    limits = truncate if isinstance(truncate, Sequence) else [truncate] * len(inputs)

    def one(i: int) -> tuple[int, ...]:
        try:
            ids = pooling.input_ids(engine.tokenizer, inputs[i], truncate=limits[i],
                                    max_model_len=engine.max_model_len, param="prompts")
            _check_length(ids, engine.max_model_len)
        except RequestError as exc:
            raise BatchPromptError(i, exc) from exc
        return ids

    def work() -> list[tuple[int, ...]]:
        try:  # the texts in one tokenizer call
            out = pooling.input_ids_many(engine.tokenizer, inputs, truncate=limits,
                                         max_model_len=engine.max_model_len, param="prompts")
        except RequestError:
            return [one(i) for i in range(len(inputs))]  # names the first bad one
        for i, ids in enumerate(out):
            try:
                _check_length(ids, engine.max_model_len)
            except RequestError as exc:
                raise BatchPromptError(i, exc) from exc
        return out

    return await trio.to_thread.run_sync(work, abandon_on_cancel=True)


def _check_length(ids: tuple[int, ...], max_model_len: int) -> None:
    if not ids:
        raise InvalidParamError("the input is empty", param="prompts")
    if len(ids) > max_model_len:
        raise InputTooLongError(prompt_tokens=len(ids), max_model_len=max_model_len,
                                        param="prompts")


async def _pool(engine: Engine, inputs: Sequence[tuple[int, ...]], *, window: Window,
                progress: Progress, tokens: bool = False,
                loras: Sequence[str | None] | None = None) -> list[Pooled]:
    """Each input as its own request under ``window`` (so a batch of any size runs
    without meeting the queue's limit); the pooled outputs in order (``tokens``: each
    prompt token's hidden state)."""
    results: list[Pooled | None] = [None] * len(inputs)

    async def one(index: int) -> None:
        try:
            (results[index],) = await engine.pool(
                [inputs[index]], tokens=tokens, lora=loras[index] if loras else None)
            progress(len(inputs[index]), 0)
        except EngineError as exc:
            failure.record(index, exc)
        finally:
            window.release(1)

    async with trio.open_nursery() as nursery:
        failure = _Failure(nursery.cancel_scope)
        for i in range(len(inputs)):
            await window.acquire(1)
            nursery.start_soon(one, i)
    failure.raise_if_any()
    return [r for r in results if r is not None]


async def _checked_pool(engine: Engine, inputs: Sequence[str | tuple[int, ...]],
                        params: Sequence[PoolingParams], *, task: str, refused: tuple[str, ...],
                        window: Window, progress: Progress, tokens: bool = False,
                        check: Callable[[PoolingParams], None] | None = None,
                        loras: Sequence[str | None] | None = None,
                        ) -> tuple[list[tuple[int, ...]], list[Pooled]]:
    """A pooling batch's common path: each input's params checked for ``task`` (the
    first bad one a :class:`BatchPromptError`), the inputs tokenized and pooled (``tokens``:
    a row a token)."""
    for i, p in enumerate(params):
        try:
            _only(p, task, refused)
            if check is not None:
                check(p)
        except RequestError as exc:
            raise BatchPromptError(i, exc) from exc
    ids = await _token_ids(engine, inputs, [p.truncate_prompt_tokens for p in params])
    return ids, await _pool(engine, ids, window=window, progress=progress, tokens=tokens,
                            loras=loras)


async def embed(engine: Engine, inputs: Sequence[str | tuple[int, ...]], *,
                params: Sequence[PoolingParams], request_ids: Sequence[str], window: Window,
                progress: Progress,
                loras: Sequence[str | None] | None = None) -> list[EmbeddingRequestOutput]:
    """Embed each input with its :class:`PoolingParams` (``dimensions``, ``normalize``)
    and its LoRA adapter (``loras``: a name each, None: the base model)."""
    pooler = _pooler(engine, "embed", "embed")
    ids, pooled = await _checked_pool(
        engine, inputs, params, task="embed", refused=("use_activation",), window=window,
        progress=progress, check=lambda p: pooling.check_dimensions(
            p.dimensions, pooler.matryoshka_dimensions, pooler.size), loras=loras)
    out = []
    for rid, p, i, pp in zip(request_ids, pooled, ids, params, strict=True):
        vector = pooling.embedding(p, pp.dimensions, pooler.normalizes(pp.normalize))
        out.append(EmbeddingRequestOutput(rid, EmbeddingOutput(vector.tolist()), list(i)))
    return out


async def embed_tokens(engine: Engine, inputs: Sequence[str | tuple[int, ...]], *,
                       params: Sequence[PoolingParams], request_ids: Sequence[str],
                       window: Window, progress: Progress,
                       loras: Sequence[str | None] | None = None) -> list[tuple[Pooled, list[int]]]:
    """vLLM's ``token_embed`` of each input with its :class:`PoolingParams`
    (``normalize``, row by row) and adapter: each input's per-token output and its ids."""
    pooler = _pooler(engine, "embed", "embed tokens")
    ids, pooled = await _checked_pool(
        engine, inputs, params, task="token_embed", refused=("use_activation", "dimensions"),
        window=window, progress=progress, tokens=True, loras=loras)
    return [(pooling.token_embeddings(p, pooler.normalizes(pp.normalize)), list(i))
            for p, i, pp in zip(pooled, ids, params, strict=True)]


async def classify_tokens(engine: Engine, inputs: Sequence[str | tuple[int, ...]], *,
                          params: Sequence[PoolingParams], request_ids: Sequence[str],
                          window: Window, progress: Progress) -> list[tuple[Pooled, list[int]]]:
    """vLLM's ``token_classify`` of each input with its :class:`PoolingParams`
    (``use_activation``): each input's per-token probabilities (or logits) and its ids."""
    _pooler(engine, "token_classify", "classify tokens")
    ids, pooled = await _checked_pool(
        engine, inputs, params, task="token_classify", refused=("dimensions", "normalize"),
        window=window, progress=progress, tokens=True)
    return [(pooling.token_class_probs(p, pp.use_activation is not False), list(i))
            for p, i, pp in zip(pooled, ids, params, strict=True)]


async def classify(engine: Engine, inputs: Sequence[str | tuple[int, ...]], *,
                   params: Sequence[PoolingParams], request_ids: Sequence[str],
                   window: Window, progress: Progress) -> list[ClassificationRequestOutput]:
    """Classify each input with its :class:`PoolingParams` (``use_activation``)."""
    _pooler(engine, "classify", "classify")
    ids, pooled = await _checked_pool(
        engine, inputs, params, task="classify", refused=("dimensions", "normalize"),
        window=window, progress=progress)
    return [ClassificationRequestOutput(
                rid, ClassificationOutput(pooling.class_probs(p, pp.use_activation is not False)),
                list(i))
            for rid, p, i, pp in zip(request_ids, pooled, ids, params, strict=True)]


def _only(params: PoolingParams, task: str, refused: tuple[str, ...]) -> None:
    """Fail closed on a PoolingParams field that means nothing for ``task``."""
    for name in refused:
        if getattr(params, name) is not None:
            raise InvalidParamError(f"pooling_params.{name} does not apply to {task}",
                                    param=f"pooling_params.{name}")


async def score(engine: Engine, firsts: Sequence[str], seconds: Sequence[str], *,
                truncate: int | None, request_ids: Sequence[str], window: Window,
                progress: Progress,
                loras: Sequence[str | None] | None = None) -> list[ScoringRequestOutput]:
    """Score each pair: a cross-encoder reads the two together (the sigmoid of its
    one logit); an embedding model embeds each distinct text once per adapter (``loras``:
    pair ``i``'s adapter name, None: the base model) and scores by cosine similarity."""
    pooler = _pooler(engine, ("embed", "classify"), "score")
    adapters = list(loras) if loras else [None] * len(firsts)
    if pooler.task == "classify":
        if any(adapters):  # adapters run on decoders; a cross-encoder here is BERT
            raise InvalidParamError("lora_request: a cross-encoder takes no LoRA adapter",
                                    param="lora_request")
        if pooler.size != 1:
            raise InvalidParamError(f"score needs a cross-encoder with one output label; this "
                                    f"model has {pooler.size}", param="model")

        def pairs() -> list[tuple[int, ...]]:
            out = []
            for i, (a, b) in enumerate(zip(firsts, seconds, strict=True)):
                try:
                    ids = pooling.pair_ids(engine.tokenizer, a, b, truncate=truncate,
                                           max_model_len=engine.max_model_len)
                    _check_length(ids, engine.max_model_len)
                except RequestError as exc:
                    raise BatchPromptError(i, exc) from exc
                out.append(ids)
            return out

        ids = await trio.to_thread.run_sync(pairs, abandon_on_cancel=True)
        pooled = await _pool(engine, ids, window=window, progress=progress)
        return [ScoringRequestOutput(rid, ScoringOutput(pooling.classifier_score(p)), list(i))
                for rid, p, i in zip(request_ids, pooled, ids, strict=True)]
    keys = list(dict.fromkeys([*zip(firsts, adapters, strict=True),
                               *zip(seconds, adapters, strict=True)]))
    ids = await _token_ids(engine, [text for text, _ in keys], truncate)
    by_text = dict(zip(keys, zip(ids, await _pool(engine, ids, window=window,
                                                  progress=lambda _p, _o: None,
                                                  loras=[lora for _, lora in keys]),
                                 strict=True), strict=True))
    out = []
    for rid, a, b, lora in zip(request_ids, firsts, seconds, adapters, strict=True):
        (ids_a, pa), (ids_b, pb) = by_text[a, lora], by_text[b, lora]
        out.append(ScoringRequestOutput(rid, ScoringOutput(pooling.cosine(pa, pb)),
                                        [*ids_a, *ids_b]))
        progress(len(ids_a) + len(ids_b), 0)
    return out


def score_pairs(data_1: Any, data_2: Any) -> tuple[list[str], list[str]]:
    """vLLM's ``score`` arguments as pairs: one text against each of many, or as many
    texts on each side, paired in order."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    for side, texts in (("data_1", firsts), ("data_2", seconds)):
        if not texts:
            raise InvalidParamError(f"{side} is empty", param=side)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise _refused(i, f"{side}[{i}] must be a string", param=side)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise InvalidParamError(f"data_1 has {len(firsts)} texts and data_2 {len(seconds)}: "
                                "give one data_1 or as many as data_2", param="data_2")
    return firsts, seconds
