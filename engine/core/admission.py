"""Admission: what happens to a request in its caller's task before the engine sees it.

Pure (no I/O, no trio). :func:`submit_request` checks the caller's arguments,
:func:`prompt_token_ids` applies the chat template and tokenizes, and :func:`admit`
checks the queue, the vocabulary and the context, resolves ``max_tokens`` once and expands
``n`` into samples; :func:`compile_structured` compiles a structured-output grammar (into
the backend's cache, once per distinct spec). Each raises the request's own error (:class:`InvalidParamError`,
:class:`PromptTooLongError`, :class:`QueueFullError`); nothing is sent before all three
have passed, so a refused or cancelled request leaves nothing behind. This is the line
vLLM draws between its front end (input processing) and its engine core.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from engine.errors import (
    InvalidParamError,
    PromptTextTooLongError,
    PromptTooLongError,
    QueueFullError,
)
from engine.messages import (
    AdmittedRequest,
    ChatPrompt,
    DetokenizerRequest,
    ImageInput,
    LoraAdapter,
    SchedulerRequest,
    SubmitRequest,
    TextPrompt,
    TokensPrompt,
)
from engine.params import ENGINE_EXTRA_ARGS, SamplingParams
from engine.structured.check import max_output_bytes

Prompt = TextPrompt | TokensPrompt | ChatPrompt

# Text prompts longer than this many characters are tokenized in a worker thread: about
# 8k tokens, which the tokenizer takes milliseconds over, long enough to stall every other
# request's stream if done on the trio thread; shorter ones cost less than the thread hop.
# Chat prompts always go to a thread: a template's cost does not follow its size.
THREAD_PROMPT_CHARS = 32_768
# A text more than this many times max_model_len * max_token_chars characters long cannot
# fit the context (each token stands for at most max_token_chars characters), and is
# refused without being tokenized. The margin covers normalizers that shorten text
# (composing accents: two characters into one).
_TEXT_MARGIN = 4


class PromptTokenizer(Protocol):
    """What admission needs of a tokenizer: the model's, with ``chat_prompt_ids`` for chat
    messages (:class:`engine.chat.template.ChatTokenizer`, handed down by its caller)."""

    @property
    def max_token_chars(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def chat_prompt_ids(
        self, messages: Sequence[Any], add_generation_prompt: bool = True, *,
        special_tokens_in_content: bool = False,
        check_rendered: Callable[[str], Any] | None = None, **options: Any,
    ) -> list[int]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_model_len: int
    vocab_size: int
    max_queued_requests: int
    eos_token_ids: tuple[int, ...]
    # The most logprobs / prompt_logprobs a request may ask for; -1: the vocabulary.
    max_logprobs: int = 20
    # The special tokens (a grammar never lets one be sampled but for EOS): a stop token
    # id outside them and EOS is a text token a constrained output may reach mid-way.
    special_token_ids: frozenset[int] = frozenset()
    # False for a model whose recurrent layers keep one state a request: a beam's
    # fork would need its parent's state copied, which is not built.
    beam_search: bool = True


def sample_ids(request_id: str, n: int, serial: int) -> tuple[str, ...]:
    """The engine ids of a request's samples: ``{id}#{serial}``, or ``{id}#{serial}.{i}``
    for sample ``i`` of n > 1, where ``serial`` numbers the engine's requests.

    Unique by construction, whatever ids callers choose: the text after the last ``#`` is
    digits and dots (the caller's id may hold ``#`` but nothing of it follows ours), so it
    gives back the serial and the index, and two requests never share a serial. A caller's
    id is kept in front so logs still name the request."""
    base = f"{request_id}#{serial}"
    return (base,) if n == 1 else tuple(f"{base}.{i}" for i in range(n))


def submit_request(
    prompt: Any,
    params: Any,
    *,
    request_id: str,
    priority: Any,
    cache_salt: Any,
    arrival_time: float,
    chat_options: str | None = None,
    lora: LoraAdapter | None = None,
) -> SubmitRequest:
    """The caller's arguments as a :class:`SubmitRequest`, or the error naming the bad one.

    ``prompt`` is a string, a list of token ids or a list of chat messages (dicts)."""
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidParamError("params must be an engine.SamplingParams", param="params")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidParamError(f"priority must be an integer, got {priority!r}", param="priority")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidParamError("cache_salt must be a string", param="cache_salt")
    return SubmitRequest(
        request_id, prompt_message(prompt, chat_options), params, priority, cache_salt,
        arrival_time, lora,
    )


def prompt_message(prompt: Any, chat_options: str | None = None) -> Prompt:
    """A string, a list of token ids or a list of chat messages as its prompt message;
    ``chat_options`` is the chat template's options as JSON (ChatPrompt.options_json)."""
    if chat_options is not None and not (
        isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt)
    ):
        raise InvalidParamError("chat_options apply to chat messages only", param="chat_options")
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        try:
            return ChatPrompt(json.dumps(list(prompt)), chat_options or "{}")
        except (TypeError, ValueError) as exc:
            raise InvalidParamError(f"chat messages must be JSON values: {exc}", param="messages") from exc
    if isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return TokensPrompt(tuple(prompt))
    raise InvalidParamError(
        "prompt must be a string, a list of token ids or a list of chat messages", param="prompt"
    )


def prompt_chars(prompt: Prompt) -> int:
    """How much text tokenizing ``prompt`` reads (0 for token ids)."""
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    return len(prompt.messages_json) if isinstance(prompt, ChatPrompt) else 0


def needs_thread(prompt: Prompt) -> bool:
    """Whether tokenizing ``prompt`` belongs in a worker thread: a chat (its template may
    cost anything) or a long text."""
    return isinstance(prompt, ChatPrompt) or prompt_chars(prompt) > THREAD_PROMPT_CHARS


def prompt_token_ids(
    tokenizer: PromptTokenizer, prompt: Prompt, *, add_special_tokens: bool = True,
    special_tokens_in_content: bool = False, max_model_len: int | None = None,
    truncate: int | None = None, truncation_side: str = "left",
) -> tuple[int, ...]:
    """Apply the chat template (whose normalizer checks the messages) and tokenize; safe in
    a worker thread, where the caller bounds the render with
    :func:`engine.models.chat_sandbox.render_budget`. ``add_special_tokens=False`` is for
    ``/tokenize``. Text of chat messages never becomes a control token (a forged
    ``<|im_start|>system`` turn stays text) unless ``special_tokens_in_content``
    (``--allow-special-tokens-in-content``); a plain ``prompt`` is the caller's own text,
    special tokens and all, as in vLLM. With ``max_model_len``, a text too long to fit it (the prompt, or the rendered chat) is
    refused (:class:`PromptTooLongError`) before it is tokenized. ``truncate`` is
    ``truncate_prompt_tokens`` resolved to a count (:func:`truncation_limit`): the prompt
    keeps its last that many tokens (``truncation_side`` "right": its first; a text its
    tokenizer's special tokens too), and no text is too long."""
    if truncate is not None:
        return _truncated(prompt_token_ids(
            tokenizer, prompt, add_special_tokens=add_special_tokens,
            special_tokens_in_content=special_tokens_in_content),
            tokenizer, prompt, truncate, add_special_tokens, right=truncation_side == "right")
    if isinstance(prompt, TextPrompt):
        text = _fitting(_unicode(prompt.text, "prompt"), tokenizer, max_model_len)
        return tuple(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if isinstance(prompt, ChatPrompt):
        options = {"add_generation_prompt": True, **json.loads(prompt.options_json)}
        messages = json.loads(prompt.messages_json)
        # The JSON text escapes a lone surrogate; this check sees it as the tokenizer would.
        _unicode(json.dumps([messages, options], ensure_ascii=False), "messages")
        return tuple(tokenizer.chat_prompt_ids(
            messages, special_tokens_in_content=special_tokens_in_content,
            check_rendered=lambda text: _fitting(text, tokenizer, max_model_len),
            **options))
    return prompt.token_ids


def truncation_limit(truncate: int, max_model_len: int) -> int:
    """``truncate_prompt_tokens`` as a count of tokens: ``-1`` is ``max_model_len``; more
    than ``max_model_len`` is refused, as vLLM refuses it."""
    if truncate > max_model_len:
        raise InvalidParamError(
            f"truncate_prompt_tokens ({truncate}) exceeds the model's context "
            f"({max_model_len}); give a smaller count, or -1 for the whole context",
            param="truncate_prompt_tokens")
    return max_model_len if truncate == -1 else truncate


def _truncated(ids: tuple[int, ...], tokenizer: PromptTokenizer, prompt: Prompt, limit: int,
               add_special_tokens: bool, *, right: bool = False) -> tuple[int, ...]:
    """The last ``limit`` of ``ids`` (``right``: the first). A text keeps the special
    tokens its tokenizer put around it (BOS) and loses text tokens from that end, as a
    tokenizer's own truncation of a text does; a chat (its template wrote its markers as
    text) and token ids keep their last (first) ``limit`` tokens."""
    if len(ids) <= limit:
        return ids
    if isinstance(prompt, TextPrompt) and add_special_tokens:
        plain = tuple(tokenizer.encode(prompt.text, add_special_tokens=False))
        extra = len(ids) - len(plain)
        lead = next((k for k in range(extra + 1) if ids[k:k + len(plain)] == plain), None)
        room = limit - extra
        if lead is not None and room > 0:
            kept = plain[:room] if right else plain[len(plain) - room:]
            return ids[:lead] + kept + ids[lead + len(plain):]
    return ids[:limit] if right else ids[len(ids) - limit:]


def request_params(params: SamplingParams, *, processors: Sequence[type], images: bool,
                   encode: Callable[[str], Sequence[int]],
                   engine_keys: frozenset[str] = frozenset()) -> SamplingParams:
    """``params`` as the engine runs them (``bad_words`` as token ids, through ``encode``:
    text without special tokens), after the checks only the engine can make: the server's
    logits processor classes (``extra_args``, each one's ``validate_params``), and what
    their batch or a request's images cannot take. ``engine_keys``: the engine's own
    ``extra_args`` keys the model reads (Whisper's); another model refuses them."""
    stray = sorted(set(params.extra_args or ()) & ENGINE_EXTRA_ARGS - engine_keys)
    if stray:
        raise InvalidParamError(f"extra_args key {stray[0]!r} is the engine's own, read only for a "
                                "Whisper model's transcriptions", param="extra_args")
    if params.extra_args and not processors and set(params.extra_args) - ENGINE_EXTRA_ARGS:
        raise InvalidParamError(
            "extra_args (vllm_xargs) are arguments of the server's logits processors, and "
            "this server runs none (--logits-processors)", param="extra_args")
    if processors and params.prediction:
        # A prediction is verified as speculative rows, which processors cannot see.
        raise InvalidParamError("prediction cannot be combined with the server's logits "
                                "processors (--logits-processors)", param="prediction")
    for cls in processors:
        try:
            cls.validate_params(params)  # type: ignore[attr-defined]
        except Exception as exc:  # the operator's code: any error refuses the request
            raise InvalidParamError(f"a logits processor refused the request: {exc}",
                                    param="extra_args") from exc
    if params.truncate_prompt_tokens is not None and images:
        # Cutting the prompt could cut an image's placeholder tokens apart.
        raise InvalidParamError("truncate_prompt_tokens cannot be combined with images",
                                param="truncate_prompt_tokens")
    if params.bad_words:
        ids = bad_words_token_ids(encode, params.bad_words)
        params = params.replace(bad_words_token_ids=tuple(dict.fromkeys(
            params.bad_words_token_ids + ids)))
    return params


def fim_prompt_ids(tokenizer: Any, prefix: str, suffix: str) -> tuple[int, ...]:
    """A fill-in-the-middle prompt in the tokenizer's convention: its FIM prefix token, the
    text before the gap, the suffix token, the text after it, the middle token (after
    which the model writes the gap), behind the special tokens the tokenizer starts every
    prompt with (BOS, for one that adds it). ``tokenizer`` is the model's
    (:attr:`engine.models.tokenizer.Tokenizer.fim_token_ids`); a model without FIM tokens
    is refused naming ``suffix``."""
    fim = tokenizer.fim_token_ids
    if fim is None:
        raise InvalidParamError(
            "suffix (fill-in-the-middle) needs a model trained for it, whose tokenizer has "
            "FIM tokens (<|fim_prefix|> <|fim_suffix|> <|fim_middle|>, or <fim_prefix> ...); "
            "this model's has none", param="suffix")
    fim_prefix, fim_suffix, fim_middle = fim
    # Each text as any completions prompt is read (its special-token text included), as
    # the model's own FIM layout written out as one text would be.
    before = tuple(tokenizer.encode(_unicode(prefix, "prompt"), add_special_tokens=False))
    after = tuple(tokenizer.encode(_unicode(suffix, "suffix"), add_special_tokens=False))
    # What the tokenizer puts in front of a text (its BOS): the ids before the text's own.
    probe = "x"
    plain = tuple(tokenizer.encode(probe, add_special_tokens=False))
    full = tuple(tokenizer.encode(probe, add_special_tokens=True))
    lead = full[:full.index(plain[0])] if plain and plain[0] in full else ()
    return (*lead, fim_prefix, *before, fim_suffix, *after, fim_middle)


def bad_words_token_ids(encode: Callable[[str], Sequence[int]],
                        words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as token sequences, as vLLM reads them: each word (leading spaces
    stripped) as it starts a text, and after a space where that spells it with another
    first token in as many tokens (so " Paris" is banned beside "Paris" when the tokenizer
    has a word token for each). ``encode`` takes text without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        for ids in (bare, spaced):
            if ids and ids not in out and (ids is bare or (
                    len(ids) == len(bare) and ids[0] != bare[0])):
                out.append(ids)
    return tuple(out)


def _fitting(text: str, tokenizer: PromptTokenizer, max_model_len: int | None) -> str:
    """``text``, unless it is too long to be ``max_model_len`` tokens (then an error)."""
    if max_model_len is not None:
        limit = _TEXT_MARGIN * max_model_len * tokenizer.max_token_chars
        if len(text) > limit:
            raise PromptTextTooLongError(chars=len(text), max_chars=limit,
                                         max_model_len=max_model_len)
    return text


class GrammarCompiler(Protocol):
    """What admission needs of :class:`engine.structured.GrammarBackend`."""

    def compile(self, spec: Any, *, count: bool = True) -> Any: ...

    def is_cached(self, spec: Any) -> bool: ...


def compile_structured(grammar: GrammarCompiler | None, params: SamplingParams) -> None:
    """Compile the request's structured-output grammar into the backend's cache (blocking
    on a miss; safe in a worker thread), so the model runner only looks it up. An invalid
    or unsupported constraint raises :class:`InvalidParamError` naming
    ``structured_outputs``."""
    spec = params.structured_outputs
    if spec is None:
        return
    if grammar is None:
        raise InvalidParamError("this engine has no grammar backend for structured outputs",
                                param="structured_outputs")
    check_min_tokens(params)
    grammar.compile(spec)


def check_min_tokens(params: SamplingParams) -> None:
    """Refuse ``min_tokens`` beyond the longest output a bounded regex or choice allows:
    the grammar would end first and leave no token to sample (a dead end mid-generation)."""
    spec = params.structured_outputs
    if spec is None or params.min_tokens == 0 or spec.think is not None:
        return
    most = max_output_bytes(spec.kind, spec.text, spec.choice)
    if most is not None and params.min_tokens > most:
        raise InvalidParamError(
            f"min_tokens ({params.min_tokens}) exceeds what the {spec.kind} constraint can "
            f"write: at most {most} bytes, so at most {most} tokens, before it must stop",
            param="min_tokens")


# The preprocessed pixels (float32) one request may carry, over all its samples: a quarter
# of an engine-core frame (engine.process.wire), e.g. 8 samples of 4 LLaVA-1.5 images.
MAX_IMAGE_BYTES = 16 * 2**20


def check_queue(waiting: int, limits: AdmissionLimits) -> None:
    """Admission control: :class:`QueueFullError` when ``waiting`` samples already wait."""
    if waiting >= limits.max_queued_requests:
        raise QueueFullError(
            f"{limits.max_queued_requests} requests are already waiting; try again later"
        )


def admit(
    submit: SubmitRequest, ids: tuple[int, ...], limits: AdmissionLimits, *, waiting: int,
    serial: int, images: tuple[ImageInput, ...] = (), prediction: tuple[int, ...] = (),
) -> AdmittedRequest:
    """Check a tokenized request against the engine's limits and expand it into samples.

    ``waiting`` is how many samples wait to be scheduled now (admission control);
    ``serial`` is this request's number, never given to another request of the engine (it
    makes the sample ids unique: :func:`sample_ids`)."""
    check_queue(waiting, limits)
    if not ids:
        raise InvalidParamError("the prompt is empty", param="prompt")
    image_bytes = sum(len(image.pixels) for image in images) * submit.params.n
    if image_bytes > MAX_IMAGE_BYTES:
        # Each sample carries the pixels to the runner (across a process boundary in one
        # message, whose frame is bounded): refused rather than a frame too large to send.
        raise InvalidParamError(
            f"the request's images are {image_bytes} bytes of pixels for its {submit.params.n} "
            f"sample(s); at most {MAX_IMAGE_BYTES} are taken (send fewer images or lower n)",
            param="messages")
    _check_vocab(ids, limits.vocab_size, "prompt", "prompt token id")
    # Checked here, per request: the sampler's own check would fail the whole step and with
    # it the engine.
    _check_vocab([t for t, _ in submit.params.logit_bias], limits.vocab_size, "logit_bias",
                 "logit_bias token id")
    _check_vocab(submit.params.allowed_token_ids or (), limits.vocab_size, "allowed_token_ids",
                 "allowed_token_ids id")
    _check_vocab([t for word in submit.params.bad_words_token_ids for t in word],
                 limits.vocab_size, "bad_words", "bad_words token id")
    _check_model_ranges(submit.params, limits)
    submit = _resolve_logprobs(submit, limits)
    max_tokens = submit.params.max_tokens
    room = limits.max_model_len - len(ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise PromptTooLongError(
            prompt_tokens=len(ids),
            max_tokens=max_tokens if max_tokens is not None else 1,
            max_model_len=limits.max_model_len,
        )
    if submit.params.min_tokens > room:
        raise InvalidParamError(
            f"min_tokens ({submit.params.min_tokens}) exceeds the {room} tokens the context "
            f"leaves after the {len(ids)}-token prompt", param="min_tokens",
        )
    return _expand(submit, ids, max_tokens if max_tokens is not None else room, limits, serial,
                   images, prediction)


def _check_model_ranges(params: SamplingParams, limits: AdmissionLimits) -> None:
    """The ranges only the model fixes (``SamplingParams`` checked the rest): ids inside
    the vocabulary, ``top_k`` and logprob counts up to it, and a request that could never
    sample a token (its first tokens may not stop it, yet every token stops it) refused
    here rather than failing in the sampler."""
    vocab = limits.vocab_size
    _check_vocab(params.stop_token_ids, vocab, "stop_token_ids", "stop_token_ids id")
    if params.structured_outputs is not None:
        # As stop strings (SamplingParams refuses those): a text token that stops the
        # request could end a constrained output before it matches. EOS and the other
        # special tokens cannot: the grammar allows EOS only where it is complete and masks
        # the rest.
        text = [t for t in params.stop_token_ids
                if t not in limits.eos_token_ids and t not in limits.special_token_ids]
        if text:
            raise InvalidParamError(
                f"stop_token_ids {text[0]} is a text token: with a constrained output "
                "(structured outputs, response_format, guided_*, forced tool calls) it could "
                "end the output before it matches; only EOS and special tokens may stop it",
                param="stop_token_ids")
    if params.top_k > vocab:
        raise InvalidParamError(
            f"top_k must be -1, 0 (off) or at most the vocabulary size {vocab}, got "
            f"{params.top_k}", param="top_k",
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab:
            raise InvalidParamError(f"{name} ({value}) exceeds the vocabulary size {vocab}",
                                    param=name)
    if params.min_tokens > 0:
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(limits.eos_token_ids)
        if len({t for t in stops if t < vocab}) >= vocab:
            raise InvalidParamError(
                "no token can be sampled: every token of the vocabulary stops the request "
                "(stop_token_ids and EOS) while min_tokens forbids stopping",
                param="stop_token_ids",
            )


def _resolve_logprobs(submit: SubmitRequest, limits: AdmissionLimits) -> SubmitRequest:
    """Logprob counts checked against ``max_logprobs`` (--max-logprobs), -1 (the whole
    vocabulary, where the server allows it) replaced by the vocabulary size."""
    vocab = limits.vocab_size
    cap = vocab if limits.max_logprobs == -1 else limits.max_logprobs
    changes = {}
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(submit.params, name)
        if value is None:
            continue
        count = vocab if value == -1 else value
        if count > cap:
            raise InvalidParamError(
                f"{name} asks for {'the whole vocabulary' if value == -1 else count} "
                f"logprobs; this server allows at most {cap} (--max-logprobs)", param=name)
        if value == -1:
            changes[name] = vocab
    if not changes:
        return submit
    return dataclasses.replace(submit, params=submit.params.replace(**changes))


def _expand(
    submit: SubmitRequest, ids: tuple[int, ...], max_tokens: int, limits: AdmissionLimits,
    serial: int, images: tuple[ImageInput, ...] = (), prediction: tuple[int, ...] = (),
) -> AdmittedRequest:
    names = sample_ids(submit.request_id, submit.params.n, serial)
    if submit.params.beam_width:
        if not limits.beam_search:
            raise InvalidParamError("beam search is not supported for models with "
                                    "recurrent layers (Mamba-2, Gated DeltaNet)", param="use_beam_search")
        return _beam_group(submit, ids, max_tokens, limits, names, images)
    # Samples after the first wait until the first has computed (and cached) the prompt's
    # full blocks, then take them from the prefix cache; with prompt_logprobs each computes
    # (and scores) the prompt itself.
    wait_for = names[0] if submit.params.n > 1 and submit.params.prompt_logprobs is None else None
    samples, outputs = [], []
    for index, name in enumerate(names):
        params = _sample_params(submit.params, index)
        samples.append(SchedulerRequest(
            sample_id=name, prompt_token_ids=ids, params=params,
            eos_token_ids=limits.eos_token_ids, max_tokens=max_tokens,
            priority=submit.priority, arrival_time=submit.arrival_time,
            cache_salt=prefix_salt(submit.cache_salt, submit.lora),
            wait_for=wait_for if index > 0 else None,
            images=images, prediction_token_ids=prediction, lora=submit.lora,
        ))
        outputs.append(DetokenizerRequest(name, submit.request_id, index, ids, params))
    return AdmittedRequest(submit.request_id, tuple(samples), tuple(outputs))


def _beam_group(
    submit: SubmitRequest, ids: tuple[int, ...], max_tokens: int, limits: AdmissionLimits,
    names: tuple[str, ...], images: tuple[ImageInput, ...],
) -> AdmittedRequest:
    """A beam search: one scheduler request (the group, under the first sample's id) and
    one output sample per returned hypothesis."""
    if images:
        raise InvalidParamError("beam search over image inputs is not supported", param="n")
    # With a LoRA adapter every beam's row runs it (the group hands it to each beam), and
    # the group's prefix blocks are the adapter's own, as a sample's are.
    group = SchedulerRequest(
        sample_id=names[0], prompt_token_ids=ids, params=submit.params,
        eos_token_ids=limits.eos_token_ids, max_tokens=max_tokens, priority=submit.priority,
        arrival_time=submit.arrival_time,
        cache_salt=prefix_salt(submit.cache_salt, submit.lora), wait_for=None,
        beam_output_ids=names, lora=submit.lora,
    )
    outputs = tuple(DetokenizerRequest(name, submit.request_id, index, ids,
                                       submit.params.replace(n=1, beam_width=0, length_penalty=1.0,
                                                             early_stopping=False))
                    for index, name in enumerate(names))
    return AdmittedRequest(submit.request_id, (group,), outputs)


def prefix_salt(cache_salt: str | None, lora: LoraAdapter | None) -> str | None:
    """The prefix cache's salt of a request: its own ``cache_salt``, and its adapter's id.

    The KV of a prompt under an adapter is not the base model's (q/k/v carry the adapter's
    delta), so blocks are shared only between requests of one adapter load. An adapter's
    requests get ``"\\0l<id>\\x1f<salt>"``; a base request keeps its salt, escaped as
    ``"\\0b<salt>"`` only when it starts with NUL itself, so no client salt spells an
    adapter's key.
    """
    if lora is not None:
        return f"\0l{lora.id}\x1f{cache_salt or ''}"
    if cache_salt is not None and cache_salt.startswith("\0"):
        return f"\0b{cache_salt}"
    return cache_salt


def _check_vocab(ids: Sequence[int], vocab_size: int, param: str, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParamError(f"{what} {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def _unicode(text: str, param: str) -> str:
    """``text`` if it is valid Unicode. A lone surrogate (JSON's ``"\\ud800"`` decodes to
    one) makes the tokenizer raise TypeError: it is this request's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParamError(
            f"{param} is not valid Unicode: {exc.reason} at character {exc.start}", param=param
        ) from None
    return text


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index`` of a request: n = 1 and, when seeded, its own seed (seed + index,
    wrapped into the signed 64-bit range so the largest seeds stay valid)."""
    if params.n == 1:
        return params
    seed = None
    if params.seed is not None:
        seed = (params.seed + index + 2**63) % 2**64 - 2**63
    return params.replace(n=1, seed=seed)
