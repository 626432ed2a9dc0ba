"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL: images/s through the vision tower and the time to first
token of one image plus a 64-token question, the engine beside transformers, same model,
same run (bench/vision.py is the same measurement for LLaVA; this reuses its parts).

    python bench/vision_qwen.py                        # a tiny random Qwen2-VL in a temp dir
    python bench/vision_qwen.py --arch qwen2_5_vl      # a tiny random Qwen2.5-VL
    python bench/vision_qwen.py --arch qwen3_vl --tower 2b --layers 6 --size 448
                                                       # Qwen3-VL-2B's tower, 6 of its 24 blocks
    python bench/vision_qwen.py --model PATH --dtype bfloat16 --device cuda --size 448

Encoder: ``--images`` square images of ``--size`` pixels, preprocessed once by the
folder's ``Qwen2VLImageProcessor``, through the engine's ``QwenVLModel.encode_image_inputs``
and transformers' ``get_image_features`` in batches of ``--batch``, best of ``--repeats``.
TTFT: as bench/vision.py (a new image each time, ``max_tokens`` 1, the embedded engine
against transformers' processor + ``generate(max_new_tokens=1)``), median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.vision import _best, _image, _question, engine_ttft  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Qwen2-VL / Qwen2.5-VL folder (default: a tiny random one)")
    parser.add_argument("--arch", default="qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl", "qwen3_vl"),
                        help="the tiny model's kind when --model is not given")
    parser.add_argument("--tower", choices=("tiny", "2b"), default="tiny",
                        help="qwen3_vl: the tiny tower, or Qwen3-VL-2B's (1,024 wide, 16 heads, "
                             "4,096 in the MLP, patches of 16, a 48 x 48 position grid)")
    parser.add_argument("--layers", type=int, default=24, help="--tower 2b: blocks of its 24 kept")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=56, help="image side in pixels")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    from engine.messages import ImageInput
    from engine.models.testing import write_tiny_qwen_vl
    from engine.models.testing_qwen3_vl import write_tiny_qwen3_vl
    from tests import test_qwen3_vl, test_qwen_vl
    from tests.test_qwen_vl import IMAGE_TEXT

    tmp = None
    folder = Path(args.model) if args.model else None
    if folder is None:
        tmp = tempfile.TemporaryDirectory()
        if args.arch == "qwen3_vl":
            tower = None
            if args.tower == "2b":  # deepstack at its blocks 5, 11, 17, those kept
                tower = dict(depth=args.layers, hidden_size=1024, intermediate_size=4096, num_heads=16,
                             patch_size=16, num_position_embeddings=2304,
                             deepstack_visual_indexes=[i for i in (5, 11, 17) if i < args.layers])
            folder = write_tiny_qwen3_vl(Path(tmp.name) / args.arch, vision=tower,
                                         max_pixels=max(args.size, 64) ** 2)
        else:
            folder = write_tiny_qwen_vl(Path(tmp.name) / args.arch, args.arch)
    qwen3 = AutoConfig.from_pretrained(folder).model_type.startswith("qwen3")
    hf_model = (test_qwen3_vl if qwen3 else test_qwen_vl).hf_model
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    question = _question(tokenizer, args.question_tokens)

    times, eng_model = trio.run(engine_ttft, args, folder, question, args.size)
    hf, processor = hf_model(folder)
    hf = hf.to(args.device, dtype)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    batches = []
    for at in range(0, args.images, args.batch):
        images = [_image(i, args.size) for i in range(at, min(at + args.batch, args.images))]
        out = image_processor(images=images, return_tensors="pt")
        pixels, grids = out["pixel_values"].float(), out["image_grid_thw"]
        per = (grids.prod(-1)).tolist()
        inputs = [ImageInput(0, 0, 0, p.numpy().tobytes(), tuple(p.shape), tuple(g.tolist()))
                  for p, g in zip(pixels.split(per), grids, strict=True)]
        batches.append((inputs, pixels.to(args.device, dtype), grids.to(args.device)))

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def ours() -> None:
        for inputs, _, _ in batches:
            eng_model.encode_image_inputs(inputs)
        sync()

    def theirs() -> None:
        with torch.no_grad():
            for _, pixels, grids in batches:
                hf.model.get_image_features(pixel_values=pixels, image_grid_thw=grids)
        sync()

    ours(), theirs()  # warm-up
    ours_ips = args.images / _best(ours, args.repeats)
    hf_ips = args.images / _best(theirs, args.repeats)

    # The engine's prompt for [image, text] parts under the tiny model's ChatML template,
    # which reads content as a string: the parts joined with a newline.
    text = f"<|im_start|>user\n{IMAGE_TEXT}\n{question}<|im_end|>\n<|im_start|>assistant\n"
    hf_times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        inputs = processor(text=text, images=[_image(2000 + i, args.size)], return_tensors="pt").to(args.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False)
        if i:
            hf_times.append(time.perf_counter() - t0)
    kind = AutoConfig.from_pretrained(folder).model_type
    tower_note = f"; Qwen3-VL-2B's tower, {args.layers} of 24 blocks" if args.tower == "2b" else ""
    print(f"model {folder} ({kind}, {args.dtype}, {args.device}); image {args.size}x{args.size} "
          f"({int(grids[0].prod()) // 4} tokens{tower_note}); question {args.question_tokens} tokens, prompt "
          f"{inputs['input_ids'].shape[1]} tokens")
    print(f"{'':24}{'engine':>12}{'transformers':>14}")
    print(f"{'encoder images/s':24}{ours_ips:12.1f}{hf_ips:14.1f}")
    print(f"{'TTFT ms (median)':24}{statistics.median(times) * 1e3:12.1f}"
          f"{statistics.median(hf_times) * 1e3:14.1f}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
