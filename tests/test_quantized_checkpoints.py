"""Quantized Hugging Face checkpoints load dequantized: DeepSeek-V3's and Qwen3-FP8's
block-scaled fp8 (``quant_method`` "fp8", ``weight_scale_inv``), llm-compressor's fp8
(``compressed-tensors`` "float-quantized": one ``weight_scale`` per tensor, per output
channel or per block), its int8 (``compressed-tensors`` "int-quantized": W8A8's weights,
per channel or per group of columns) and its packed integers (``compressed-tensors``
"pack-quantized": W4A16 in groups of columns, W8A16 per channel). Other quantization methods are refused
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
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from engine.models.loader import load_model
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = (32, 16)
LAYOUTS = ("fp8-block", "ct-tensor", "ct-channel", "ct-block", "ct-w4-group", "ct-w8-channel",
           "ct-int8-channel", "ct-int8-group")
GROUP = 32  # W4A16's columns per scale


def _scales(w: torch.Tensor, layout: str) -> torch.Tensor:
    """One scale per tensor, per row or per block of ``w``, so its largest value is
    e4m3's largest (448)."""
    a = w.float().abs()
    if layout == "ct-tensor":
        return a.max().clamp(min=1e-12).reshape(1) / 448.0
    if layout == "ct-channel":
        return a.amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    rows, cols = w.shape
    blocks = a.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    return blocks.amax(dim=(1, 3)).clamp(min=1e-12) / 448.0


def _compressed_tensors(fmt: str, weights: dict, activations: str | None) -> dict:
    group = {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False, **weights}}
    if activations is not None:  # W8A8's and FP8-dynamic's: quantized per token as they run
        group["input_activations"] = {"num_bits": 8, "type": activations, "strategy": "token",
                                      "dynamic": True, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": group}}


def _quantization_config(layout: str) -> dict:
    if layout == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK)}
    grouped = layout in ("ct-int8-group", "ct-w4-group")
    ints = {"type": "int", "strategy": "group" if grouped else "channel",
            "group_size": GROUP if grouped else None}
    if layout.startswith("ct-int8"):
        return _compressed_tensors("int-quantized", {"num_bits": 8, **ints}, "int")
    if layout.startswith("ct-w"):
        return _compressed_tensors("pack-quantized", {"num_bits": 4 if grouped else 8, **ints}, None)
    weights = {"num_bits": 8, "type": "float", "strategy": layout.removeprefix("ct-")}
    if layout == "ct-block":
        weights["block_structure"] = list(BLOCK)
    return _compressed_tensors("float-quantized", weights, "float")


def _packed(w: torch.Tensor, bits: int, group: int) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized tensors of ``w``: symmetric ``bits``-bit integers,
    a scale per ``group`` columns, each value plus 2 ** (bits - 1) in int32 words, lowest
    bits first."""
    rows, cols = w.shape
    top = 2 ** (bits - 1) - 1
    scale = (w.float().reshape(rows, cols // group, group).abs().amax(-1) / top).clamp(min=1e-8)
    scale = scale.to(torch.float16)
    q = torch.round(w.float().reshape(rows, cols // group, group) / scale.float()[..., None])
    u = (q.clamp(-top - 1, top).reshape(rows, cols) + 2 ** (bits - 1)).to(torch.int64)
    per_word = 32 // bits
    words = torch.zeros(rows, cols // per_word, dtype=torch.int64)
    for j in range(per_word):
        words |= u[:, j::per_word] << (bits * j)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return {"weight_packed": words, "weight_scale": scale,
            "weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}


def write_fp8(dense: Path, out: Path, layout: str) -> Path:
    """``dense``'s checkpoint with every projection stored quantized in ``layout``."""
    shutil.copytree(dense, out)
    stored = {}
    for name, w in load_file(str(dense / "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            stored[name] = w
            continue
        base = name.removesuffix("weight")
        if layout.startswith("ct-int8"):
            group = GROUP if layout == "ct-int8-group" else w.shape[1]
            scale = (w.float().reshape(w.shape[0], -1, group).abs().amax(-1) / 127).to(torch.float16)
            codes = torch.round(w.float().reshape(w.shape[0], -1, group) / scale.float()[..., None])
            stored[name] = codes.clamp(-128, 127).reshape(w.shape).to(torch.int8)
            stored[base + "weight_scale"] = scale
            continue
        if layout in ("ct-w4-group", "ct-w8-channel"):
            bits, group = (4, GROUP) if layout == "ct-w4-group" else (8, w.shape[1])
            stored |= {base + k: v for k, v in _packed(w, bits, group).items()}
            continue
        scale = _scales(w, layout)
        per_element = (scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
                       if scale.dim() == 2 and scale.shape[1] > 1 else scale)
        stored[name] = (w.float() / per_element).to(torch.float8_e4m3fn)
        stored[base + ("weight_scale_inv" if layout == "fp8-block" else "weight_scale")] = scale
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _quantization_config(layout)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fp8") / "dense", "llama")


@pytest.fixture(scope="module", params=LAYOUTS)
def fp8_folder(request: pytest.FixtureRequest, dense: Path) -> Path:
    return write_fp8(dense, dense.parent / request.param, request.param)


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
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
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


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel", "ct-w4-group", "ct-int8-group"])
def test_tensor_parallel_ranks_read_their_cuts_dequantized(dense: Path, layout: str) -> None:
    """Two ranks read their rows and columns of each quantized weight (lazily, the codes
    and the scales that cover them): the tokens of transformers' dequantized model."""
    folder = dense.parent / layout
    if not folder.exists():
        write_fp8(dense, folder, layout)
    model = transformers_model(folder)
    prompt = [4, 9, 16, 25]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    with LLM(str(folder), dtype="float32", tensor_parallel_size=2) as llm:
        (out,) = llm.generate({"prompt_token_ids": prompt},
                              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == want.tolist()
