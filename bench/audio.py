"""Qwen2-Audio: the time to first token of a chat request with one clip, the engine beside
transformers, same model, same run.

    python bench/audio.py                              # the released tower, random weights
    python bench/audio.py --seconds 2 5 10 30 --repeats 3 --layers 32

The model is written to a temp dir by ``engine.models.testing_audio`` with the released
Qwen2-Audio tower's shape (1,280 wide, ``--layers`` layers of 20 heads, 5,120 in the MLP,
128 log-mel bins, the 30-second window) in front of the tiny Qwen2 decoder, so the time is
the clip's: decoding, the feature extractor, the encoder and the placeholders' prefill.
Each request is a chat with a new clip (a tone with noise, WAV at 16 kHz; new each time,
so no prefix-cache hit) and a short question, ``max_tokens`` 1, submitted to the embedded
engine, against transformers' ``Qwen2AudioProcessor`` + ``generate(max_new_tokens=1)`` on
the same clip. transformers pads every clip to the window and masks the padding; the
engine encodes the clip's own frames. The median of ``--repeats``; the two run one after
the other, never at once.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QUESTION = "What is in this clip?"


def _clip(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.4 * np.sin(2 * np.pi * (200 + seed) * t) + 0.1 * rng.standard_normal(len(t))).astype(np.float32)


def _wav(wave: np.ndarray) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, wave, 16000, format="WAV", subtype="FLOAT")
    return out.getvalue()


def _messages(wave: np.ndarray) -> list[dict]:
    data = base64.b64encode(_wav(wave)).decode()
    return [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
        {"type": "text", "text": QUESTION}]}]


async def engine_ttft(folder: Path, dtype: str, seconds: list[float], repeats: int,
                      seed: int) -> dict[float, list[float]]:
    import engine

    out: dict[float, list[float]] = {}
    async with engine.open_engine(str(folder), dtype=dtype, kv_cache_memory=64 * 2**20,
                                  max_num_seqs=1) as eng:
        params = engine.SamplingParams(temperature=0, max_tokens=1)

        async def first(messages: list[dict]) -> float:
            t0 = time.perf_counter()
            stream = await eng.submit(messages, params)
            async with stream:
                async for _ in stream:
                    break
            return time.perf_counter() - t0

        await first(_messages(_clip(seed - 1, 1.0)))  # warm-up
        for s in seconds:
            out[s] = [await first(_messages(_clip(seed + 100 * r + int(s), s)))
                      for r in range(repeats)]
    return out


def hf_ttft(folder: Path, dtype: str, seconds: list[float], repeats: int,
            seed: int) -> dict[float, list[float]]:
    import soundfile
    from transformers import (
        AutoTokenizer,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    model = Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor.from_pretrained(folder),
                                    tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio", "audio": "clip"},
                                      {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True, tokenize=False)

    def once(wave: np.ndarray) -> float:
        t0 = time.perf_counter()
        samples, _ = soundfile.read(io.BytesIO(_wav(wave)), dtype="float32")
        inputs = processor(text=text, audio=[samples], return_tensors="pt", sampling_rate=16000)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
        return time.perf_counter() - t0

    once(_clip(seed - 1, 1.0))  # warm-up
    return {s: [once(_clip(seed + 100 * r + int(s), s)) for r in range(repeats)] for s in seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[2, 5, 10, 30])
    parser.add_argument("--layers", type=int, default=32, help="the tower's layers (released: 32)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    from engine.models.testing_audio import write_tiny_qwen2_audio

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_qwen2_audio(Path(tmp) / "qwen2-audio", d_model=1280, layers=args.layers,
                                        heads=20, ffn=5120, mel_bins=128, seconds=30,
                                        text_overrides={"max_position_embeddings": 2048})
        print(f"Qwen2-Audio tower: 1280 wide, {args.layers} layers, 128 bins, 30 s window; "
              f"tiny decoder; {args.dtype}; torch threads {torch.get_num_threads()}; "
              f"median of {args.repeats}")
        ours = trio.run(engine_ttft, folder, args.dtype, args.seconds, args.repeats, args.seed)
        theirs = hf_ttft(folder, args.dtype, args.seconds, args.repeats, args.seed)
    print(f"{'clip s':>7} {'tokens':>7} {'engine TTFT ms':>15} {'transformers ms':>16} {'ratio':>7}")
    for s in args.seconds:
        frames = int(s * 100)
        tokens = ((frames - 1) // 2 + 1 - 2) // 2 + 1
        a, b = statistics.median(ours[s]) * 1e3, statistics.median(theirs[s]) * 1e3
        print(f"{s:7g} {tokens:7d} {a:15.1f} {b:16.1f} {b / a:6.2f}x")


if __name__ == "__main__":
    main()
