"""Images in chat prompts: from content parts to :class:`ImageInput` messages. Audio
parts are taken out of the messages here too (:data:`MEDIA_PARTS`); their clips are
read by :mod:`engine.audio`.

The data path (admission, in the caller's task or a worker thread):

1. :func:`split_images` takes the image parts out of the chat messages, leaving a bare
   ``{"type": "image"}`` part in each one's place: the chat template writes the model's
   image placeholder for it (a template that iterates over content), or the engine does
   (``ImagePreprocessor.image_text``, for a template that reads content as a string; see
   :func:`engine.chat.template.apply_chat_template`). Parts are
   ``{"type": "image_url", "image_url": {"url": ...}}`` (a ``data:`` URL; an ``http(s)``
   URL only for a host in ``--allowed-media-domains``, fetched in step 2 with a time and
   size limit and no redirects) or, from the embedded API,
   ``{"type": "image", "image": <bytes | PIL.Image>}``.
2. :meth:`ImagePreprocessor.expand` decodes each image with Pillow (PNG, JPEG, WebP; the
   size read from the header is checked against the pixel budget before any pixel is
   decoded), runs the model's own transformers image processor and replaces each image
   token of the tokenized prompt with the model's number of placeholder tokens. Each image
   becomes an :class:`ImageInput` (float32 pixel bytes, shape, offset, content hash).

Every fault of an image is this request's :class:`InvalidParamError` naming the part.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import parse_mm_processor_kwargs
from engine.errors import ConfigError, InvalidParamError
from engine.messages import ImageInput
from engine.pixels import normalisation, pack

# The formats accepted, by their leading bytes (WebP: "RIFF", size, "WEBP").
# Image processors kept for requests' own mm_processor_kwargs (one per distinct set).
PROCESSORS_KEPT = 8
_FORMATS = {"PNG": (b"\x89PNG\r\n\x1a\n",), "JPEG": (b"\xff\xd8\xff",)}


@dataclasses.dataclass(frozen=True, slots=True)
class MediaLimits:
    """What a server accepts of images (``--limit-mm-per-prompt``, ``--max-image-pixels``,
    ``--allowed-media-domains``)."""

    max_images_per_prompt: int = 4
    max_image_pixels: int = 4096 * 4096
    allowed_media_domains: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class RawImage:
    """An image part taken out of the messages: where it was and its encoded bytes (or an
    already decoded PIL image from the embedded API)."""

    where: str  # messages[i].content[j]
    data: Any  # bytes | PIL.Image.Image | ImageURL


# Content parts by the media they carry: images (OpenAI's image_url, the embedded API's
# image) and audio clips (OpenAI's input_audio, vLLM's audio_url, the embedded API's audio).
MEDIA_PARTS = {"image_url": "image", "image": "image",
               "input_audio": "audio", "audio_url": "audio", "audio": "audio"}
# The formats OpenAI's input_audio names, and those libsndfile reads besides.
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
_PLURAL = {"image": "images", "audio": "audio clips"}


@dataclasses.dataclass(frozen=True, slots=True)
class AudioClip:
    """An audio clip given beside a prompt (``multi_modal_data={"audio": ...}``): encoded
    bytes or a ``(samples, sampling rate)`` pair."""

    data: Any


def has_images(messages: Any) -> bool:
    """Whether any chat message holds an image or audio part (cheap: no decoding)."""
    if not isinstance(messages, (list, tuple)):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, (list, tuple)) and any(
            isinstance(p, Mapping) and p.get("type") in MEDIA_PARTS for p in content
        ):
            return True
    return False


def _refuse_kind(kind: str, kinds: Sequence[str], model: str, where: str) -> None:
    if kind not in kinds:
        takes = " and ".join(["text", *(_PLURAL[k] for k in kinds)]) if kinds else "text only"
        raise InvalidParamError(f"{where}: the model {model} takes {takes}, not {_PLURAL[kind]}",
                                param=where)


def split_images(
    messages: Sequence[Any], kinds: Sequence[str], limits: MediaLimits, *, model: str = "model",
) -> tuple[list[Any], list[RawImage]]:
    """The messages with each image part replaced by ``{"type": "image"}`` and each audio
    part by ``{"type": "audio", "audio": None}`` (the parts stay in the order given; a
    template tests a part for an ``audio`` key or its type), and the media in prompt
    order. ``kinds``: what the model takes (``("image",)``, ``("audio",)``; empty for a
    text-only model); another kind is refused, naming the part."""
    out: list[Any] = []
    media: list[RawImage] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, (list, tuple)):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in MEDIA_PARTS:
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            _refuse_kind(MEDIA_PARTS[kind], kinds, model, where)
            media.append(RawImage(where, _part_data(part, kind, where, limits)))
            if len(media) > limits.max_images_per_prompt:
                raise InvalidParamError(
                    f"{where}: more than {limits.max_images_per_prompt} "
                    f"{_PLURAL[MEDIA_PARTS[kind]]} in one request (--limit-mm-per-prompt)",
                    param="messages")
            parts.append({"type": "image"} if MEDIA_PARTS[kind] == "image"
                         else {"type": "audio", "audio": None})
        out.append({**message, "content": parts})
    return out, media


def prompt_images(images: Any, kinds: Sequence[str], limits: MediaLimits, *, model: str = "model",
                  where: str = "images") -> list[RawImage]:
    """Images (or audio clips) given beside a text or token-id prompt (vLLM's
    ``multi_modal_data``), in the order of the prompt's image (audio) tokens: one or a
    list, each bytes or a PIL image, or an :class:`AudioClip` or ``(samples, rate)`` pair.
    Bytes are the model's kind of media. Media the model does not take (``kinds``) are
    refused (a 400 naming ``where``)."""
    items = list(images) if isinstance(images, (list, tuple)) and not _is_samples(images) else [images]
    if len(items) > limits.max_images_per_prompt:
        raise InvalidParamError(f"{where}: {len(items)} media items in one request; at most "
                                f"{limits.max_images_per_prompt} (--limit-mm-per-prompt)",
                                param=where)
    out = []
    for k, data in enumerate(items):
        at = f"{where}[{k}]"
        if isinstance(data, AudioClip) or _is_samples(data):
            _refuse_kind("audio", kinds, model, at)
            out.append(RawImage(at, embedded_audio(getattr(data, "data", data), at)))
        elif isinstance(data, (bytes, bytearray, memoryview)):
            _refuse_kind(kinds[0] if kinds else "image", kinds, model, at)
            out.append(RawImage(at, bytes(data)))
        elif _is_pil(data):
            _refuse_kind("image", kinds, model, at)
            out.append(RawImage(at, data))
        else:
            raise InvalidParamError(f"{at} must be bytes, a PIL image or an audio clip",
                                    param=at)
    return out


def _is_samples(data: Any) -> bool:
    """A ``(samples, rate)`` pair: an array and a number."""
    return (isinstance(data, tuple) and len(data) == 2 and hasattr(data[0], "__len__")
            and not isinstance(data[0], (bytes, str)) and isinstance(data[1], (int, float)))


def input_audio_bytes(part: Mapping[str, Any], where: str) -> bytes:
    """The encoded clip of OpenAI's ``input_audio`` part."""
    spec = part.get("input_audio")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("data"), str):
        raise InvalidParamError(f"{where}.input_audio must be an object with base64 data",
                                param=where)
    fmt = spec.get("format", "wav")
    if fmt not in AUDIO_FORMATS:
        raise InvalidParamError(f"{where}.input_audio.format must be one of "
                                f"{', '.join(AUDIO_FORMATS)}, got {fmt!r}", param=where)
    try:
        return base64.b64decode(spec["data"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidParamError(f"{where}.input_audio.data is not valid base64 ({exc})",
                                param=where) from None


def embedded_audio(data: Any, where: str) -> Any:
    """An embedded API's clip: encoded bytes, or ``(samples, rate)`` as vLLM's
    ``multi_modal_data`` takes it (samples a 1-D array, or ``[frames, channels]``)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, tuple) and len(data) == 2:
        samples, rate = data
        array = np.asarray(samples)
        if array.dtype.kind not in "fiu" or array.ndim not in (1, 2) or not array.size:
            raise InvalidParamError(f"{where}: audio samples must be a non-empty 1-D (or "
                                    "[frames, channels]) array of numbers", param=where)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise InvalidParamError(f"{where}: the sampling rate must be a positive number",
                                    param=where)
        return array.astype(np.float32), float(rate)
    raise InvalidParamError(f"{where} must be encoded audio bytes or a (samples, "
                            "sampling rate) pair", param=where)


def _part_data(part: Mapping[str, Any], kind: str, where: str, limits: MediaLimits) -> Any:
    if kind == "image":  # the embedded API: bytes or a PIL image
        data = part.get("image")
        if isinstance(data, (bytes, bytearray, memoryview)):
            return bytes(data)
        if _is_pil(data):
            return data
        raise InvalidParamError(f"{where}.image must be bytes or a PIL image", param=where)
    if kind == "audio":  # the embedded API
        return embedded_audio(part.get("audio"), f"{where}.audio")
    if kind == "input_audio":
        return input_audio_bytes(part, where)
    if kind == "audio_url":
        spec = part.get("audio_url")
        url = spec.get("url") if isinstance(spec, Mapping) else spec
        return _media_url(url, where, "audio_url", limits)
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    return _media_url(url, where, "image_url", limits)


def _media_url(url: Any, where: str, field: str, limits: MediaLimits) -> Any:
    if not isinstance(url, str):
        raise InvalidParamError(f"{where}.{field}.url must be a string", param=where)
    if url.startswith("data:"):
        return _data_url(url, where)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if host not in limits.allowed_media_domains:
            raise InvalidParamError(
                f"{where}: media URLs from {host or 'that host'!r} are not allowed; send the "
                "data as a base64 data: URL (the server fetches only from "
                "--allowed-media-domains)", param=where)
        return ImageURL(url)  # fetched with the decoding, in a worker thread
    raise InvalidParamError(f"{where}: {field} must be a data: URL (or http(s) for an "
                            "allowed host)", param=where)


@dataclasses.dataclass(frozen=True, slots=True)
class ImageURL:
    """An http(s) image URL of an allowed host, fetched when the image is decoded."""

    url: str


# Fetching an allowed host's image: the whole fetch's time, and the most bytes read. No
# redirect is followed (it could leave the allowed hosts).
FETCH_TIMEOUT_SECONDS = 10.0
FETCH_MAX_BYTES = 20 * 2**20


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} not followed",
                                     headers, fp)


def fetch_image(url: str, where: str) -> bytes:
    """The bytes at ``url`` (blocking: a worker thread's), within the time and size limits;
    any failure is this request's :class:`InvalidParamError`."""
    opener = urllib.request.build_opener(_NoRedirect)
    deadline = time.monotonic() + FETCH_TIMEOUT_SECONDS
    chunks: list[bytes] = []
    size = 0
    try:
        # urllib's timeout bounds each socket operation; the deadline bounds the whole
        # fetch (a server dripping bytes slowly cannot hold a thread for long).
        with opener.open(url, timeout=FETCH_TIMEOUT_SECONDS) as response:
            while size <= FETCH_MAX_BYTES:
                chunk = response.read(min(2**16, FETCH_MAX_BYTES + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if time.monotonic() > deadline:
                    raise InvalidParamError(
                        f"{where}: fetching the image took over {FETCH_TIMEOUT_SECONDS:g} s",
                        param=where)
        data = b"".join(chunks)
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response's connection
        raise InvalidParamError(f"{where}: fetching the image failed: HTTP {exc.code} "
                                f"{exc.reason}", param=where) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise InvalidParamError(f"{where}: fetching the image failed: {exc}", param=where) from None
    if len(data) > FETCH_MAX_BYTES:
        raise InvalidParamError(f"{where}: the image at the URL is over {FETCH_MAX_BYTES} bytes",
                                param=where)
    return data


def media_url_bytes(url: str, where: str, field: str, allowed_domains: tuple[str, ...]) -> bytes:
    """The bytes a media URL names: a base64 ``data:`` URL decoded, or an http(s) URL of a
    host in ``allowed_domains`` fetched within the fetch limits (blocking: a worker
    thread's). Any other URL, and any failure, is an :class:`InvalidParamError` naming
    ``where``."""
    data = _media_url(url, where, field, MediaLimits(allowed_media_domains=allowed_domains))
    return fetch_image(data.url, where) if isinstance(data, ImageURL) else data


def _data_url(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidParamError(f"{where}: a data: URL must be base64 "
                                "(data:image/png;base64,... or data:audio/wav;base64,...)",
                                param=where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidParamError(f"{where}: the data: URL is not valid base64 ({exc})",
                                param=where) from None


def _is_pil(obj: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        return False
    return isinstance(obj, Image.Image)


def decode_image(data: Any, where: str, max_pixels: int) -> Any:
    """A PIL RGB image from encoded bytes (or a PIL image), within ``max_pixels``."""
    from PIL import Image, UnidentifiedImageError

    if _is_pil(data):
        _check_pixels(data.size, where, max_pixels)
        return data.convert("RGB")
    if isinstance(data, ImageURL):
        data = fetch_image(data.url, where)
    fmt = _sniff(data)
    if fmt is None:
        raise InvalidParamError(
            f"{where}: unsupported image format (PNG, JPEG and WebP are accepted)", param=where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=(fmt,))
            # The header's size, checked before a pixel is decoded: a small file that
            # inflates to a huge image stops here.
            _check_pixels(image.size, where, max_pixels)
            image.load()
            return image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidParamError(f"{where}: image refused as a decompression bomb ({exc})",
                                param=where) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidParamError(f"{where}: the {fmt} image is corrupt or truncated ({exc})",
                                param=where) from None


def _sniff(data: bytes) -> str | None:
    for fmt, magics in _FORMATS.items():
        if data.startswith(magics):
            return fmt
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _check_pixels(size: tuple[int, int], where: str, max_pixels: int) -> None:
    w, h = size
    if w * h > max_pixels:
        raise InvalidParamError(
            f"{where}: the image is {w}x{h} = {w * h} pixels, over the {max_pixels}-pixel "
            "budget per image (--max-image-pixels)", param=where)
    if w < 1 or h < 1:
        raise InvalidParamError(f"{where}: the image is empty ({w}x{h})", param=where)


class ImagePreprocessor:
    """The model's own image processor (transformers' ``AutoImageProcessor`` from the
    model folder) and how its images enter a prompt.

    Each image part is written by the chat template as the model's processor expects it,
    or, in a template that reads content as a string, as ``image_text`` (LLaVA: its image
    token; Qwen-VL: ``<|vision_start|><|image_pad|><|vision_end|>``, what Qwen-VL's own
    template writes); the image token is then widened to the image's placeholders:
    ``num_image_tokens`` for a fixed-size tower, or, with ``merge_size`` (Qwen-VL's
    dynamic resolution), ``t * h * w / merge_size**2`` of the image's own patch grid.
    With a ``frame`` (Gemma 3) the image token is widened to the frame's tokens around the
    placeholders instead (:class:`ImageFrame`)."""

    kinds = ("image",)  # the media it takes (engine.audio.AudioPreprocessor: audio)

    def __init__(self, folder: str | Path, *, image_token_id: int, image_token: str,
                 num_image_tokens: int | None, limits: MediaLimits, merge_size: int | None = None,
                 image_text: str | None = None,
                 processor_options: Mapping[str, Any] | None = None,
                 marker_ids: Mapping[str, int] | None = None,
                 frame: ImageFrame | None = None) -> None:
        from transformers import AutoImageProcessor

        # processor_options: --mm-processor-kwargs (Qwen-VL's min_pixels / max_pixels),
        # over the folder's preprocessor_config.json.
        self.folder = str(folder)
        self.options = dict(processor_options or {})
        self.processor = AutoImageProcessor.from_pretrained(self.folder, **self.options)
        # A request's own mm_processor_kwargs over the server's: a processor built for each
        # set seen (a few, kept; building one reads the folder's JSON).
        self._by_options: dict[tuple[tuple[str, int], ...], Any] = {}
        self._lock = threading.Lock()
        self.image_token_id = image_token_id
        self.image_token = image_token
        self.num_image_tokens = num_image_tokens
        self.merge_size = merge_size
        self.image_text = image_text if image_text is not None else image_token
        # The other control tokens image_text holds (Qwen-VL's <|vision_start|>, ...): the
        # prompt must hold exactly one of each per image, none typed by the client.
        self.marker_ids = dict(marker_ids or {})
        self.limits = limits
        self.frame = frame

    def pixels(self, raw: RawImage) -> tuple[bytes, tuple[int, ...]]:
        """Float32 pixel bytes and their shape for one image: ``(C, H, W)``, or Qwen-VL's
        patches ``(t * h * w, C * T * P * P)`` (``C * P * P``: one frame of a still image)."""
        pixels, shape, _ = self.preprocess(raw)
        return pixels, shape

    def processor_for(self, options: Mapping[str, Any] | None) -> Any:
        """The image processor for a request's ``mm_processor_kwargs`` (checked as
        ``--mm-processor-kwargs`` is, a 400 naming the field; set over the server's):
        Qwen-VL's pixel budget. A fixed-size tower (LLaVA) takes none."""
        if not options:
            return self.processor
        try:
            asked = parse_mm_processor_kwargs(dict(options))
        except ConfigError as exc:
            raise InvalidParamError(str(exc), param="mm_processor_kwargs") from None
        if self.merge_size is None:
            raise InvalidParamError("mm_processor_kwargs: this model's image processor takes "
                                    "no pixel budget (it resizes every image to one size)",
                                    param="mm_processor_kwargs")
        merged = {**self.options, **asked}
        try:
            merged = parse_mm_processor_kwargs(merged)  # min_pixels <= max_pixels, together
        except ConfigError as exc:
            raise InvalidParamError(f"{exc} (with the server's --mm-processor-kwargs)",
                                    param="mm_processor_kwargs") from None
        key = tuple(sorted(merged.items()))
        with self._lock:
            found = self._by_options.get(key)
        if found is None:
            from transformers import AutoImageProcessor

            found = AutoImageProcessor.from_pretrained(self.folder, **merged)
            with self._lock:
                if len(self._by_options) >= PROCESSORS_KEPT:
                    self._by_options.pop(next(iter(self._by_options)))
                self._by_options[key] = found
        return found

    def preprocess(self, raw: RawImage, processor: Any = None) -> tuple[bytes, tuple[int, ...], tuple[int, ...]]:
        """``(float32 bytes, shape, grid)`` of one image; ``grid`` is ``(t, h, w)`` patches
        for Qwen-VL, empty otherwise. ``processor``: a request's (:meth:`processor_for`)."""
        image = decode_image(raw.data, raw.where, self.limits.max_image_pixels)
        processor = processor if processor is not None else self.processor
        try:
            out = processor(images=[image], return_tensors="np")
        except ValueError as exc:  # e.g. Qwen-VL's: an aspect ratio over 200
            raise InvalidParamError(f"{raw.where}: the model's image processor refused the "
                                    f"image ({exc})", param=raw.where) from None
        grid: tuple[int, ...] = ()
        norm = normalisation(processor)
        channels = len(norm[1]) if norm is not None else 1
        if self.merge_size is not None:
            pixels = out["pixel_values"]  # every patch of the image, one row each
            grid = tuple(int(d) for d in out["image_grid_thw"][0])
            # A still image's temporal patch is its one frame repeated (C, T, P, P): keep
            # one copy, half the bytes to carry (the tower repeats it back).
            frames = pixels.reshape(len(pixels), -1, int(processor.temporal_patch_size),
                                    int(processor.patch_size) ** 2)
            if (frames == frames[:, :, :1]).all():
                pixels = frames[:, :, 0].reshape(len(pixels), -1)
            rows = pixels.reshape(len(pixels), channels, -1)  # each row channel by channel
        else:
            pixels = out["pixel_values"][0]
            rows = pixels.reshape(1, channels, -1)  # (C, H, W)
        # 8-bit values and each channel's constants where they are exact (engine.pixels).
        return pack(rows, norm), tuple(int(d) for d in pixels.shape), grid

    def expand(self, ids: Sequence[int], images: Sequence[RawImage],
               options: Mapping[str, Any] | None = None) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """The prompt with each image token widened to the image's placeholder tokens,
        and the images (processed with a request's ``options``, its mm_processor_kwargs).
        Safe in a worker thread (decoding and preprocessing are slow)."""
        processor = self.processor_for(options)
        at = media_token_positions(ids, self.image_token_id, self.image_token, self.marker_ids,
                                   len(images), "image")
        frame = self.frame
        if frame is not None and any(t == frame.placeholder_id or t in frame.after for t in ids):
            raise InvalidParamError("the prompt holds image placeholder or end-of-image tokens "
                                    "that are not an image's", param="messages")
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for pos, raw in zip(at, images, strict=True):
            _join(out, ids[prev:pos], frame)
            pixels, shape, grid = self.preprocess(raw, processor)
            if grid:
                assert self.merge_size is not None
                t, h, w = grid
                n = t * h * w // (self.merge_size * self.merge_size)
            else:
                assert self.num_image_tokens is not None
                n = self.num_image_tokens
            digest = hashlib.sha256(repr((shape, grid)).encode() + pixels).digest()
            key = int.from_bytes(digest[:8], "little") >> 1
            if frame is not None:
                _join(out, frame.before, frame)
            inputs.append(ImageInput(len(out), n, key, pixels, shape, grid))
            out.extend([self.image_token_id if frame is None else frame.placeholder_id] * n)
            if frame is not None:
                out.extend(frame.after)
            prev = pos + 1
        _join(out, ids[prev:], frame)
        return tuple(out), tuple(inputs)


def media_token_positions(ids: Sequence[int], token_id: int, token: str,
                          marker_ids: Mapping[str, int], count: int, noun: str) -> list[int]:
    """Where the prompt ``ids`` holds the media token (one per item: ``count`` images or
    clips), each marker token (Qwen-VL's ``<|vision_start|>``, Qwen2-Audio's
    ``<|audio_bos|>``) as many times; otherwise a 400. Text never becomes these tokens (it
    is marked as the client's), so another count is a chat template that dropped a part,
    or markers typed where no item stands."""
    at = [i for i, t in enumerate(ids) if t == token_id]
    if len(at) != count:
        raise InvalidParamError(
            f"the prompt holds {len(at)} {token} tokens for {count} {noun}s (the chat template "
            f"must write one per {noun} part)", param="messages")
    for text, marker in marker_ids.items():
        if sum(1 for t in ids if t == marker) != count:
            raise InvalidParamError(f"the prompt holds {text} tokens that are not an {noun}'s "
                                    f"(do not write {text} in text)", param="messages")
    return at


@dataclasses.dataclass(frozen=True, slots=True)
class ImageFrame:
    """How Gemma 3's processor writes an image in the prompt: the template's image token
    becomes ``before`` (two newlines and ``<start_of_image>``), ``placeholder_id``
    (``<image_soft_token>``) once per placeholder, and ``after`` (``<end_of_image>`` and
    two newlines). The processor edits the text and tokenizes it again, so newlines that
    meet the text's own newlines make one token of the run: ``merges`` maps each such
    pair of newline tokens to the one token of their run (:func:`newline_merges`)."""

    before: tuple[int, ...]
    placeholder_id: int
    after: tuple[int, ...]
    merges: Mapping[tuple[int, int], int]


def _join(out: list[int], tokens: Sequence[int], frame: ImageFrame | None) -> None:
    """``out`` extended by ``tokens``, a newline token at the seam merged with the one
    before it where the tokenizer writes their run as one token."""
    if frame is not None and out and tokens:
        merged = frame.merges.get((out[-1], tokens[0]))
        if merged is not None:
            out[-1] = merged
            tokens = tokens[1:]
    out.extend(tokens)


def newline_merges(encode: Callable[[str], list[int]], longest: int = 32) -> dict[tuple[int, int], int]:
    """For a tokenizer that writes runs of newlines as single tokens (Gemma's), each pair
    of such tokens whose joined run is one token too, mapped to it."""
    runs: dict[int, int] = {}  # run length -> its one token
    for n in range(1, longest + 1):
        ids = encode("\n" * n)
        if len(ids) == 1:
            runs[n] = ids[0]
    return {(runs[a], runs[b]): runs[a + b] for a in runs for b in runs if a + b in runs}


def cache_token_ids(prompt: Sequence[int], images: Sequence[ImageInput]) -> tuple[int, ...]:
    """The prompt as the prefix cache keys it: each image's placeholder tokens replaced by
    a negative id from its content hash (no real token is negative), so two prompts with
    equal text and different images share no block, and equal images match."""
    if not images:
        return tuple(prompt)
    out = list(prompt)
    for image in images:
        out[image.offset : image.offset + image.length] = [-1 - image.key] * image.length
    return tuple(out)
