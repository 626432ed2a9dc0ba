"""`python -m engine generate` through the actor engine, checked against transformers."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import tiny_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


def _run_generate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "engine", "generate", *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout, check=False,
    )


def _transformers_greedy(folder: Path, prompt: str, max_new_tokens: int, gguf_file: str | None = None) -> str:
    import torch
    from text_fixtures import smollm2_gguf, smollm2_transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    if gguf_file and folder / gguf_file == smollm2_gguf():
        hf = smollm2_transformers()  # read once per process (test_beam_search's too)
    else:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    # --ignore-eos: EOS is an ordinary token that does not stop generation. (min_new_tokens
    # would mask it instead, which changes the text.)
    pad = hf.generation_config.pad_token_id or tokenizer.pad_token_id or 0
    eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = None  # put back below: the model may be shared
    try:
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad,
            )
    finally:
        hf.generation_config.eos_token_id = eos
    assert out.shape[1] == ids.shape[1] + max_new_tokens
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_generate_prints_only_the_greedy_text(model: Path) -> None:
    prompt = "The quick brown fox"
    result = _run_generate(
        "--model", str(model), "--dtype", "float32", "--temperature", "0", "--ignore-eos",
        "--max-tokens", "8", "--kv-cache-memory", "4MiB", "--prompt", prompt,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == _transformers_greedy(model, prompt, 8) + "\n"


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_bad_input_gives_one_line_on_stderr_and_exit_code_2(model: Path, args: list[str], names: str) -> None:
    base = ["--model", str(model), "--kv-cache-memory", "4MiB", "--prompt", "Hi"]
    result = _run_generate(*base, *args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and names in lines[0], result.stderr


@pytest.mark.slow
def test_smollm2_generate_matches_transformers_greedy_fp32() -> None:
    from engine.models.loader import default_model_path

    gguf = default_model_path()
    prompt = "The capital of France is"
    # Token-for-token parity holds for the same (dequantized) weights; the kept-quantized
    # path rounds activations to int8 and is checked for fidelity in test_quant_fidelity.
    result = _run_generate(
        "--dtype", "float32", "--quantization", "none", "--temperature", "0", "--ignore-eos", "--max-tokens", "32",
        "--kv-cache-memory", "64MiB", "--prompt", prompt,
    )
    assert result.returncode == 0, result.stderr
    expected = _transformers_greedy(gguf.parent, prompt, 32, gguf_file=gguf.name)
    assert result.stdout == expected + "\n"


def test_kv_cache_memory_is_bytes_with_units_or_a_fraction_of_free_memory() -> None:
    from engine.cli import build_parser
    from engine.cli.args import config_from_args
    from engine.config import parse_memory

    assert parse_memory("0.5") == 0.5 and isinstance(parse_memory("1.0"), float)
    assert parse_memory("1073741824") == 2**30 and isinstance(parse_memory("1"), int)
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("2GB") == 2 * 10**9
    assert parse_memory("1.5GiB") == 3 * 2**29
    for bad in ("1.5", "0.0", "lots", "12XB"):  # 1.5 was once read as 1 byte
        with pytest.raises(argparse.ArgumentTypeError):
            parse_memory(bad)
    argv = ["generate", "--prompt", "Hi", "--kv-cache-memory", "0.25", "--max-num-seqs", "4"]
    config = config_from_args(build_parser(argv).parse_args(argv))
    assert (config.kv_cache_memory, config.max_num_seqs) == (0.25, 4)
