"""Vision-language models: images/s through the vision encoder and the time to first token
of one image plus a 64-token question, the engine beside transformers, same model, same run.

    python bench/vision.py                          # a tiny random LLaVA written to a temp dir
    python bench/vision.py --tower siglip           # the same over a SigLIP tower
    python bench/vision.py --model PATH --dtype bfloat16 --device cuda --images 32

Encoder: ``--images`` preprocessed images (the model's own image processor) through the
engine's ``LlavaModel.encode_images`` and through transformers'
``LlavaModel.get_image_features``, in batches of ``--batch``, best of ``--repeats``.
TTFT: a chat request with one image (a new image each time, so no prefix-cache hit and no
cached encoder output) and a question of ``--question-tokens`` tokens, ``max_tokens`` 1,
submitted to the embedded engine (decoding, preprocessing, tokenizing, prefill and the
first token) against transformers' processor + ``generate(max_new_tokens=1)`` on the same
input; the median of ``--repeats``. The two run one after the other, never at once.
"""

from __future__ import annotations

import argparse
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


def _image(seed: int, size: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _question(tokenizer, tokens: int) -> str:
    words = ("describe the colours shapes and objects you can see in this picture please "
             "and say where they are ").split()
    text = ""
    i = 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += words[i % len(words)] + " "
        i += 1
    return text.strip()


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_encoder(args, eng_model, hf_model, pixels: torch.Tensor) -> tuple[float, float]:
    def ours() -> None:
        for at in range(0, len(pixels), args.batch):
            eng_model.encode_images(pixels[at : at + args.batch])
        if pixels.is_cuda:
            torch.cuda.synchronize()

    def theirs() -> None:
        with torch.no_grad():
            for at in range(0, len(pixels), args.batch):
                hf_model.model.get_image_features(pixel_values=pixels[at : at + args.batch])
        if pixels.is_cuda:
            torch.cuda.synchronize()

    ours(), theirs()  # warm-up
    n = len(pixels)
    return n / _best(ours, args.repeats), n / _best(theirs, args.repeats)


async def engine_ttft(args, folder: Path, question: str, size: int) -> tuple[list[float], object]:
    import engine
    from tests.test_llava import data_url

    times = []
    async with engine.open_engine(str(folder), dtype=args.dtype, device=args.device,
                                  kv_cache_memory=256 * 2**20) as eng:
        params = engine.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for i in range(args.repeats + 1):
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(_image(1000 + i, size))}},
                {"type": "text", "text": question}]}]
            t0 = time.perf_counter()
            stream = await eng.submit(messages, params)
            async with stream:
                async for _ in stream:
                    break
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
        model = eng._parts.runner.model if eng._parts.runner is not None else None
        return times, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a LLaVA folder (default: a tiny random one)")
    parser.add_argument("--tower", choices=("clip", "siglip"), default="clip",
                        help="the tiny random model's vision tower (without --model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    from engine.models.testing import IMAGE_TOKEN, write_tiny_llava

    tmp = None
    folder = Path(args.model) if args.model else None
    if folder is None:
        tmp = tempfile.TemporaryDirectory()
        folder = write_tiny_llava(Path(tmp.name) / "tiny-llava", tower=args.tower)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    processor = AutoImageProcessor.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(args.device).eval()
    size = int(hf.config.vision_config.image_size) + 8
    question = _question(tokenizer, args.question_tokens)

    times, eng_model = trio.run(engine_ttft, args, folder, question, size)
    images = [_image(i, size) for i in range(args.images)]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"].to(args.device, dtype)
    ours_ips, hf_ips = bench_encoder(args, eng_model, hf, pixels)

    text = f"<|im_start|>user\n{IMAGE_TOKEN}\n{question}<|im_end|>\n<|im_start|>assistant\n"
    from transformers import LlavaProcessor

    full = LlavaProcessor(image_processor=processor, tokenizer=tokenizer,
                          patch_size=hf.config.vision_config.patch_size,
                          vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
                          # CLIP's CLS position; SigLIP has none
                          num_additional_image_tokens=int(
                              hf.config.vision_config.model_type == "clip_vision_model"),
                          image_token=IMAGE_TOKEN)
    hf_times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        inputs = full(text=text, images=[_image(2000 + i, size)], return_tensors="pt").to(args.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False)
        if i:
            hf_times.append(time.perf_counter() - t0)
    print(f"model {folder} ({args.dtype}, {args.device}); question {args.question_tokens} tokens, "
          f"prompt {inputs['input_ids'].shape[1]} tokens")
    print(f"{'':24}{'engine':>12}{'transformers':>14}")
    print(f"{'encoder images/s':24}{ours_ips:12.1f}{hf_ips:14.1f}")
    print(f"{'TTFT ms (median)':24}{statistics.median(times) * 1e3:12.1f}"
          f"{statistics.median(hf_times) * 1e3:14.1f}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
