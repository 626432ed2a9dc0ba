"""Gemma 3 with images: the time to first token of one image plus a question, the engine
beside transformers on the same random-weight model in the same run, and what the image
tokens' two-way attention costs the engine's prefill.

    python bench/vision_gemma3.py [--repeats 5] [--question-tokens 64]

The model (written to a temp dir by engine.models.testing_gemma3): Gemma 3's layer at
hidden 1024, 8 layers (five sliding of 512 to one global), 8 query and 4 KV heads of 128,
MLP 2816; a 6-layer SigLIP of 768 at 448 pixels (32 x 32 patches) pooled to 256
placeholders, as Gemma 3 4B places them. TTFT: a chat request with a new image each time
(no prefix-cache hit, no cached encoder output), ``max_tokens`` 1, to the embedded engine
(decoding, preprocessing, tokenizing, the encoder, prefill, the first token), against
transformers' Gemma 3 processor + ``generate(max_new_tokens=1)`` on the same input; the
median of ``--repeats``. The engine is also timed with the two-way attention of the image
rows switched off (a causal prefill, which gives other answers: a diagnostic of its cost
only). The three run one after the other, never at once. fp32, the host's torch threads.
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
sys.path.insert(0, str(REPO / "bench"))

import vision as vision_bench  # noqa: E402

from engine.models.gemma import Gemma3VisionModel  # noqa: E402
from engine.models.testing_gemma3 import write_gemma3_vision  # noqa: E402
from tests.template_data import GEMMA_3, checkpoint_template  # noqa: E402

TEXT = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128, sliding_window=512,
            max_position_embeddings=4096)
TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=12)


def _question(tokens: int) -> str:
    return " ".join(["describe the colours and shapes you see"] * (tokens // 6 + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--question-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
    )

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_gemma3_vision(Path(tmp) / "gemma3", checkpoint_template(GEMMA_3),
                                     image_size=448, mm_tokens=256, text=TEXT, vision=TOWER)
        question = _question(args.question_tokens)
        run = argparse.Namespace(dtype="float32", device="cpu", repeats=args.repeats)
        ours, _ = trio.run(vision_bench.engine_ttft, run, folder, question, 480)
        attend = Gemma3VisionModel._attend
        Gemma3VisionModel._attend = lambda self, *a: super(Gemma3VisionModel, self)._attend(*a)
        try:
            causal, _ = trio.run(vision_bench.engine_ttft, run, folder, question, 480)
        finally:
            Gemma3VisionModel._attend = attend
        hf = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        processor = Gemma3Processor(image_processor=AutoImageProcessor.from_pretrained(folder),
                                    tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                    image_seq_length=256)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        theirs = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            inputs = processor(text=text, images=[vision_bench._image(2000 + i, 480)], return_tensors="pt")
            with torch.no_grad():
                hf.generate(**inputs, max_new_tokens=1, do_sample=False)
            if i:
                theirs.append(time.perf_counter() - t0)
        med = {name: statistics.median(t) * 1e3 for name, t in
               (("engine", ours), ("engine, image rows causal", causal), ("transformers", theirs))}
        print(f"prompt {inputs['input_ids'].shape[1]} tokens (256 image placeholders); torch threads "
              f"{torch.get_num_threads()}")
        for name, ms in med.items():
            print(f"TTFT {name:28} {ms:8.1f} ms (median of {args.repeats})")
        print(f"transformers / engine {med['transformers'] / med['engine']:.2f}x; the two-way image "
              f"attention adds {med['engine'] - med['engine, image rows causal']:.1f} ms "
              f"({(med['engine'] / med['engine, image rows causal'] - 1) * 100:.1f}%)")


if __name__ == "__main__":
    main()
