"""Fidelity of the real SmolLM2 Q4_1 file served with its blocks kept (the default) against
the same file dequantized to fp32 (``quantization="none"``).

Both models hold the same weight values (the loader tests check that the kept blocks
dequantize to exactly the converter's weights), so every difference comes from how the
kernels round activations: below 16 tokens (decode) each activation is rounded to the
nearest step of amax / 127 of its 32-column block, an error of at most 0.4% of the
block's largest entry (llama.cpp rounds activations the same way for its quantized dot
products); from 16 tokens on a CPU with AMX-BF16 activations and dequantized weights are
rounded to bf16 (relative 2**-9). Activations run in fp32 otherwise on both sides, so the
dense side is the exact reference.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.models.loader import default_model_path, load_model
from engine.models.tokenizer import Tokenizer
from engine.ops import AttentionMetadata, get_ops
from engine.ops.cpu import qmatmul as cq
from engine.runner.model_runner import ModelRunner

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cq.available(), reason="C kernels not built"),
]

TEXT = Path(__file__).parent / "data" / "perplexity_en.txt"  # prose written for this test
BLOCK = 16

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans to walk on the Moon were",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def models():
    path = default_model_path()
    kept = load_model(path, dtype="float32")
    dense = load_model(path, dtype="float32", quantization="none")
    assert kept.quantization == "gguf" and dense.quantization == "none"
    tok = Tokenizer.from_folder(dense.folder)
    max_len = 3072
    runners = [
        ModelRunner(m, device="cpu", ops=get_ops("cpu"), num_blocks=max_len // BLOCK, block_size=BLOCK,
                    max_num_batched_tokens=max_len, max_num_seqs=1)
        for m in (kept, dense)
    ]
    return runners, tok


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prompt run as one chunk."""
    n = len(ids)
    table = list(range(-(-n // BLOCK)))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([table], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
        query_lens_host=(n,),
        seq_lens_host=(n,),
    )
    hidden = runner.model.forward(torch.tensor(ids), torch.arange(n), meta, runner.kv_caches)
    return runner.model.compute_logits(hidden)


def test_logits_stay_within_activation_rounding_of_the_dequantized_model(models):
    """Tolerances, about 1.5x the worst measured over 25 prompts (these 5 and 20 more, 201
    positions): the logit gap at most 15% of the row's logit range (max - min; measured at
    most 11.3%), top-1 agreement at least 90% (measured 96%), and where the top tokens
    differ, the dense model's choice at most 0.5 nats below the quantized model's (measured
    0.31 at worst; 4 of 201 positions above 0.05).

    The kept model quantizes its activations to int8 per 32 columns before every matmul, so
    a change in the last bit of any input (an attention kernel summing in another order)
    moves a few codes by one step, and 30 layers carry that far: these maxima are samples
    of a noisy quantity. Replacing the decode-attention kernel (same results to ~1e-6 of
    the reference) moved this test's worst regret from 0.09 to 0.31 and the wider set's
    from 0.18 to 0.31 (agreement 96.0% to 96.5%), where the earlier bounds (0.1 nats, 6%)
    had been set on these 5 prompts alone. A broken kernel moves logits by whole units and
    drops agreement far below 90%. The kernels themselves are checked against the torch
    reference in test_quant."""
    (kept, dense), tok = models
    gaps, agree, total = [], 0, 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.inference_mode():
            q, d = prefill_logits(kept, ids), prefill_logits(dense, ids)
        span = (d.amax(-1) - d.amin(-1)).unsqueeze(-1)
        gaps.append(((q - d).abs() / span).amax().item())
        lq, ld = torch.log_softmax(q, -1), torch.log_softmax(d, -1)
        best_dense = ld.argmax(-1)
        regret = lq.amax(-1) - lq.gather(-1, best_dense.unsqueeze(-1)).squeeze(-1)
        assert float(regret.max()) <= 0.5, prompt
        agree += int((lq.argmax(-1) == best_dense).sum())
        total += len(ids)
    assert max(gaps) <= 0.15, gaps
    assert agree / total >= 0.9, agree / total


def test_perplexity_within_one_percent_of_the_dequantized_model(models):
    """Measured over the 2598-token text: 26.79 kept vs 26.80 dequantized (-0.05%) with the
    AMX-BF16 prefill of this CPU, 26.96 (+0.6%) with the int8 kernels (CPUs without AMX)."""
    (kept, dense), tok = models
    ids = tok.encode(TEXT.read_text(encoding="utf-8"))
    assert 2000 <= len(ids) <= 3072, len(ids)
    ppl = []
    for runner in (kept, dense):
        with torch.inference_mode():
            logits = prefill_logits(runner, ids)
        nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
        ppl.append(math.exp(nll.item()))
    q, d = ppl
    assert abs(q - d) / d <= 0.01, (q, d)
