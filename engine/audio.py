"""Audio in chat prompts (Qwen2-Audio): from content parts to the clips' log-mel frames.

The parts (:func:`engine.multimodal.split_images` takes them out of the messages as it
does images, leaving ``{"type": "audio", "audio": None}`` for the chat template):

- OpenAI's ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}``;
- vLLM's ``{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}`` (an
  ``http(s)`` URL only for a host in ``--allowed-media-domains``);
- from the embedded API, ``{"type": "audio", "audio": <bytes | (samples, rate)>}``, and
  ``multi_modal_data={"audio": ...}`` beside a text prompt, as vLLM takes it.

:meth:`AudioPreprocessor.expand` decodes each clip with soundfile (WAV, FLAC, Ogg, MP3:
libsndfile's formats; the length read from the header is checked against the model's
window before a sample is decoded), mixes it down to one channel, resamples it to the
feature extractor's rate with soxr (librosa's default resampler, as vLLM uses), runs the
model's own transformers feature extractor (Whisper's log-mel) and widens each audio
token of the prompt to the clip's placeholders. Every fault of a clip is this request's
:class:`InvalidParamError` naming the part.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import CorruptModelError, InvalidParamError
from engine.messages import ImageInput
from engine.multimodal import ImageURL, RawImage, fetch_image, media_token_positions


def audio_tokens(frames: int) -> int:
    """Embeddings (placeholder tokens) of a clip of ``frames`` log-mel frames in Qwen2-Audio's
    tower: the stride-2 convolution halves them (rounding up), then pairs are averaged
    (rounding down)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def decode_audio(data: Any, where: str, max_seconds: float) -> tuple[np.ndarray, float]:
    """``(float32 samples of one channel, rate)`` of an encoded clip (or a ``(samples,
    rate)`` pair), at most ``max_seconds`` long."""
    import soundfile  # a C library's binding, loaded with the first clip

    if isinstance(data, ImageURL):
        data = fetch_image(data.url, where)
    if isinstance(data, tuple):
        samples, rate = data
        _check_length(len(samples) / rate, where, max_seconds)
    else:
        try:
            with soundfile.SoundFile(io.BytesIO(data)) as f:
                # The header's length, checked before a sample is decoded.
                _check_length(f.frames / f.samplerate, where, max_seconds)
                samples, rate = f.read(dtype="float32", always_2d=False), float(f.samplerate)
        except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
            raise InvalidParamError(f"{where}: the audio is not a clip this server reads "
                                    f"(WAV, FLAC, Ogg, MP3) or is corrupt ({exc})",
                                    param=where) from None
    if samples.ndim == 2:  # channels mixed down, as librosa's to_mono
        samples = samples.mean(axis=1, dtype=np.float32)
    if not len(samples) or not np.isfinite(samples).all():
        raise InvalidParamError(f"{where}: the audio is empty or holds non-finite samples",
                                param=where)
    return samples, rate


def _check_length(seconds: float, where: str, max_seconds: float) -> None:
    if seconds > max_seconds:
        raise InvalidParamError(f"{where}: the audio is {seconds:.2f} s long, over the model's "
                                f"{max_seconds:g}-second window", param=where)


class AudioPreprocessor:
    """The model's own feature extractor (transformers' ``AutoFeatureExtractor`` from the
    model folder: Whisper's log-mel) and how its clips enter a prompt.

    Each audio part is written by the chat template as the model's processor expects it
    (Qwen2-Audio's: ``Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>``), or, in a template
    that reads content as a string, as ``image_text`` (the three tokens); the audio token
    is then widened to the clip's :func:`audio_tokens` placeholders. The interface is the
    image preprocessor's (engine.multimodal), so the engine takes either."""

    kinds = ("audio",)

    def __init__(self, folder: str | Path, *, max_frames: int, audio_token_id: int,
                 audio_token: str, image_text: str, marker_ids: Mapping[str, int],
                 limits: Any, cross_attention: bool = False) -> None:
        from transformers import AutoFeatureExtractor

        self.extractor = AutoFeatureExtractor.from_pretrained(str(folder))
        self.rate = int(self.extractor.sampling_rate)
        self.frames = int(self.extractor.nb_max_frames)
        if self.frames != max_frames:
            raise CorruptModelError(
                f"the feature extractor's window is {self.frames} log-mel frames; the audio "
                f"tower takes {max_frames}")
        self.max_seconds = self.extractor.n_samples / self.rate
        self.image_token_id = audio_token_id
        self.image_token = audio_token
        self.image_text = image_text
        self.marker_ids = dict(marker_ids)
        self.limits = limits
        # Whisper: the clip is read by the decoder's cross-attention, not placeholders; the
        # prompt (the decoder's task tokens) is given whole, with exactly one clip.
        self.cross_attention = cross_attention

    def features(self, raw: RawImage) -> tuple[bytes, tuple[int, ...], int]:
        """``(float32 bytes, shape, frames)`` of one clip: its log-mel frames and the two
        after them (what the encoder's convolutions read of the padding), and how many
        frames are the clip's own."""
        import soxr

        samples, rate = decode_audio(raw.data, raw.where, self.max_seconds)
        if rate != self.rate:
            samples = soxr.resample(samples, rate, self.rate).astype(np.float32, copy=False)
            samples = samples[: int(self.max_seconds * self.rate)]  # rounding of the length
        out = self.extractor(samples, sampling_rate=self.rate, return_attention_mask=True,
                             padding="max_length", return_tensors="np")
        frames = int(out["attention_mask"][0].sum())
        if audio_tokens(frames) < 1:
            raise InvalidParamError(f"{raw.where}: the audio is too short ({len(samples)} "
                                    f"samples at {self.rate} Hz)", param=raw.where)
        # Whisper's encoder attends over the whole window: every frame is kept.
        kept = out["input_features"][0][:, : None if self.cross_attention else frames + 2]
        kept = kept.astype("<f4")
        kept = np.ascontiguousarray(kept)
        return kept.tobytes(), tuple(int(d) for d in kept.shape), frames

    def expand(self, ids: Sequence[int], clips: Sequence[Any],
               options: Mapping[str, Any] | None = None) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """The prompt with each audio token widened to its clip's placeholder tokens, and
        the clips. Safe in a worker thread (decoding and the extractor are slow)."""
        if options:
            raise InvalidParamError("mm_processor_kwargs: this model's audio feature "
                                    "extractor takes none", param="mm_processor_kwargs")
        if self.cross_attention:
            if len(clips) != 1:
                raise InvalidParamError(f"Whisper transcribes one clip a request, got "
                                        f"{len(clips)}", param="file")
            features, shape, frames = self.features(clips[0])
            key = int.from_bytes(hashlib.sha256(features).digest()[:8], "little") >> 1
            return tuple(ids), (ImageInput(0, 0, key, features, shape, (frames,)),)
        at = media_token_positions(ids, self.image_token_id, self.image_token, self.marker_ids,
                                   len(clips), "audio clip")
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for pos, raw in zip(at, clips, strict=True):
            out.extend(ids[prev:pos])
            features, shape, frames = self.features(raw)
            n = audio_tokens(frames)
            digest = hashlib.sha256(repr((shape, frames)).encode() + features).digest()
            key = int.from_bytes(digest[:8], "little") >> 1
            inputs.append(ImageInput(len(out), n, key, features, shape, (frames,)))
            out.extend([self.image_token_id] * n)
            prev = pos + 1
        out.extend(ids[prev:])
        return tuple(out), tuple(inputs)


__all__ = ["AudioPreprocessor", "audio_tokens", "decode_audio"]
