"""Speech to text with Whisper: what ``/v1/audio/transcriptions`` and
``/v1/audio/translations`` run, over the embedded engine.

A clip is decoded (engine.audio: soundfile, channels averaged, soxr to the extractor's
rate) and cut into pieces of at most the model's window (30 s), each cut at the quietest
tenth of a second of the last second before the window's end, so that a cut falls between
words where the clip allows. Each piece is one engine request (all submitted at once, so
they run batched): the decoder prompt is Whisper's task tokens,
``[<|startofprev|> prompt] <|startoftranscript|> <|lang|> <|transcribe|> <|notimestamps|>``,
and the piece rides beside it as the clip its cross-attention reads. The text is the
pieces' texts in order, joined with a space where neither side has one.

The language is the request's (an ISO 639-1 code whose ``<|xx|>`` token the tokenizer
has), or, where none is given, the one Whisper detects in the clip's first window (its
most likely language token after ``<|startoftranscript|>``, as transformers' ``generate``
detects it); an English-only model (``.en``, ``is_multilingual`` false) takes neither
language nor task tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import uuid
import zlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import trio

from engine.api.engine import Engine
from engine.api.streams import RequestStream
from engine.audio import decode_audio
from engine.errors import InvalidParamError
from engine.multimodal import AudioClip
from engine.params import WHISPER_SUPPRESS, WHISPER_TIMESTAMPS, SamplingParams

# The longest clip a request may send (cut into windows): ten minutes.
MAX_CLIP_SECONDS = 600.0
TASKS = ("transcribe", "translate")


@dataclasses.dataclass
class Transcription:
    """The pieces of one clip running as engine requests, in order, and its length; with
    timestamps asked, each piece's start and length (seconds) and the first timestamp
    token's id."""

    streams: list[RequestStream]
    seconds: float
    language: str | None = None
    starts: list[float] = dataclasses.field(default_factory=list)
    lengths: list[float] = dataclasses.field(default_factory=list)
    first_timestamp: int | None = None
    temperature: float = 0.0
    # verbose_json: each piece's probe of Whisper's no-speech token (no_speech_probs).
    probes: list[RequestStream] = dataclasses.field(default_factory=list)

    async def segments(self, tokenizer: Any) -> tuple[str, list[dict[str, Any]]]:
        """The text and OpenAI's ``verbose_json`` segments (read to the end; timestamps
        asked): each piece split as Whisper splits a window's tokens (:func:`split_segments`),
        its times moved by the piece's start."""
        assert self.first_timestamp is not None
        texts, segments = [], []
        no_speech = await self.no_speech_probs()
        for stream, start, length, quiet in zip(self.streams, self.starts, self.lengths, no_speech, strict=True):
            tokens, logprobs, text = [], [], []
            async with stream:
                async for out in stream:
                    tokens += out.token_ids
                    logprobs += [lp.logprob for lp in out.logprobs or ()]
                    text.append(out.text)
            texts.append("".join(text))
            if tokens and tokens[-1] < self.first_timestamp and tokens[-1] in tokenizer.skipped_special_ids:
                tokens, logprobs = tokens[:-1], logprobs[:-1]  # the end of text
            for a, b, span, chosen in split_segments(tokens, self.first_timestamp, length):
                words = tokenizer.decode([t for t in span if t < self.first_timestamp])
                raw = words.encode()
                segments.append({
                    "id": len(segments), "seek": round(start * 100), "start": round(start + a, 3),
                    "end": round(start + b, 3), "text": words, "tokens": span,
                    "temperature": self.temperature,
                    "avg_logprob": float(np.mean([logprobs[i] for i in chosen])) if chosen and logprobs else None,
                    "compression_ratio": len(raw) / len(zlib.compress(raw)) if raw else 0.0,
                    "no_speech_prob": quiet})
        joined = texts[0] if texts else ""
        for t in texts[1:]:
            joined += t if not t or t[0].isspace() or not joined else " " + t
        return joined, segments

    async def no_speech_probs(self) -> list[float | None]:
        """Each piece's probability of Whisper's no-speech token right after
        ``<|startoftranscript|>`` (the raw logprob of the probe's second prompt token), as
        OpenAI's decoder and transformers' ``WhisperNoSpeechDetection`` read it; None
        for every piece without probes."""
        if not self.probes:
            return [None] * len(self.streams)
        out: list[float | None] = []
        for probe in self.probes:
            async with probe:
                outs = [o async for o in probe]
            entry = outs[0].prompt_logprobs[1] if outs and outs[0].prompt_logprobs else None
            out.append(math.exp(entry.logprob) if entry is not None else None)
        return out

    async def deltas(self) -> AsyncIterator[str]:
        """The text as it is decoded: each piece's, one after the other (the later pieces
        run meanwhile)."""
        for i, stream in enumerate(self.streams):
            first = True
            async with stream:
                async for out in stream:
                    text = out.text
                    if first and i and text and not text[0].isspace():
                        text = " " + text  # the pieces joined with a space
                    first = first and not text
                    if text:
                        yield text

    async def text(self) -> str:
        return "".join([d async for d in self.deltas()])

    async def aclose(self) -> None:
        for stream in (*self.streams, *self.probes):
            await stream.aclose()


def transcribes(engine: Engine) -> bool:
    """Whether ``engine`` serves a speech-to-text model (Whisper)."""
    return bool(getattr(engine._parts.images, "cross_attention", False))


def language_ids(tokenizer: Any) -> dict[str, int]:
    """The model's language tokens by code: Whisper's vocabulary holds them between
    ``<|startoftranscript|>`` and ``<|translate|>`` (``<|en|>``, ``<|zh|>``, ...)."""
    first, last = tokenizer.token_to_id("<|startoftranscript|>"), tokenizer.token_to_id("<|translate|>")
    if first is None or last is None:
        return {}
    tokens = tokenizer.convert_ids_to_tokens(range(first + 1, last))
    return {t[2:-2]: first + 1 + i for i, t in enumerate(tokens)
            if t and t.startswith("<|") and t.endswith("|>")}


@functools.lru_cache(maxsize=8)
def multilingual(folder: str) -> bool:
    """generation_config.json's ``is_multilingual`` (an English-only ``.en`` model's is
    false: its prompt has no language or task token); true where it does not say."""
    path = Path(folder) / "generation_config.json"
    try:
        return bool(json.loads(path.read_text()).get("is_multilingual", True))
    except (OSError, ValueError):
        return True


def whisper_prompt(tokenizer: Any, *, language: str | None, task: str,
                   prompt: str | None, is_multilingual: bool = True) -> tuple[int, ...]:
    """The decoder's prompt: the previous text (``prompt``) then the task tokens
    (``<|startoftranscript|> <|xx|> <|task|> <|notimestamps|>``; an English-only model's
    ``<|startoftranscript|> <|notimestamps|>``). ``language`` None: English."""
    if task not in TASKS:
        raise InvalidParamError(f"task must be one of {', '.join(TASKS)}", param="task")
    if not is_multilingual:
        if language not in (None, "en"):
            raise InvalidParamError(f"this model transcribes English only, not {language!r}",
                                    param="language")
        if task == "translate":
            raise InvalidParamError("this English-only model does not translate", param="model")
        names: tuple[str, ...] = ("<|startoftranscript|>", "<|notimestamps|>")
    else:
        names = ("<|startoftranscript|>", f"<|{language or 'en'}|>", f"<|{task}|>", "<|notimestamps|>")
    ids = [tokenizer.token_to_id(t) for t in names]
    if is_multilingual and ids[1] is None:
        raise InvalidParamError(f"language {language!r} is not one of the model's (an ISO "
                                "639-1 code such as 'en', 'fr')", param="language")
    if None in ids:
        raise InvalidParamError("the model's tokenizer lacks Whisper's task tokens", param="model")
    if prompt:
        prev = tokenizer.token_to_id("<|startofprev|>")
        if prev is None:
            raise InvalidParamError("the model's tokenizer has no <|startofprev|> token",
                                    param="prompt")
        ids = [prev, *tokenizer.encode(" " + prompt.strip(), add_special_tokens=False), *ids]
    return tuple(ids)


async def detect_language(engine: Engine, samples: np.ndarray, rate: float) -> str:
    """The clip's language as Whisper tells it (transformers' ``detect_language``): the
    most likely language token after ``<|startoftranscript|>``."""
    langs = language_ids(engine.tokenizer)
    by_id = {i: code for code, i in langs.items()}
    sot = engine.tokenizer.token_to_id("<|startoftranscript|>")
    params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=tuple(by_id))
    stream = engine.enqueue(await engine.prepare([sot], params, images=[AudioClip((samples, rate))]))
    async with stream:
        token = [t async for out in stream for t in out.token_ids]
    return by_id[token[0]]


def cut_points(samples: np.ndarray, rate: float, window: float) -> list[int]:
    """Where a clip of ``samples`` is cut into pieces of at most ``window`` seconds: in
    each window's last second, at the start of its quietest tenth of a second."""
    n, size = len(samples), int(window * rate)
    cuts, start = [], 0
    step = max(1, int(rate / 10))
    while n - start > size:
        lo = start + size - int(rate)
        energy = [float(np.square(samples[a:a + step]).sum()) for a in range(lo, start + size - step + 1, step)]
        cut = lo + step * int(np.argmin(energy)) if energy else start + size
        cut = max(cut, start + 1)
        cuts.append(cut)
        start = cut
    return cuts


async def transcribe(engine: Engine, data: Any, *, language: str | None = None,
                     task: str = "transcribe", prompt: str | None = None,
                     temperature: float = 0.0, max_tokens: int | None = None,
                     sampling: Mapping[str, Any] | None = None, timestamps: bool = False,
                     no_speech: bool = False, request_id: str | None = None) -> Transcription:
    """Submit ``data`` (encoded audio bytes, or a ``(samples, rate)`` pair) for
    transcription (``task="translate"``: into English); the pieces' requests are queued
    when this returns. ``language`` None: detected from the clip's first window (a
    multilingual model), as transformers' ``generate`` does. ``sampling``: more
    :class:`SamplingParams` fields (``seed``, ``top_p``, penalties). ``timestamps``: the
    prompt leaves ``<|notimestamps|>`` out and Whisper's timestamp rules apply
    (:meth:`Transcription.segments` reads the result); ``no_speech``: each piece is probed
    for Whisper's no-speech probability too (the segments' ``no_speech_prob``). Refused with
    :class:`InvalidParamError` naming the field: a model that does not transcribe, a clip
    that does not decode or is over :data:`MAX_CLIP_SECONDS`, an unknown language."""
    if not transcribes(engine):
        raise InvalidParamError(f"the model {engine.model_name} does not transcribe audio "
                                "(Whisper does)", param="model")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise InvalidParamError("temperature must be a number in [0, 2]", param="temperature")
    # The checkpoint's suppressed tokens apply to every transcription, as in transformers'
    # generate (engine.runner.whisper_timestamps).
    sampling = dict(sampling or {}, extra_args={WHISPER_SUPPRESS: True})
    first_timestamp = None
    if timestamps:
        notimestamps = engine.tokenizer.token_to_id("<|notimestamps|>")
        if notimestamps is None:
            raise InvalidParamError("the model's tokenizer has no timestamp tokens", param="response_format")
        first_timestamp = notimestamps + 1
        sampling.update(extra_args={WHISPER_SUPPRESS: True, WHISPER_TIMESTAMPS: True}, logprobs=0)
    params = SamplingParams(temperature=float(temperature), max_tokens=max_tokens, **sampling)
    is_multilingual = multilingual(str(engine._parts.tokenizer_folder))
    whisper_prompt(engine.tokenizer, language=language, task=task, prompt=prompt,
                   is_multilingual=is_multilingual)  # checked before the clip is decoded
    samples, rate = await trio.to_thread.run_sync(decode_audio, data, "file", MAX_CLIP_SECONDS)
    window = engine._parts.images.max_seconds
    cuts = [0, *cut_points(samples, rate, window), len(samples)]
    pieces = [samples[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    if language is None and is_multilingual and language_ids(engine.tokenizer):
        language = await detect_language(engine, pieces[0], rate)
    ids = whisper_prompt(engine.tokenizer, language=language, task=task, prompt=prompt,
                         is_multilingual=is_multilingual)
    if timestamps:
        ids = ids[:-1]  # no <|notimestamps|>: Whisper writes the segments' times
    base = request_id or uuid.uuid4().hex
    prepared = [await engine.prepare(list(ids), params, images=[AudioClip((piece, rate))],
                                     request_id=base if len(pieces) == 1 else f"{base}-{i}")
                for i, piece in enumerate(pieces)]
    # The no-speech token sits just before <|notimestamps|> (<|nospeech|>, <|nocaptions|>
    # in the first checkpoints), as transformers finds it.
    no_speech_id = first_timestamp - 2 if no_speech and first_timestamp is not None else None
    if no_speech_id is not None and engine.tokenizer.convert_ids_to_tokens([no_speech_id])[0] not in (
            "<|nospeech|>", "<|nocaptions|>"):
        no_speech_id = None  # a vocabulary without it: no_speech_prob stays null
    probes = []
    if no_speech_id is not None:
        sot = engine.tokenizer.token_to_id("<|startoftranscript|>")
        probe = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        probes = [await engine.prepare([sot, no_speech_id], probe, images=[AudioClip((piece, rate))],
                                       request_id=f"{base}-no-speech-{i}")
                  for i, piece in enumerate(pieces)]
    run = Transcription([], len(samples) / rate, language=language,
                        starts=[a / rate for a in cuts[:-1]],
                        lengths=[(b - a) / rate for a, b in zip(cuts, cuts[1:], strict=False)],
                        first_timestamp=first_timestamp, temperature=float(temperature))
    try:
        for p in prepared:
            run.streams.append(engine.enqueue(p))
        for p in probes:  # each beside its piece, whose clip's encoder output it shares
            run.probes.append(engine.enqueue(p))
    except BaseException:  # a full queue, say: the pieces already queued are aborted
        await run.aclose()
        raise
    return run


def split_segments(tokens: list[int], first_timestamp: int,
                   length: float) -> list[tuple[float, float, list[int], list[int]]]:
    """One window's output split into segments as Whisper (and transformers) split it:
    at each pair of adjacent timestamps, a segment from its first token's time to its
    last timestamp's (the last segment keeps its closing pair, and ends at the pair's
    first; a tail that ends on one timestamp is a segment too); without a pair, one
    segment from 0 to the last timestamp (to ``length`` without any). Text after the
    last pair that no timestamp closes, which Whisper decodes again from the next window,
    is one more segment to the window's end here. Each: ``(start, end, tokens, their
    indices)``."""
    stamp = [t >= first_timestamp for t in tokens]

    def at(t: int) -> float:
        return (t - first_timestamp) * 0.02

    pairs = [i for i in range(1, len(tokens)) if stamp[i - 1] and stamp[i]]
    if not pairs:
        stamps = [t for t in tokens if t >= first_timestamp]
        end = at(stamps[-1]) if stamps and stamps[-1] != first_timestamp else length
        return [(0.0, end, tokens, list(range(len(tokens))))] if tokens else []
    single_end = len(tokens) >= 2 and stamp[-1] and not stamp[-2]
    cuts = [*pairs, len(tokens)] if single_end else [*pairs[:-1], pairs[-1] + 1]
    out, last = [], 0
    for k, cut in enumerate(cuts):
        span = tokens[last:cut]
        end = span[-1] if k < len(cuts) - 1 or single_end else span[-2]
        out.append((at(span[0]), at(end), span, list(range(last, cut))))
        last = cut
    if any(not stamp[i] for i in range(last, len(tokens))):
        start = at(tokens[last - 1])
        out.append((start, max(start, length), tokens[last:], list(range(last, len(tokens)))))
    return out


def duration_seconds(transcription: Transcription) -> int:
    """OpenAI's ``usage`` of a clip: its length in whole seconds, rounded up."""
    return math.ceil(transcription.seconds)


__all__ = ["MAX_CLIP_SECONDS", "TASKS", "Transcription", "cut_points", "detect_language",
           "duration_seconds", "language_ids", "multilingual", "split_segments", "transcribe",
           "transcribes", "whisper_prompt"]

