"""SmolVLM: the time to first token of one picture plus a 64-token question, the engine
beside transformers, same model, same run (bench/vision.py is the same measurement for
LLaVA; this reuses its parts).

    python bench/vision_smolvlm.py                           # SmolVLM-256M's tower, 2 of its 12 layers
    python bench/vision_smolvlm.py --layers 12 --longest-edge 2048

The model: a random-weight SmolVLM whose tower has SmolVLM-256M's shape (768 wide, 12
heads, 3,072 in the MLP, 512-pixel tiles in patches of 16, pixel-shuffled 4 x 4 into 64
tokens a tile) with ``--layers`` of its 12 layers, before the tiny Llama decoder, so the
time is the picture's. The image processor resizes the picture's longest edge to
``--longest-edge`` and cuts it into 512-pixel tiles plus the whole picture as one more.
TTFT: a new square picture each time, ``max_tokens`` 1, the embedded engine against
transformers' ``Idefics3Processor`` + ``generate(max_new_tokens=1)``; medians of
``--repeats``.
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

from bench.vision import _image, _question, engine_ttft  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="tower layers of SmolVLM-256M's 12")
    parser.add_argument("--longest-edge", type=int, default=1024,
                        help="the processor's resize (SmolVLM's own: 2048, 17 tiles of a square picture)")
    parser.add_argument("--size", type=int, default=640, help="the picture's side in pixels")
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.dtype, args.device = "float32", "cpu"
    from engine.models.testing_idefics3 import write_tiny_idefics3
    from tests.test_idefics3 import hf_model

    with tempfile.TemporaryDirectory() as tmp:
        tower = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=args.layers,
                     num_attention_heads=12, patch_size=16)
        folder = write_tiny_idefics3(Path(tmp) / "smolvlm", vision=tower, tile=512,
                                     longest_edge=args.longest_edge, scale_factor=4)
        hf, processor = hf_model(folder)
        question = _question(processor.tokenizer, args.question_tokens)
        times, _ = trio.run(engine_ttft, args, folder, question, args.size)
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        hf_times = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            inputs = processor(text=text, images=[[_image(2000 + i, args.size)]], return_tensors="pt")
            inputs.pop("mm_token_type_ids", None)
            with torch.no_grad():
                hf.generate(**inputs, max_new_tokens=1, do_sample=False)
            if i:
                hf_times.append(time.perf_counter() - t0)
        tiles = int(inputs["pixel_values"].shape[1])
        print(f"SmolVLM-256M's tower, {args.layers} of 12 layers, random weights; a {args.size} x "
              f"{args.size} picture, longest edge {args.longest_edge}: {tiles} tiles, prompt "
              f"{inputs['input_ids'].shape[1]} tokens; float32, torch threads {torch.get_num_threads()}")
        ours, theirs = statistics.median(times), statistics.median(hf_times)
        print(f"{'TTFT ms (median)':24}{'engine':>10}{'transformers':>14}{'ratio':>8}")
        print(f"{'':24}{ours * 1e3:10.1f}{theirs * 1e3:14.1f}{theirs / ours:7.2f}x")


if __name__ == "__main__":
    main()
