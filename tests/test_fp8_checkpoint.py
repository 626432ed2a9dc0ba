"""Block-scaled FP8 checkpoints (``quantization_config`` quant_method "fp8", Qwen3-FP8's
and DeepSeek-V3's format) load dequantized; other quantization methods are refused by
name.

The checkpoint is written here from a tiny random model: each projection's weight as
``float8_e4m3fn`` codes and a ``weight_scale_inv`` per block of 64 rows x 32 columns
(transformers' loader needs blocks that divide the matrix). The oracle is transformers
loading the same folder with ``FineGrainedFP8Config(dequantize=True)``: its dequantized
weights, and its greedy tokens."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from engine.models.loader import load_model
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = (64, 32)  # rows x columns: not square, so a swap of the two would show


def write_fp8(dense: Path, out: Path, block: tuple[int, int] = BLOCK) -> Path:
    """``dense``'s checkpoint with every projection stored as fp8 codes and block scales."""
    shutil.copytree(dense, out)
    weights = load_file(str(dense / "model.safetensors"))
    stored = {}
    for name, w in weights.items():
        if not name.endswith("proj.weight"):
            stored[name] = w
            continue
        rows, cols = w.shape
        scale = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        codes = torch.empty(rows, cols)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
                scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0  # e4m3's largest
                codes[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = part / scale[i, j]
        stored[name] = codes.to(torch.float8_e4m3fn)
        stored[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fp8")
    return write_fp8(write_tiny_model(base / "dense", "llama"), base / "fp8")


def transformers_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32).eval()


def test_the_weights_are_transformers_dequantized_ones(fp8_folder: Path) -> None:
    reference = transformers_model(fp8_folder).state_dict()
    loaded = load_model(fp8_folder, dtype="float32")
    assert loaded.quantization == "none" and loaded.dtype == torch.float32
    projections = [n for n in loaded.weights if n.endswith("proj.weight")]
    assert projections and not any(n.endswith("weight_scale_inv") for n in loaded.weights)
    for name, weight in loaded.weights.items():
        assert torch.equal(weight, reference[name].float()), name


def test_greedy_tokens_match_transformers(fp8_folder: Path) -> None:
    model = transformers_model(fp8_folder)
    prompt = [5, 6, 7, 8, 9]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
    with LLM(str(fp8_folder), dtype="float32") as llm:
        (out,) = llm.generate({"prompt_token_ids": prompt},
                              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == want.tolist()


@pytest.mark.parametrize("quant, words", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "without a weight_block_size"),
])
def test_other_quantization_methods_are_refused_by_name(fp8_folder: Path, tmp_path: Path,
                                                        quant: dict, words: str) -> None:
    folder = tmp_path / "m"
    shutil.copytree(fp8_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    with pytest.raises(UnsupportedModelError, match=words):
        load_model(folder)
