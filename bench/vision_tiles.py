"""SmolVLM and InternVL, the models that cut a picture into tiles: the time to first token
of one picture plus a 64-token question, the engine beside transformers, same model, same
run (bench/vision.py is the same measurement for LLaVA; this reuses its parts).

    python bench/vision_tiles.py                             # SmolVLM-256M's tower, 2 of its 12 layers
    python bench/vision_tiles.py --layers 12 --longest-edge 2048
    python bench/vision_tiles.py --arch internvl             # InternVL3-1B's tower, 2 of its 24 layers

SmolVLM: a random-weight SmolVLM whose tower has SmolVLM-256M's shape (768 wide, 12
heads, 3,072 in the MLP, 512-pixel tiles in patches of 16, pixel-shuffled 4 x 4 into 64
tokens a tile) with ``--layers`` of its 12 layers, before the tiny Llama decoder, so the
time is the picture's. The image processor resizes the picture's longest edge to
``--longest-edge`` and cuts it into 512-pixel tiles plus the whole picture as one more.
InternVL: InternVL3-1B's InternViT-300M (1,024 wide, 16 heads, 4,096 in the MLP,
448-pixel tiles in patches of 14, 256 tokens a tile) with ``--layers`` of its 24, before
the tiny Qwen2; ``GotOcr2ImageProcessor`` crops the picture into up to 12 tiles and a
thumbnail. TTFT: a new square picture each time, ``max_tokens`` 1, the embedded engine
against transformers' processor + ``generate(max_new_tokens=1)``; medians of ``--repeats``.
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
    parser.add_argument("--arch", choices=("smolvlm", "internvl"), default="smolvlm")
    parser.add_argument("--layers", type=int, default=2, help="tower layers (of SmolVLM-256M's 12, InternViT's 24)")
    parser.add_argument("--longest-edge", type=int, default=1024,
                        help="the processor's resize (SmolVLM's own: 2048, 17 tiles of a square picture)")
    parser.add_argument("--size", type=int, default=640, help="the picture's side in pixels")
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.dtype, args.device = "float32", "cpu"
    from engine.models.testing_idefics3 import write_tiny_idefics3
    from engine.models.testing_internvl import write_tiny_internvl
    from tests import test_idefics3, test_internvl

    with tempfile.TemporaryDirectory() as tmp:
        if args.arch == "smolvlm":
            tower = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=args.layers,
                         num_attention_heads=12, patch_size=16)
            folder = write_tiny_idefics3(Path(tmp) / "smolvlm", vision=tower, tile=512,
                                         longest_edge=args.longest_edge, scale_factor=4)
            hf, processor = test_idefics3.hf_model(folder)
            name = f"SmolVLM-256M's tower, {args.layers} of 12 layers"
        else:
            tower = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=args.layers,
                         num_attention_heads=16, image_size=[448, 448], patch_size=[14, 14])
            folder = write_tiny_internvl(Path(tmp) / "internvl", vision=tower, max_patches=12,
                                         text={"max_position_embeddings": 8192})
            hf, processor = test_internvl.hf_model(folder, image_seq_length=256)
            name = f"InternVL3-1B's InternViT, {args.layers} of 24 layers"
        question = _question(processor.tokenizer, args.question_tokens)
        times, _ = trio.run(engine_ttft, args, folder, question, args.size)
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        hf_times = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            picture = _image(2000 + i, args.size)
            inputs = processor(text=text, images=[[picture]] if args.arch == "smolvlm" else [picture],
                               return_tensors="pt")
            inputs.pop("mm_token_type_ids", None)
            with torch.no_grad():
                hf.generate(**inputs, max_new_tokens=1, do_sample=False)
            if i:
                hf_times.append(time.perf_counter() - t0)
        pv = inputs["pixel_values"]
        tiles = int(pv.shape[1] if pv.dim() == 5 else pv.shape[0])
        edge = f", longest edge {args.longest_edge}" if args.arch == "smolvlm" else ""
        print(f"{name}, random weights; a {args.size} x {args.size} picture{edge}: {tiles} tiles, prompt "
              f"{inputs['input_ids'].shape[1]} tokens; float32, torch threads {torch.get_num_threads()}")
        ours, theirs = statistics.median(times), statistics.median(hf_times)
        print(f"{'TTFT ms (median)':24}{'engine':>10}{'transformers':>14}{'ratio':>8}")
        print(f"{'':24}{ours * 1e3:10.1f}{theirs * 1e3:14.1f}{theirs / ours:7.2f}x")


if __name__ == "__main__":
    main()
