"""Whisper: clips transcribed by the engine beside transformers' ``generate``, same model,
same run.

    python bench/whisper.py                          # whisper-base's shape, random weights
    python bench/whisper.py --clips 8 --seconds 10 --tokens 64 --rounds 2

The model is written to a temp dir by ``engine.models.testing_audio.write_tiny_whisper``
with whisper-base's shape (512 wide, 6 encoder and 6 decoder layers of 8 heads, 2,048 in
the MLPs, 80 log-mel bins, the 30-second window, 448 decoder positions) and the tiny
tokenizer's vocabulary with Whisper's special and timestamp tokens (about 1,900 tokens:
the LM head is cheaper than base's 51,865).
Each clip (a tone with noise, ``--seconds`` long) is transcribed to exactly ``--tokens``
tokens (random weights never end on their own: the engine ignores the end token,
transformers gets ``min_new_tokens``), greedy, from the same task tokens.

Two loads: one clip at a time, and ``--clips`` clips at once (the engine gets them as
concurrent requests and batches them; transformers as one padded batch). The engine's
time includes the feature extractor and the encoder, as transformers' does (its feature
extractor runs inside the timed region too). Medians of ``--rounds``; the two run one
after the other, never at once.
"""

from __future__ import annotations

import argparse
import json
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

TASK = ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")


def _clip(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.4 * np.sin(2 * np.pi * (200 + 13 * seed) * t) + 0.1 * rng.standard_normal(len(t))).astype(np.float32)


async def engine_times(folder: Path, clips: list[np.ndarray], tokens: int,
                       rounds: int) -> tuple[list[float], list[float]]:
    import engine
    from engine.multimodal import AudioClip

    # Each running clip holds its cross-attention keys and values (whisper-base: 37 MB in
    # float32), counted in the KV budget: 1 GiB lets all eight run at once.
    async with engine.open_engine(str(folder), dtype="float32", kv_cache_memory=2**30,
                                  max_num_seqs=len(clips)) as eng:
        prompt = [eng.tokenizer.token_to_id(t) for t in TASK]
        params = engine.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

        async def one(wave: np.ndarray) -> None:
            stream = eng.enqueue(await eng.prepare(prompt, params, images=[AudioClip((wave, 16000))]))
            async with stream:
                n = sum([len(o.token_ids) async for o in stream])
            assert n == tokens, n

        async def batch(waves: list[np.ndarray]) -> float:
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for w in waves:
                    nursery.start_soon(one, w)
            return time.perf_counter() - t0

        await batch(clips[:1])  # warm-up
        single = [await batch([w]) for _ in range(rounds) for w in clips[:2]]
        many = [await batch(clips) for _ in range(rounds)]
    return single, many


def hf_times(folder: Path, clips: list[np.ndarray], tokens: int, rounds: int) -> tuple[list[float], list[float]]:
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    prompt = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(list(TASK))

    def batch(waves: list[np.ndarray]) -> float:
        t0 = time.perf_counter()
        features = extractor(waves, sampling_rate=16000, return_tensors="pt").input_features
        with torch.no_grad():
            out = model.generate(features, decoder_input_ids=torch.tensor([prompt] * len(waves)),
                                 max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        assert out.shape[1] >= tokens, out.shape
        return time.perf_counter() - t0

    batch(clips[:1])  # warm-up
    single = [batch([w]) for _ in range(rounds) for w in clips[:2]]
    many = [batch(clips) for _ in range(rounds)]
    return single, many


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from engine.models.testing_audio import write_tiny_whisper

    clips = [_clip(i, args.seconds) for i in range(args.clips)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_whisper(Path(tmp) / "whisper-base-shape", d_model=512, layers=6, heads=8,
                                    ffn=2048, mel_bins=80, seconds=30, positions=448)
        # transformers' Whisper generate reads language, task and timestamp fields from
        # generation_config.json and then runs its long-form loop; both sides here decode
        # the given prompt greedily, no more: only the tokens' ids stay.
        gen = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps(
            {k: gen[k] for k in ("bos_token_id", "eos_token_id", "decoder_start_token_id")}))
        print(f"whisper-base's shape, random weights; {args.clips} clips of {args.seconds:g} s, "
              f"{args.tokens} tokens each; float32; torch threads {torch.get_num_threads()}; "
              f"medians of {args.rounds} rounds")
        ours = trio.run(engine_times, folder, clips, args.tokens, args.rounds)
        theirs = hf_times(folder, clips, args.tokens, args.rounds)
    print(f"{'load':>16} {'engine s':>9} {'transformers s':>15} {'ratio':>7} {'engine tok/s':>13}")
    for name, n, a, b in (("one clip", 1, ours[0], theirs[0]), (f"{args.clips} at once", args.clips, ours[1], theirs[1])):
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{name:>16} {ma:9.3f} {mb:15.3f} {mb / ma:6.2f}x {n * args.tokens / ma:13.1f}")


if __name__ == "__main__":
    main()
