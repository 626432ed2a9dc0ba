"""Quantized Hugging Face checkpoints load dequantized: DeepSeek-V3's and Qwen3-FP8's
block-scaled fp8 (``quant_method`` "fp8", ``weight_scale_inv``), llm-compressor's fp8
(``compressed-tensors`` "float-quantized": one ``weight_scale`` per tensor, per output
channel or per block), its int8 (``compressed-tensors`` "int-quantized": W8A8's weights,
per channel or per group of columns) and its packed integers (``compressed-tensors``
"pack-quantized": W4A16 in groups of columns, symmetric or with zero points, W8A16 per
channel). Other quantization methods are refused
by name.

The checkpoints are written here from one tiny random model: each projection's weight as
codes and scales (fp8 blocks of 32 rows x 16 columns, not square, so a swap of the two
would show; transformers' loader needs blocks that divide the matrix; integers packed
into int32 words). The oracle is transformers loading the same folder and dequantizing
it (``FineGrainedFP8Config`` / ``CompressedTensorsConfig`` with ``dequantize=True``, the
latter through the compressed-tensors package's own decompressors): its weights, and its
greedy tokens."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from engine.models.loader import load_model
from engine.models.testing import write_tiny_model
from engine.models.testing_quant import LAYOUTS, write_quantized

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = (32, 16)
GROUP = 32  # W4A16's columns per scale


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fp8") / "dense", "llama")


@pytest.fixture(scope="module", params=LAYOUTS)
def fp8_folder(request: pytest.FixtureRequest, dense: Path) -> Path:
    return write_quantized(dense, dense.parent / request.param, request.param, block=BLOCK, group=GROUP)


def transformers_model(folder: Path) -> torch.nn.Module:
    method = json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"]
    config = (FineGrainedFP8Config(dequantize=True) if method == "fp8"
              else CompressedTensorsConfig(dequantize=True))
    with warnings.catch_warnings():
        # transformers warns that the folder's own quantization_config is used (with the
        # dequantize flag passed here), which is what is wanted.
        warnings.simplefilter("ignore", UserWarning)
        return AutoModelForCausalLM.from_pretrained(str(folder), quantization_config=config,
                                                    dtype=torch.float32).eval()


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
    ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_block_size must be two"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24"}, "format 'marlin-24'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}}, "type 'int' and 4 bits"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "g": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel",
                          "symmetric": False}}}}, "asymmetric"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
                          "actorder": "group"}}}}, "actorder 'group'"),
])
def test_other_quantization_methods_are_refused_by_name(dense: Path, tmp_path: Path,
                                                        quant: dict, words: str) -> None:
    folder = tmp_path / "m"
    shutil.copytree(dense, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    with pytest.raises(UnsupportedModelError, match=words):
        load_model(folder)


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel", "ct-w4-group", "ct-w4-asym", "ct-int8-group"])
def test_tensor_parallel_ranks_read_their_cuts_dequantized(dense: Path, layout: str) -> None:
    """Two ranks read their rows and columns of each quantized weight (lazily, the codes
    and the scales that cover them): the tokens of transformers' dequantized model."""
    folder = dense.parent / layout
    if not folder.exists():
        write_quantized(dense, folder, layout, block=BLOCK, group=GROUP)
    model = transformers_model(folder)
    prompt = [4, 9, 16, 25]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    with LLM(str(folder), dtype="float32", tensor_parallel_size=2) as llm:
        (out,) = llm.generate({"prompt_token_ids": prompt},
                              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == want.tolist()
