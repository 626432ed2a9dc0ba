"""The engine's model and runner against Hugging Face transformers, token for token.

Every tiny architecture greedy-decodes a batch of mixed-length prompts through the paged
runner (whole prompts, and chunked prefill whose chunks straddle block boundaries), once
with the torch reference ops and once with the CPU path's C kernels, and must produce
exactly the tokens of ``transformers``' greedy ``generate`` in fp32. Each token's
logprob must also match transformers' ``log_softmax`` of its logits.

Logprob tolerance, 1e-4 absolute: both sides compute in fp32 and differ only in summation
order (fused q/k/v and gate/up matmuls, paged attention over gathered blocks versus a dense
mask), which moves a logit by ~1e-6 per layer here; any real fault (a wrong rope position,
a missed norm weight, a masked key leaking in) moves logprobs by 1e-2 or more.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.models.config import ModelConfig
from engine.models.loader import default_model_path, load_model
from engine.models.testing import TINY_ARCHITECTURES, write_tiny_model
from engine.ops import get_ops
from engine.runner.model_runner import ModelRunner, run_greedy

NEW_TOKENS = 32
LOGPROB_ATOL = 1e-4  # see the module docstring


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny shapes gain nothing from a second thread, and on a shared 2-core box OpenMP
    # regions that wait for a descheduled thread cost ~10 ms each (measured: 10x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(vocab: int) -> list[list[int]]:
    # Lengths 1 to 23: one token, exactly one and two blocks of 4 / one of 8, one past a
    # block, and several blocks; seeded so failures reproduce.
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 4, 8, 9, 23)]


# The torch reference, and the CPU path's C kernels (what the engine runs on CPU).
OPS = ["torch", "cpu"]


def _runner(loaded: types.SimpleNamespace, block_size: int, ops: str) -> ModelRunner:
    return ModelRunner(
        loaded,
        device="cpu",
        ops=get_ops(ops),
        num_blocks=512 // block_size,
        block_size=block_size,
        max_num_batched_tokens=512,
        max_num_seqs=8,
    )


def _hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs for one prompt (no padding involved)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def _hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Generate exactly NEW_TOKENS: the engine side ignores EOS too.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def tiny(request, tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    loaded = types.SimpleNamespace(
        config=config, weights=load_file(str(folder / "model.safetensors")), dtype=torch.float32
    )
    hf = _hf_model(folder)
    prompts = _prompts(config.vocab_size)
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return loaded, prompts, expected


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize(
    ("block_size", "chunk_size"),
    [(4, None), (8, None), (4, 3), (8, 5)],
    ids=["bs4", "bs8", "bs4-chunk3", "bs8-chunk5"],
)
def test_greedy_tokens_and_logprobs_match_transformers(tiny, block_size, chunk_size, ops) -> None:
    loaded, prompts, expected = tiny
    runs = run_greedy(
        _runner(loaded, block_size, ops), prompts, NEW_TOKENS, chunk_size=chunk_size, block_size=block_size
    )
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


def test_tiny_models_do_not_degenerate(tiny) -> None:
    """A model that repeats one token would make every parity test above vacuous."""
    _, _, expected = tiny
    assert all(len(set(tokens)) > 1 for tokens, _ in expected)


@pytest.mark.slow
@pytest.mark.parametrize("ops", OPS)
def test_smollm2_gguf_greedy_matches_transformers(ops: str) -> None:
    """The real default model: 32 identical greedy tokens from the same dequantized weights.

    The engine's loader converts the GGUF once into a cached Hugging Face folder and
    transformers loads that folder; the loader's own tests check its dequantization
    against transformers' GGUF reader, so here only the model and runner are on trial.
    """
    loaded = load_model(default_model_path(), dtype="float32")
    hf = _hf_model(loaded.folder)
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    # and a bare "The capital of France is", as SmolLM2's tokenizer spells them.
    prompts = [
        [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
        [504, 3575, 282, 4649, 314],
    ]
    runner = _runner(loaded, 16, ops)
    runs = run_greedy(runner, prompts, NEW_TOKENS, chunk_size=7, block_size=16)
    for run, prompt in zip(runs, prompts, strict=True):
        want_tokens, want_logprobs = _hf_greedy(hf, prompt, NEW_TOKENS)
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        # 30 layers instead of 2: fp32 reordering noise grows, still far below a fault's.
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=1e-3, rtol=0)
