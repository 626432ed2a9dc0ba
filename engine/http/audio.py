"""OpenAI's speech-to-text routes, ``/v1/audio/transcriptions`` and
``/v1/audio/translations``, over Whisper (:mod:`engine.api.transcription`).

The body is ``multipart/form-data``, as OpenAI's client sends it: ``file`` (the clip:
WAV, FLAC, Ogg or MP3, at most ten minutes), ``model``, and optionally ``language`` (an
ISO 639-1 code; transcriptions only), ``prompt`` (text the clip continues),
``response_format`` (``json``: ``{"text", "usage"}``; ``text``: the text alone;
``verbose_json``, ``srt``, ``vtt``: with Whisper's segment timestamps),
``temperature``, ``stream`` (``true``: OpenAI's ``transcript.text.delta`` events, then
``transcript.text.done``) and vLLM's sampling extras (``seed``, ``top_p``, ``top_k``,
``min_p``, the three penalties, ``max_completion_tokens``). Word timestamps
(``timestamp_granularities[]`` ``word``) are a 400, and so is any unknown field.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestEntityTooLarge

from engine.api import transcription
from engine.errors import InvalidParamError
from engine.http import sse
from engine.http.bodies import json_response, sse_response
from engine.http.errors import APIError
from engine.http.server import Server

# vLLM's sampling extras of these routes, each a SamplingParams field (int or float).
SAMPLING = {"seed": int, "top_p": float, "top_k": int, "min_p": float, "frequency_penalty": float,
            "presence_penalty": float, "repetition_penalty": float, "max_completion_tokens": int}
GRANULARITIES = "timestamp_granularities[]"
FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "stream",
          GRANULARITIES, *SAMPLING}
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TIMED = ("verbose_json", "srt", "vtt")  # the formats with segment timestamps


class AudioRoutes:
    """The speech-to-text handlers, bound to one :class:`Server`."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.engine = server.engine

    def register(self, app: QuartTrio) -> None:
        app.add_url_rule("/v1/audio/transcriptions", view_func=self.transcriptions, methods=["POST"])
        app.add_url_rule("/v1/audio/translations", view_func=self.translations, methods=["POST"])

    async def transcriptions(self) -> Response:
        return await self._run("transcribe")

    async def translations(self) -> Response:
        return await self._run("translate")

    async def _form(self) -> tuple[dict[str, str], bytes]:
        length = request.content_length
        if length is not None and length > self.server.max_request_bytes:
            raise self.server._too_large(length)
        if request.mimetype != "multipart/form-data":
            raise APIError(400, "the body must be multipart/form-data with the clip as `file` "
                           "(as OpenAI's client sends it)", param="file", code="invalid_value")
        try:
            form, files = await request.form, await request.files
        except RequestEntityTooLarge:
            raise self.server._too_large(None) from None
        fields = {k: form[k] for k in form}
        unknown = sorted((set(fields) | set(files)) - FIELDS)
        if unknown:
            raise APIError(400, f"unknown or unsupported field `{unknown[0]}`",
                           param=unknown[0], code="unsupported_parameter")
        for key, values in ((k, form.getlist(k)) for k in form):
            if len(values) > 1 and key != GRANULARITIES:
                raise APIError(400, f"`{key}` is given {len(values)} times; it takes one value",
                               param=key, code="invalid_value")
        if len(files.getlist("file")) > 1:
            raise APIError(400, "one clip a request: `file` is given more than once",
                           param="file", code="invalid_value")
        for granularity in form.getlist(GRANULARITIES):
            if granularity != "segment":
                raise APIError(400, f"timestamp granularity `{granularity}`: only `segment` is "
                               "built (word timestamps are not)", param=GRANULARITIES,
                               code="unsupported_parameter")
        upload = files.get("file")
        if upload is None:
            raise APIError(400, "the clip is missing: send it as the form's `file`", param="file",
                           code="missing_required_parameter")
        return fields, upload.read()

    async def _run(self, task: str) -> Response:
        fields, data = await self._form()
        self.server.check_base_model(fields.get("model"))
        fmt = fields.get("response_format", "json")
        if GRANULARITIES in fields and fmt != "verbose_json":
            raise APIError(400, "timestamp_granularities needs response_format verbose_json",
                           param=GRANULARITIES, code="invalid_value")
        if fmt not in FORMATS:
            raise APIError(400, f"response_format must be one of {', '.join(FORMATS)}",
                           param="response_format", code="invalid_value")
        if task == "translate" and "language" in fields:
            raise APIError(400, "a translation is into English; `language` is not taken",
                           param="language", code="unsupported_parameter")
        stream = _flag(fields.get("stream", "false"), "stream")
        if stream and fmt != "json":
            raise APIError(400, f"stream returns events; response_format {fmt} is not streamed",
                           param="response_format", code="unsupported_parameter")
        temperature = _number(fields.get("temperature", "0"), "temperature")
        sampling = {k: _number(fields[k], k, kind) for k, kind in SAMPLING.items() if k in fields}
        max_tokens = sampling.pop("max_completion_tokens", None)
        try:
            run = await transcription.transcribe(
                self.engine, data, language=fields.get("language") or None, task=task,
                prompt=fields.get("prompt") or None, temperature=temperature,
                max_tokens=max_tokens, sampling=sampling, timestamps=fmt in TIMED,
                no_speech=fmt == "verbose_json", request_id=self.server.request_id())
        except InvalidParamError as exc:
            param = "max_completion_tokens" if exc.param == "max_tokens" else exc.param  # the form's name
            raise APIError(400, str(exc), param=param, code="invalid_value") from None
        if stream:
            return sse_response(lambda send: _write_events(run, send), run.aclose)
        try:
            if fmt in TIMED:
                text, segments = await run.segments(self.engine.tokenizer)
            else:
                text = await run.text()
        finally:
            await run.aclose()
        if fmt == "verbose_json":
            return json_response({"task": task, "language": run.language, "duration": run.seconds,
                                  "text": text, "segments": segments, "usage": {
                                      "type": "duration",
                                      "seconds": transcription.duration_seconds(run)}}, 200)
        if fmt in ("srt", "vtt"):
            return Response(subtitles(segments, fmt), 200, content_type="text/plain; charset=utf-8")
        if fmt == "text":
            return Response(text, 200, content_type="text/plain; charset=utf-8")
        return json_response({"text": text, "usage": {
            "type": "duration", "seconds": transcription.duration_seconds(run)}}, 200)


async def _write_events(run: transcription.Transcription, send: trio.MemorySendChannel[bytes]) -> None:
    async with send:
        try:
            parts = []
            async for delta in run.deltas():
                parts.append(delta)
                await send.send(sse.event({"type": "transcript.text.delta", "delta": delta}))
            await send.send(sse.event({"type": "transcript.text.done", "text": "".join(parts),
                                       "usage": {"type": "duration",
                                                 "seconds": transcription.duration_seconds(run)}}))
            await send.send(b"data: [DONE]\n\n")
        finally:
            await run.aclose()


def subtitles(segments: list[dict[str, Any]], fmt: str) -> str:
    """The segments as SubRip (``srt``: numbered cues, ``00:00:01,500``) or WebVTT
    (``vtt``: a ``WEBVTT`` header, ``00:00:01.500``)."""
    mark = "," if fmt == "srt" else "."

    def clock(seconds: float) -> str:
        ms = round(seconds * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{mark}{ms % 1000:03d}"

    cues = [(f"{i}\n" if fmt == "srt" else "") + f"{clock(s['start'])} --> {clock(s['end'])}\n"
            f"{s['text'].strip()}\n" for i, s in enumerate(segments, start=1)]
    return ("WEBVTT\n\n" if fmt == "vtt" else "") + "\n".join(cues)


def _flag(value: str, name: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise APIError(400, f"{name} must be true or false", param=name, code="invalid_value")
    return value.lower() == "true"


def _number(value: str, name: str, kind: type = float) -> Any:
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise APIError(400, f"{name} must be {what}", param=name, code="invalid_value") from None


__all__ = ["AudioRoutes", "FIELDS"]

