"""Every message exchanged between actors: frozen, slotted dataclasses, one per event.

Closing a channel means end of stream; no message stands for "nothing". Every message is
made of primitives, tuples and other messages so it can be packed with msgpack (see
:func:`pack` / :func:`unpack`) and an actor can later move to another process.

This module is one room on purpose (the design brief: "defined in one module"): the wire
codec finds a message's type by its name among the dataclasses of this module (plus the
params it carries), so every type that crosses a channel, a socket or a worker pipe is
declared here, where a new one cannot be left out of the codec.
"""

from __future__ import annotations

import dataclasses

from engine.params import SamplingParams
from engine.structured.spec import StructuredOutputs

# --- scheduler -> executor -> model runner ------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt, preprocessed by the model's image processor at admission.

    Its ``length`` placeholder tokens start at prompt position ``offset``; the runner
    replaces their embeddings with the vision encoder's output for ``pixels`` (float32
    bytes, C order, of ``shape``, e.g. ``(3, 336, 336)``). ``key`` is a 63-bit content
    hash of the preprocessed pixels: it names the encoder's cached output and stands for
    the placeholder tokens in the prefix cache's block keys (see ``Request.cache_token_ids``).

    An audio clip travels as one too (engine.audio): ``pixels`` are its log-mel frames
    ``(mel, frames)`` and ``grid`` ``(frames,)`` its own frame count; Whisper's clip has
    no placeholders (``length`` 0), as the decoder's cross-attention reads it.
    """

    offset: int
    length: int
    key: int
    pixels: bytes
    shape: tuple[int, ...]
    # Qwen-VL: the image's (t, h, w) patch grid (``pixels`` are its patches, ``shape``
    # ``(t * h * w, C * T * P * P)``, or ``C * P * P`` for a still image whose temporal
    # frames are one frame repeated); empty for a fixed-size tower (LLaVA).
    grid: tuple[int, ...] = ()
    # vLLM's prompt_embeds: ``pixels`` are the prompt's input embeddings themselves
    # (float32, ``shape`` ``(length, hidden)``), taken in place of its placeholder tokens'
    # embeddings with no encoder run.
    embeds: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class LoraAdapter:
    """The LoRA adapter a request runs with (vLLM's ``LoRARequest``): its served name, the
    folder the runner reads it from (peft's adapter_config.json and
    adapter_model.safetensors), and an id unique to this load of it, which keys the
    runner's copies and the prefix cache (a name loaded again from another folder gets a
    new id, so no block computed under the old weights is reused)."""

    name: str
    path: str
    id: int


@dataclasses.dataclass(frozen=True, slots=True)
class NewRequest:
    """A request the model runner has not seen: it keeps its tokens and sampling state."""

    sample_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]  # for min_tokens: EOS is masked until min_tokens is reached
    images: tuple[ImageInput, ...] = ()  # in prompt order, not overlapping
    lora: LoraAdapter | None = None  # None: the base model
    # A pooling request whose output is every prompt token's hidden state (vLLM's
    # token_embed), not the model's one pooled vector (see SchedulerRequest.pool_tokens).
    pool_tokens: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute ``num_tokens`` tokens of one request, starting at position ``start``.

    The runner reads the tokens from its own copy of the request (prompt plus the outputs
    it sampled), so a chunk can be planned before the previous step's token is known
    (async scheduling). ``block_ids`` is the request's whole block table. ``sample`` is true
    when the chunk reaches the end of the known tokens and a new token must be drawn.
    """

    sample_id: str
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    sample: bool
    # Speculative decoding: tokens proposed after the request's known ones. The chunk's
    # last ``len(draft_token_ids)`` positions compute them; the runner samples every one of
    # the last ``1 + len`` positions and keeps the proposal while the draws agree with it
    # (StepResult then holds 1 + accepted SampledTokens for the request, in order).
    draft_token_ids: tuple[int, ...] = ()
    # Speculative decoding with a draft model (``draft_model``): the runner's draft model
    # proposes this many tokens after the known ones, in the step itself (the chunk's last
    # ``num_model_drafts`` positions compute them); the result is as for a proposal given in
    # ``draft_token_ids``, which is then empty.
    num_model_drafts: int = 0
    # A hybrid model's prefix cache (engine.core.block_pool, "state checkpoints"): the
    # chunk starts from checkpoint ``state_load``'s recurrent states (-1: from the
    # request's own, or from zero at position 0), and for each ``(offset, checkpoint)`` of
    # ``state_save`` (offsets ascending) copies them, after its first ``offset`` tokens,
    # into that checkpoint.
    state_load: int = -1
    state_save: tuple[tuple[int, int], ...] = ()

    @property
    def num_proposed(self) -> int:
        """Positions past the known tokens this chunk verifies (0: no speculation)."""
        return len(self.draft_token_ids) or self.num_model_drafts


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step: what the runner must learn, compute and forget."""

    step_id: int
    new_requests: tuple[NewRequest, ...]
    chunks: tuple[ScheduledChunk, ...]
    finished_ids: tuple[str, ...]  # runner state to drop before running the chunks
    # Beam search's copy-on-write: (source, destination) block pairs the runner copies in
    # every layer's KV cache after learning new_requests and before running the chunks
    # (a forked beam's own copy of its parent's partly filled last block).
    block_copies: tuple[tuple[int, int], ...] = ()
    # Requests preempted since the last plan (recomputed from position 0 when planned
    # again): the runner drops what it keeps of their computed positions beyond the KV
    # blocks (a hybrid model's recurrent-state slot); their tokens stay.
    preempted_ids: tuple[str, ...] = ()
    # The KV store (--kv-transfer-config, engine.runner.kv_store): (block id, payload)
    # blocks read from the shared folder, copied into the pool before the chunks run; and
    # (sample id, block id, digest) prompt blocks this step completes, written to the
    # folder after it (not for a sample the step fails).
    kv_loads: tuple[tuple[int, bytearray], ...] = ()
    kv_saves: tuple[tuple[str, int, bytes], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class SampledToken:
    """The token drawn for one request in one step, with its logprobs when asked."""

    sample_id: str
    token_id: int
    logprob: float
    # (token_id, logprob) of the top-N tokens when the request asked for logprobs=N.
    top_logprobs: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens ``start .. start + len(logprobs) - 1`` of one request,
    scored by the logits of the positions before them (this step's chunk computed those).
    Prompt token 0 has none: nothing comes before it."""

    sample_id: str
    start: int
    logprobs: tuple[TokenLogprob, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFailure:
    """One request failed in a step: its logits could not be sampled (NaN, +inf, every
    token masked) or the step raised. ``reason`` is the engine's own words, fit for a
    client (never an internal exception's text)."""

    sample_id: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class PooledOutput:
    """A pooling model's output for one request whose prompt this step finished: its
    embedding (or a classifier's logits) as little-endian float32 bytes (compact to pack,
    and what base64 ``encoding_format`` sends as is); for a ``pool_tokens`` request, its
    prompt tokens' hidden states, one row after another."""

    sample_id: str
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    sampled: tuple[SampledToken, ...]
    forward_seconds: float  # model forward + sampling, for the per-step overhead figure
    # For requests that asked for prompt_logprobs, what this step's chunks scored.
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    # Requests of this step that failed: they drew no token and their chunk's KV writes
    # must not be cached; the runner has dropped their state.
    failed: tuple[RequestFailure, ...] = ()
    # Pooling models: the outputs of requests whose last prompt chunk ran in this step.
    pooled: tuple[PooledOutput, ...] = ()


# --- what a caller submits (no actor: engine/core/admission.py checks it in its task) ----


@dataclasses.dataclass(frozen=True, slots=True)
class TextPrompt:
    """A prompt string, tokenized with the tokenizer's special tokens (BOS)."""

    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class TokensPrompt:
    """A prompt given as token ids; each id is checked against the vocabulary."""

    token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages: the chat template applies, then tokenization adds no special tokens.

    ``messages_json`` is the caller's message list as JSON text: messages carry open-ended
    fields (content parts, ``tool_calls``, ``name``) that the template may read, and JSON
    keeps them exact and packable without a type per field.
    """

    messages_json: str
    # The chat template's options as JSON keyword arguments of
    # engine.chat.template.apply_chat_template (tools, chat_template, chat_template_kwargs,
    # add_generation_prompt, continue_final_message); "{}" renders with the defaults.
    options_json: str = "{}"


@dataclasses.dataclass(frozen=True, slots=True)
class SubmitRequest:
    """What a caller asks for, checked for types; :func:`engine.core.admission.admit`
    turns it into an :class:`AdmittedRequest` or raises the request's error."""

    request_id: str
    prompt: TextPrompt | TokensPrompt | ChatPrompt
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    lora: LoraAdapter | None = None  # None: the base model


# --- caller -> scheduler (-> detokenizer) ------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DetokenizerRequest:
    """The detokenizer's view of one sample; its outputs go out under ``request_id`` and
    ``index`` (the sample's place among the request's ``n``)."""

    sample_id: str
    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # False: the prompt's ids are placeholders (prompt_embeds), not text the output
    # continues; the first output token is decoded without them, as vLLM decodes it.
    prompt_is_text: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerRequest:
    """One sample for the scheduler. ``wait_for`` names the sample whose prompt blocks this
    one waits for, so that it reuses them through the prefix cache (``n > 1``)."""

    sample_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int  # resolved: params.max_tokens, or what is left of the context
    priority: int
    arrival_time: float
    cache_salt: str | None
    wait_for: str | None
    # Predicted Outputs: the prediction's token ids, the request's speculative proposals.
    prediction_token_ids: tuple[int, ...] = ()
    images: tuple[ImageInput, ...] = ()  # in prompt order (ImageInput)
    # Beam search (params.beam_width > 0): this one scheduler request is the whole beam
    # group, and these are the sample ids its best hypotheses are returned on, best first.
    beam_output_ids: tuple[str, ...] = ()
    lora: LoraAdapter | None = None  # None: the base model
    # Pooling models: the output is the hidden state of every prompt token, in order
    # (rows of the model's width), rather than the model's pooled vector.
    pool_tokens: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class AdmittedRequest:
    """A request past admission, sent by the caller's task to the scheduler. The scheduler
    passes ``outputs`` on to the detokenizer before it adds ``samples``, so the detokenizer
    knows every sample before its first token: the order holds by construction."""

    request_id: str
    samples: tuple[SchedulerRequest, ...]
    outputs: tuple[DetokenizerRequest, ...]

    @property
    def sample_ids(self) -> tuple[str, ...]:
        """The ids callers receive outputs on (and abort by): one per output. They are the
        samples' ids, except for a beam search, whose one sample (the group, under the
        first output's id) returns several outputs."""
        return tuple(o.sample_id for o in self.outputs)


# --- callers / detokenizer -> scheduler (control) -----------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class AbortSamples:
    """The callers no longer want these samples: finish them as ``abort`` and free blocks."""

    sample_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class StopStringHit:
    """The detokenizer saw a stop string: the scheduler finishes the sample as ``stop``."""

    sample_id: str
    stop: str


# --- scheduler -> detokenizer -------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one sample in one step, and how it finished if it did."""

    sample_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[SampledToken, ...]  # one per token when the sample asked for logprobs
    finish_reason: str | None  # "stop", "length", "error" or None while running ("abort"
    # inside the detokenizer only, for a SamplesAborted)
    stop_reason: str | int | None  # the stop token id that ended it; "error": the reason
    num_cached_tokens: int = 0  # prompt tokens its first table took from the prefix cache
    pooled: bytes | None = None  # a pooling request's output (float32 bytes), on its last delta
    # A Predicted Outputs request's (accepted, rejected) prediction tokens, on its last delta.
    prediction_tokens: tuple[int, int] | None = None
    # A beam search hypothesis (its one, finished delta): the sum of its tokens' logprobs
    # and its score, that sum over (generated length ** length_penalty).
    cumulative_logprob: float | None = None
    beam_score: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutputs:
    step_id: int
    deltas: tuple[TokenDelta, ...]
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # passed on from the StepResult
    # (sample id, time.monotonic()) of samples whose first delta this is: when the
    # scheduler first gave them a step (queue, prefill and inference time metrics).
    scheduled: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class SamplesAborted:
    """The scheduler finished these live samples as ``abort``: each one's stream ends with
    an ``"abort"`` output."""

    sample_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Caller -> scheduler (each engine core's): drop every cached prefix block, between
    two steps (vLLM's ``reset_prefix_cache``). ``token`` names the call its answer,
    :class:`PrefixCacheReset`, goes back to (through the detokenizer and the router).
    ``reset_running`` (vLLM's ``reset_running_requests``): first preempt every running
    request (its blocks freed; it recomputes when it is scheduled again)."""

    token: str
    reset_running: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixCacheReset:
    """A scheduler's answer to :class:`ResetPrefixCache`: ``done`` false when a request
    held KV blocks, which vLLM's reset refuses too (the cache is then left as it was)."""

    token: str
    done: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ControlProfiler:
    """Caller -> scheduler (each engine core's): start (``start`` true) or stop the
    ``--profiler-config`` profiler, on the model thread between two steps (vLLM's
    ``start_profile`` / ``stop_profile``). Answered with :class:`ProfilerControlled`
    under ``token``, as :class:`ResetPrefixCache` is."""

    token: str
    start: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ControlPause:
    """Caller -> scheduler (each engine core's): pause or resume generation, put the model
    to sleep or wake it (vLLM's ``pause_generation`` / ``resume_generation`` / ``sleep`` /
    ``wake_up``). Answered with :class:`PauseControlled` under ``token`` once done.

    ``action``:

    * ``"pause"``: no step runs until a resume. ``mode`` says what becomes of the requests
      already in the engine: ``"abort"`` ends them (``finish_reason`` abort), ``"wait"``
      lets them finish first (new ones wait), ``"keep"`` freezes them where they are.
      ``clear_cache`` then drops the prefix cache (not with ``"keep"``). ``level`` 1 or 2
      also puts the model to sleep (the KV cache's memory given back; 2: the weights too),
      after the kept requests are preempted; -1 pauses only (0 is a sleep that releases
      nothing, as vLLM's level 0).
    * ``"resume"``: steps run again (the model must be awake).
    * ``"wake"``: the sleeping ``tags`` ("weights", "kv_cache"; empty: all) are restored;
      once nothing sleeps, generation resumes as after a resume.
    * ``"reload"``: the model is built again from its checkpoint read anew, between steps:
      the running requests are preempted (they recompute with the new weights) and the
      prefix cache dropped; then generation goes on as it was (paused or not).
    """

    token: str
    action: str
    mode: str = "abort"
    clear_cache: bool = True
    level: int = -1
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class PauseControlled:
    """A scheduler's answer to :class:`ControlPause`: where the core stands afterwards
    (``paused``; ``sleep_level``, -1 awake; the ``sleeping`` tags), whether its prefix
    cache was dropped, or ``error`` (nothing changed)."""

    token: str
    paused: bool
    sleep_level: int = -1
    sleeping: tuple[str, ...] = ()
    cache_cleared: bool = False
    error: str | None = None
    conflict: bool = False  # the error: another pause under way, or this one overtaken


@dataclasses.dataclass(frozen=True, slots=True)
class ProfilerControlled:
    """A scheduler's answer to :class:`ControlProfiler`: the trace files a stop wrote,
    or ``error`` (the core runs no profiler, or it failed)."""

    token: str
    traces: tuple[str, ...] = ()
    error: str | None = None


# Caller -> every serving engine core's scheduler, and their answers (each under the
# call's token, through the detokenizer and the router to the caller).
CORE_CONTROLS = (ResetPrefixCache, ControlProfiler, ControlPause)
CORE_ANSWERS = (PrefixCacheReset, ProfilerControlled, PauseControlled)


# --- detokenizer -> router -> caller ------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob) of the top-N tokens
    # The token's place in the vocabulary by logprob (1: the most likely), for prompt
    # tokens (vLLM's prompt_logprobs report it); None where not computed.
    rank: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Predicted Outputs: (accepted, rejected) prediction tokens; None without a prediction.
    prediction_tokens: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """What a caller receives: the new text and ids of one sample since its last output.

    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"abort"`` on the last output of a
    sample (``finished`` true) and ``None`` before; ``stop_reason`` is the stop string or stop
    token that ended it. (``"error"``, with the reason in ``stop_reason``, travels from the
    detokenizer to the router only: a caller gets :class:`engine.errors.RequestFailedError`.) ``usage`` is set on finished outputs only. With
    ``prompt_logprobs`` asked for, a sample's first output carries one entry per prompt
    token, ``None`` for the first (nothing scores it), as vLLM's ``prompt_logprobs``.
    """

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: tuple[TokenLogprob, ...] | None
    usage: Usage | None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # On a sample's first output: when (time.monotonic()) the scheduler first gave it a
    # step, so a front end can tell queueing from prefill.
    scheduled_time: float | None = None
    # A pooling request's output: little-endian float32 bytes (the embedding, or a
    # classifier's logits), on its one, finished output.
    pooled: bytes | None = None
    # A beam search hypothesis's cumulative logprob and length-penalised score.
    cumulative_logprob: float | None = None
    beam_score: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class OutputBatch:
    """All outputs of one step, so the router wakes once per step rather than per request.

    ``sample_ids[i]`` is the sample ``outputs[i]`` belongs to: the router delivers by it,
    since a sample id is unique in the engine while a caller's request id need not be."""

    outputs: tuple[RequestOutput, ...]
    sample_ids: tuple[str, ...]


# --- msgpack ------------------------------------------------------------------------------

# The key that marks a packed message (engine.params refuses it inside extra_args, the one
# client-shaped object that travels as a msgpack map).
_TAG = "__msg__"


_TYPES: dict[str, type] = {}


def _message_types() -> dict[str, type]:
    # Built on first use, once this module (and every message type in it) is defined; a
    # frame decoder calls this for every message it builds.
    if not _TYPES:
        _TYPES.update({
            name: obj
            for name, obj in globals().items()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == __name__
        })
        _TYPES["SamplingParams"] = SamplingParams
        _TYPES["StructuredOutputs"] = StructuredOutputs
        _TYPE_SET.update(_TYPES.values())
    return _TYPES


_TYPE_SET: set[type] = set()


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _to_builtin(obj: object) -> object:
    cls = type(obj)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
            raise TypeError(f"cannot pack {cls.__name__}")
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(obj))
    packed: dict[str, object] = {_TAG: cls.__name__}
    for name in names:
        packed[name] = getattr(obj, name)
    return packed


def from_builtin(raw: dict[str, object]) -> object:
    name = raw.pop(_TAG, None)
    if name is None:
        return raw
    cls = (_TYPES or _message_types()).get(str(name))
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    return cls(**raw)


def is_message(obj: object) -> bool:
    """Whether ``obj`` is an instance of a registered message type."""
    if not _TYPE_SET:
        _message_types()
    return type(obj) in _TYPE_SET


def pack(message: object) -> bytes:
    """Serialize a message (and the messages and params nested in it) with msgpack."""
    import msgpack

    return msgpack.packb(message, default=_to_builtin, use_bin_type=True)


def unpack(data: bytes) -> object:
    """Inverse of :func:`pack`; sequences come back as tuples, like the dataclasses hold them."""
    import msgpack

    return msgpack.unpackb(data, object_hook=from_builtin, use_list=False, raw=False)


# --- scheduler <-> KV allocator -----------------------------------------------------------
#
# The KV-allocator actor owns an ``engine.core.BlockPool`` and answers every call below with
# exactly one reply (``reply = pool.handle(call)``). Only the scheduler sends calls, one at a
# time, so the pool sees them in the scheduler's order. Positions are token counts from the
# start of a request; a block table grows only at its end.


@dataclasses.dataclass(frozen=True, slots=True)
class AllocateSlots:
    """Grow ``sample_id``'s block table so it holds the tokens of this step's chunk.

    The chunk starts at ``num_computed_tokens`` and ends at
    ``min(num_known_tokens, start + token_budget)``. When ``prefix_token_ids`` is given (the
    request holds no blocks yet and ``num_computed_tokens`` is 0), the longest verified cached
    prefix of those tokens is shared first and the chunk starts after it; the prefix never
    covers the last known token, whose logits must be computed. Answered with
    :class:`SlotsAllocated`, or :class:`AllocationRefused` with nothing changed.
    """

    sample_id: str
    num_computed_tokens: int
    num_known_tokens: int
    token_budget: int
    prefix_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    # The chunk computes the request's outputs (its prompt is computed): a state checkpoint
    # it keeps replaces the one the request's last such chunk kept (a hybrid model's).
    past_prompt: bool = False
    # (first block, count): blocks of the prefix the request read from the KV store (a
    # first table only). Those the prefix cache does not hold are allocated after its hit
    # when they follow on from it, and count as cached; see SlotsAllocated.
    external: tuple[int, int] = (0, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class SlotsAllocated:
    """``block_ids`` are appended to the request's table (shared prefix blocks first);
    the chunk is ``num_new_tokens`` tokens after ``num_cached_tokens`` cached ones.
    ``state_load`` and ``state_save`` are the chunk's recurrent-state checkpoints (a hybrid
    model's, see :class:`ScheduledChunk`)."""

    sample_id: str
    num_cached_tokens: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    state_load: int = -1
    state_save: tuple[tuple[int, int], ...] = ()
    # Of num_cached_tokens, those in blocks taken from the request's external ones (the
    # last of block_ids' cached blocks): the runner copies them in before the chunk runs.
    num_external_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class AllocationRefused:
    """Too few free blocks: ``num_blocks_needed`` new blocks, ``num_free_blocks`` free."""

    sample_id: str
    num_blocks_needed: int
    num_free_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class LookupPrefix:
    """How many leading full blocks of ``token_ids`` the prefix cache holds (verified, as a
    hit would be), changing nothing: the KV store reads only the blocks after them.
    Answered with :class:`PrefixLookedUp`."""

    token_ids: tuple[int, ...]
    cache_salt: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixLookedUp:
    num_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class CacheBlocks:
    """The request's next full blocks are computed: ``token_ids`` are their tokens (a
    multiple of the block size), following the blocks already cached for it. The pool
    hashes them into the prefix cache. Answered with :class:`BlocksCached`."""

    sample_id: str
    token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class BlocksCached:
    sample_id: str
    num_cached_blocks: int  # blocks of the request's table now hashed, from its start


@dataclasses.dataclass(frozen=True, slots=True)
class FreeRequest:
    """Drop the request's block table (finish, abort or preemption). Cached blocks stay
    reusable until evicted. Freeing an unknown request is a no-op (aborts race finishes)."""

    sample_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFreed:
    sample_id: str
    num_blocks: int  # length of the table that was dropped


@dataclasses.dataclass(frozen=True, slots=True)
class ReleaseBlocks:
    """No layer reads the request's first ``num_blocks`` blocks any more (every layer of
    the model slides a window past them): the pool drops the request's reference to each
    one not released yet; the table keeps their places (the scheduler sends the runner
    :data:`NULL_BLOCK` there). A block not yet in the prefix cache ends the request's
    caching: its later blocks could no longer chain to it. Answered with
    :class:`BlocksReleased`."""

    sample_id: str
    num_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class BlocksReleased:
    sample_id: str
    num_released_blocks: int  # leading blocks of the table released so far


# The block id standing in a table for a released block. Attention never reads a released
# position (it is outside every layer's window), so any valid id does.
NULL_BLOCK = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ForkBlocks:
    """Beam search: start table ``dst_id`` from the first ``num_blocks`` blocks of table
    ``src_id``, sharing them (reference counts). With ``copy_last`` the last of them is
    not shared but replaced by a fresh block, whose contents the runner copies from the
    source's (copy-on-write of a partly filled block another child writes into).
    Answered with :class:`BlocksForked`, or :class:`AllocationRefused` with nothing
    changed when no block is free for the copy."""

    src_id: str
    dst_id: str
    num_blocks: int
    copy_last: bool


@dataclasses.dataclass(frozen=True, slots=True)
class BlocksForked:
    dst_id: str
    block_ids: tuple[int, ...]  # the new table
    copies: tuple[tuple[int, int], ...]  # (source, destination) block to copy; at most one


@dataclasses.dataclass(frozen=True, slots=True)
class ClearPrefixCache:
    """Drop every cached block's tokens, if no request holds a block."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixCacheCleared:
    done: bool  # false: a request held blocks, and nothing was dropped


@dataclasses.dataclass(frozen=True, slots=True)
class ReadAllocatorStats:
    """Ask for an :class:`AllocatorStats` snapshot."""


@dataclasses.dataclass(frozen=True, slots=True)
class AllocatorStats:
    """``num_free_blocks`` counts blocks no request holds, cached ones included;
    the prefix-cache counters are cumulative and in tokens."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int


AllocatorCall = (
    AllocateSlots | CacheBlocks | ReleaseBlocks | FreeRequest | ForkBlocks | ClearPrefixCache
    | ReadAllocatorStats | LookupPrefix)
AllocatorReply = (
    SlotsAllocated | AllocationRefused | BlocksCached | BlocksReleased | RequestFreed | BlocksForked
    | PrefixCacheCleared | AllocatorStats | PrefixLookedUp
)


# --- scheduler <-> KV store (engine.actors.kv_store) ----------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FetchBlocks:
    """Read the blocks named by ``digests`` (blocks ``start`` on of ``sample_id``'s prompt)
    from the shared folder, up to the first missing one. Answered with
    :class:`BlocksFetched`, in the scheduler's inbox."""

    sample_id: str
    start: int
    digests: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class BlocksFetched:
    """The payloads of blocks ``start`` .. ``start + len(payloads) - 1`` of the sample's
    prompt (none: not one was found), and the digests asked for (an answer meant for an
    earlier request of the same sample id is told apart by them)."""

    sample_id: str
    start: int
    payloads: tuple[bytearray, ...]
    digests: tuple[bytes, ...] = ()


# --- front end <-> engine core (engine.process.wire) ------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class CoreHello:
    """An engine core's announcement after authentication: what it serves and its limits.
    The front end refuses a core whose model, limits or version differ from what it serves
    (engine.process.wire.hello_mismatch)."""

    version: str
    core_index: int
    pid: int
    model: str  # the model path the core loaded (a folder or .gguf)
    served_model_name: str
    tokenizer_folder: str  # where the tokenizer's files lie on the core's machine
    max_model_len: int
    vocab_size: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    dtype: str
    quantization: str
    config_json: str  # the core's resolved EngineConfig as JSON
    pooler_json: str = ""  # a pooling model's PoolerConfig as JSON ("" for a generator)
    # The core's tensor-parallel / pipeline worker processes (rank order; none with one
    # rank): for the front end's log, and for whoever must find a core's workers.
    worker_pids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class CoreAccepted:
    """The front end took the core: frames of requests follow."""


@dataclasses.dataclass(frozen=True, slots=True)
class CoreFailed:
    """A core's last frame before it exits after a crash (a tensor-parallel or pipeline
    worker lost, say): why, so that the front end fails the requests the core was serving
    with the cause rather than only "the core died"."""

    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class CoreStatistics:
    """A core's counters after a step (sent in the step's frame). ``samples_received``
    counts the samples it took from frames, so the front end can add those still on the
    wire to ``waiting`` for admission control."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    preemptions: int
    steps: int
    requests_finished: int
    iteration_token_counts: tuple[int, ...]
    iteration_tokens_sum: int
    scheduled_tokens: int
    planned_ahead: int
    samples_received: int
    # Speculative decoding (see SchedulerActorStatistics).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA adapters (names, sorted) of the running and of the waiting requests (vLLM's
    # lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    # The KV store (--kv-transfer-config), cumulative and in tokens (vLLM's
    # external_prefix_cache_queries / _hits): prompts looked up there, and tokens read.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


# --- rank 0 <-> tensor-parallel workers (engine.process.workers) -------------------------
#
# One msgpack frame (a tuple of messages, as engine.process.wire) per message, over an
# authenticated multiprocessing connection. Rank 0 sends, every worker answers each with
# one reply: RankBuilt to RankBuild, RankDone to RankStep, RankWarmUp and RankReset (a last
# pipeline stage's tensor-parallel rank 0 answers a RankStep with a StageResult).


@dataclasses.dataclass(frozen=True, slots=True)
class RankBuild:
    """Build the rank's runner: the engine's resolved config (JSON, with max_model_len) and
    the KV blocks rank 0 sized its pool to (every rank holds as many, of its own heads)."""

    config_json: str
    num_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class RankBuilt:
    rank: int
    pid: int


@dataclasses.dataclass(frozen=True, slots=True)
class RankGrammar:
    """A structured-output grammar rank 0 compiled, for a worker to read back instead of
    compiling it (engine.process.grammars): as ``GrammarBackend.adopt`` takes it."""

    spec: StructuredOutputs
    backend: str  # "xgrammar" (data: its serialized JSON) or "guidance" (the grammar text)
    data: str
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class RankStep:
    """The step rank 0 is about to run: every rank runs the same plan, with the grammars
    of its new requests that the workers do not hold yet."""

    plan: StepPlan
    grammars: tuple[RankGrammar, ...] = ()
    # Pipeline parallelism: the results of earlier steps that rank 0 has received from the
    # last stage since its previous RankStep; a stage before the last takes their tokens
    # (ModelRunner.accept) before it runs ``plan``.
    results: tuple[StepResult, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class RankWarmUp:
    """Run the runner's warm-up steps (rank 0 runs the same ones)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankReset:
    """Forget every request (the engine restarted its actors)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankSleep:
    """Sleep mode on every rank (:meth:`ModelRunner.sleep` / :meth:`ModelRunner.wake_up`):
    ``level`` 1 or 2 puts the rank's model to sleep; -1 wakes ``tags`` (empty: all); with
    ``reload`` each rank reads its slice of the checkpoint again
    (:meth:`ModelRunner.reload_weights`)."""

    level: int = -1
    tags: tuple[str, ...] = ()
    reload: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class RankDone:
    """A worker's answer to a step: what it sampled and failed, which rank 0 checks against
    its own result (every rank samples the same gathered logits with the same seeds)."""

    step_id: int
    sampled: tuple[tuple[str, int], ...]  # (sample_id, token_id), in the result's order
    failed: tuple[str, ...]
    # The step as the worker ran it, for the pipeline's step trace (bench/pp.py): wall-clock
    # start and end of its execute, and the seconds of that spent in recv and in send.
    trace: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class StageResult:
    """The last pipeline stage's answer to a step (its tensor-parallel rank 0's): the
    whole result, which rank 0 hands to the scheduler."""

    result: StepResult
    trace: tuple[float, ...] = ()  # as RankDone's


@dataclasses.dataclass(frozen=True, slots=True)
class RankError:
    """A worker could not do what it was asked (it exits after sending this)."""

    rank: int
    message: str
