"""Qwen3.5 GGUFs (llama.cpp's ``qwen35`` and ``qwen35moe``) against transformers.

The files are written here as llama.cpp's converter writes them, from the tiny models
transformers builds and saves: tensor names from the gguf package's own table for the
architecture (``gguf.get_tensor_name_map``, what llama.cpp reads), and the converter's
changes to the values, written out from what it does: A_log stored as ``-exp(A_log)``,
dt_bias as ``ssm_dt.bias``, the convolution kernels without their middle axis, every norm
but the DeltaNet's gated one as ``1 + w``, and each key head's value heads reordered from
grouped to tiled (the value rows of ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``/``a``,
A_log, dt_bias, the convolution's value channels and ``out_proj``'s columns). The engine
then reads the file (converted, and with its blocks kept) and must give transformers'
greedy tokens and logprobs for the Hugging Face model it came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hf_written import (
    assert_chunked_greedy_matches,
    assert_greedy_matches,
    assert_kept_blocks_match_dequantized,
    write_hf_model,
)
from hybrid_helpers import assert_engine_matches, draw_mamba_parameters, prompts_of
from safetensors.torch import load_file
from test_loader import _add_tokenizer, quantize_array
from test_qwen3_5 import TINY

import engine
from engine.errors import ConfigError
from engine.models.layers.deltanet import DeltaNetMixer
from engine.models.layers.linear import QuantLinear
from engine.models.layers.shard import tensor_parallel_problem
from engine.models.loader import load_model
from engine.ops.cpu import qmatmul as cq

pytestmark = pytest.mark.usefixtures("one_thread")

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
# Without attention.recurrent_layers (which converters before it did not write) a file's
# layer kinds are full_attention_interval's: every interval-th layer attends. The models
# written without the list take that layout (three DeltaNet layers, then one); the others
# keep TINY's (an attention layer second).
LAYOUT = dict(layer_types=None, full_attention_interval=4)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))


def write_dense(folder: Path, layout: dict[str, Any] | None = None) -> Any:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**(TINY | (layout or {})))
    return write_hf_model(draw_mamba_parameters(Qwen3_5ForCausalLM(config)), folder, norms=True)


def write_moe(folder: Path) -> Any:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    fields = {k: v for k, v in (TINY | LAYOUT).items() if k != "intermediate_size"}  # the layout by interval
    config = Qwen3_5MoeTextConfig(**fields, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48)
    return write_hf_model(draw_mamba_parameters(Qwen3_5MoeForCausalLM(config)), folder, norms=True)


def as_stored(hf: Any) -> Any:
    """``hf`` with the values the file holds: its norms and A_log through the converter's
    fp32 ``1 + w`` and ``-exp`` and back (a norm weight near 1 keeps a bit less as ``1 + w``),
    so that the oracle and the engine start from the same numbers."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                p.copy_((p.float() + 1.0) - 1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.exp(p.float())))  # log(-(-exp(A_log)))
    return hf


def _tiled(t: np.ndarray, axis: int, k_heads: int, per: int, width: int) -> np.ndarray:
    """llama.cpp's value-head reorder along ``axis``: [key head, its value head, width]
    becomes [value head, key head, width]."""
    t = np.moveaxis(t, axis, 0)
    rest = t.shape[1:]
    t = t.reshape(k_heads, per, width, *rest).swapaxes(0, 1).reshape(k_heads * per * width, *rest)
    return np.ascontiguousarray(np.moveaxis(t, 0, axis))


def _converted(name: str, array: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """One Hugging Face tensor as llama.cpp's converter stores it (see the module docstring)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, per = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    if name.endswith("linear_attn.A_log"):
        array = -np.exp(array)
    elif name.endswith("linear_attn.conv1d.weight"):
        array = array.squeeze(1)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        array = array + 1
    if ".linear_attn." not in name or per == 1:
        return array
    if name.endswith("in_proj_qkv.weight"):
        return np.concatenate([array[:2 * nk * dk], _tiled(array[2 * nk * dk:], 0, nk, per, dv)])
    if name.endswith("conv1d.weight"):
        return np.concatenate([array[:2 * nk * dk], _tiled(array[2 * nk * dk:], 0, nk, per, dv)])
    if name.endswith("in_proj_z.weight"):
        return _tiled(array, 0, nk, per, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return _tiled(array, 0, nk, per, 1)
    if name.endswith("out_proj.weight"):
        return _tiled(array, 1, nk, per, dv)
    return array


def write_qwen35_gguf(folder: Path, out: Path, *, quant: gguf.GGMLQuantizationType = F32,
                      dense_ba: bool = False, mtp: bool = False, layer_list: bool = True,
                      fuse_gate_up: bool = False) -> Path:
    """The GGUF llama.cpp's converter makes of the Qwen3.5 folder ``folder``: matrices in
    ``quant`` where their rows are whole blocks (else F32, as llama.cpp's quantizer falls
    back), the convolution kernels and vectors F32; ``dense_ba``: ``ssm_alpha`` and
    ``ssm_beta`` F32 beside quantized ones; ``mtp``: a multi-token-prediction block after
    the decoder's, as the converter appends one (counted in block_count, named by
    ``nextn_predict_layers``; here an attention layer's tensors and nextn's own, drawn);
    ``layer_list``: the blocks' kinds listed (``attention.recurrent_layers``), as the
    converter writes them now, else ``full_attention_interval`` alone, as it did before;
    ``fuse_gate_up``: each layer's expert gate and up stacks as one tensor, each expert's
    gate rows then its up rows (the converter's ``--fuse-gate-up-exps``)."""
    cfg = json.loads((folder / "config.json").read_text())
    moe = "num_experts" in cfg
    arch = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg["num_hidden_layers"] + int(mtp))
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if not moe:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    # Qwen3NextModel's keys, as its converter writes them.
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    interval = cfg.get("full_attention_interval", 4)  # the converter's default, as transformers saves none
    if layer_list:
        w.add_array(f"{w.arch}.attention.recurrent_layers",
                    [t == "linear_attention" for t in cfg["layer_types"]] + [False] * int(mtp))
    else:
        assert cfg["layer_types"] == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                      for i in range(cfg["num_hidden_layers"])]
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    if moe:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    # The tiny tokenizer's ids (transformers' Qwen3.5 configs name none).
    _add_tokenizer(w, folder, cfg | {"bos_token_id": 0, "eos_token_id": 2})

    def add(gname: str, array: np.ndarray, *, dense: bool = False) -> None:
        qtype = quant if array.ndim == 2 and not dense and array.shape[-1] % 32 == 0 else F32
        w.add_tensor(gname, quantize_array(array.astype(np.float32), qtype), raw_dtype=qtype)

    stored = {k: v.numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    done: set[str] = set()
    for name, array in stored.items():
        if name in done:
            continue
        if ".mlp.experts." in name:  # each layer's experts stacked, one tensor a projection
            prefix = name.split(".mlp.experts.")[0]
            stacks = {}
            for proj in ("gate_proj", "up_proj", "down_proj"):
                parts = [f"{prefix}.mlp.experts.{e}.{proj}.weight" for e in range(cfg["num_experts"])]
                stacks[proj] = np.stack([stored[p] for p in parts])
                done.update(parts)
            if fuse_gate_up:
                layer = int(prefix.rsplit(".", 1)[1])
                fused = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_UP_EXP].format(bid=layer) + ".weight"
                add(fused, np.concatenate([stacks.pop("gate_proj"), stacks.pop("up_proj")], axis=1), dense=True)
            for proj, stack in stacks.items():
                add(names.get_name(f"{prefix}.mlp.experts.{proj}") + ".weight", stack, dense=True)
            continue
        stem, suffix = (name[:-len(".weight")], ".weight") if name.endswith(".weight") else (name, "")
        if stem.endswith("linear_attn.dt_bias"):  # the converter's rename first
            stem, suffix = stem.replace("dt_bias", "dt_proj"), ".bias"
        gname = names.get_name(stem)
        assert gname is not None, name
        value = _converted(name, array, cfg)
        if name.endswith("shared_expert_gate.weight"):
            value = value.reshape(-1)  # 1-D in llama.cpp's files
        add(gname + suffix, value, dense=(dense_ba and name.endswith(("in_proj_a.weight", "in_proj_b.weight")))
            or name.endswith("mlp.gate.weight"))
    if mtp:
        # An attention layer's tensors (as an MTP block has), and nextn's own.
        last, extra = cfg["num_hidden_layers"] - 1, np.random.default_rng(3)
        source = cfg["layer_types"].index("full_attention")
        for name, array in stored.items():
            if name.startswith(f"model.layers.{source}.") and ".mlp.experts." not in name:
                stem = names.get_name(name.removesuffix(".weight"))
                add(stem.replace(f"blk.{source}.", f"blk.{last + 1}.") + ".weight", _converted(name, array, cfg))
        hidden = cfg["hidden_size"]
        for nextn, shape in (("eh_proj", (hidden, 2 * hidden)), ("enorm", (hidden,)), ("hnorm", (hidden,)),
                             ("shared_head_norm", (hidden,))):
            add(f"blk.{last + 1}.nextn.{nextn}.weight", extra.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Any, Path]:
    root = tmp_path_factory.mktemp("qwen35_gguf")
    hf = write_dense(root / "hf")
    return as_stored(hf), write_qwen35_gguf(root / "hf", root / "m.gguf")


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_an_f32_gguf_matches_transformers(dense, ops: str) -> None:
    hf, path = dense
    loaded = assert_greedy_matches(hf, path, ops, fused=False)
    net = loaded.config.deltanet
    c = hf.config  # the layout transformers built the model with, read back from the file
    assert net is not None and net.tiled
    assert net.layers == tuple(i for i, t in enumerate(c.layer_types) if t == "linear_attention")
    assert (net.num_k_heads, net.num_v_heads, net.k_head_dim, net.v_head_dim) == (
        c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    assert loaded.config.head_dim == c.head_dim
    assert loaded.config.rotary_dim == int(c.head_dim * c.rope_parameters["partial_rotary_factor"])
    assert_chunked_greedy_matches(hf, path, ops, prompts=2, chunk_size=5)


def test_a_multi_token_prediction_block_is_left_unread(tmp_path: Path) -> None:
    """The block after the decoder's is not a fifth layer: the same tokens as without it,
    kept in blocks too."""
    hf = as_stored(write_dense(tmp_path / "hf"))
    path = write_qwen35_gguf(tmp_path / "hf", tmp_path / "mtp.gguf", quant=Q8_0, mtp=True)
    loaded = assert_greedy_matches(hf, write_qwen35_gguf(tmp_path / "hf", tmp_path / "m.gguf", mtp=True), "cpu",
                                   fused=False)
    assert loaded.config.num_hidden_layers == 4
    kept = load_model(path, dtype="float32")
    assert kept.quantization == "gguf" and not any(".layers.4." in n for n in kept.weights)


@pytest.mark.parametrize("fuse_gate_up", [False, True], ids=["gate-up-apart", "gate-up-fused"])
def test_the_moe_gguf_matches_transformers(tmp_path: Path, fuse_gate_up: bool) -> None:
    """On the torch reference ops: over the C kernels this model's logprobs part from
    transformers' by up to 1.1e-4 at one token, from its Hugging Face folder as from the
    GGUF (the summation order of its experts), past the 1e-4 the parity tests hold. The
    experts' gate and up stacks apart, or fused into one tensor; read converted and kept."""
    hf = write_moe(tmp_path / "hf")
    path = write_qwen35_gguf(tmp_path / "hf", tmp_path / "m.gguf", layer_list=False, fuse_gate_up=fuse_gate_up)
    as_stored(hf)
    loaded = assert_greedy_matches(hf, path, "torch", fused=False)
    moe = loaded.config.moe
    c = hf.config
    assert moe is not None and moe.sparse_layers == tuple(range(c.num_hidden_layers)) and moe.norm_topk_prob
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (
        c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size)
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for kept in (load_model(path, dtype="float32"), load_model(path, dtype="float32", quantization="none")):
        for e in (0, 7):  # each expert's own rows, the gate's before the up's
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
                assert torch.equal(kept.weights[name].float(), stored[name]), name


async def test_the_engine_serves_it_batched_chunked_and_preempted(dense) -> None:
    hf, path = dense
    stats = await assert_engine_matches(hf, path, prompts_of((17, 21, 12, 19), 384, seed=21))
    assert stats.preemptions > 0


@pytest.mark.skipif(not cq.available(), reason="C kernels not built")
@pytest.mark.parametrize("dense_ba", [False, True], ids=["all-q8_0", "f32-alpha-beta"])
def test_a_q8_0_gguf_keeps_its_blocks_and_matches_the_dequantized_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dense_ba: bool) -> None:
    """The DeltaNet's projections keep their blocks; with F32 ``ssm_alpha`` / ``ssm_beta``
    beside Q8_0 ``attn_qkv`` / ``attn_gate`` the two groups are two matmuls, the blocks
    still kept. Over the torch reference matmul, the same greedy tokens and logprobs as the
    file dequantized, prefilled in chunks."""
    write_dense(tmp_path / "hf")
    path = write_qwen35_gguf(tmp_path / "hf", tmp_path / "q8.gguf", quant=Q8_0, dense_ba=dense_ba)

    def check(runner: Any) -> None:
        mixers = [layer.mixer for layer in runner.model.layers if hasattr(layer, "mixer")]
        assert len(mixers) == 3 and all(isinstance(m, DeltaNetMixer) for m in mixers)
        for m in mixers:
            assert isinstance(m.in_proj, QuantLinear) and isinstance(m.out_proj, QuantLinear)
            assert (m.ba_proj is not None) == dense_ba

    assert_kept_blocks_match_dequantized(path, monkeypatch, check)


async def test_tiled_value_heads_are_refused_over_tensor_parallel_ranks(dense) -> None:
    """The same heads in Hugging Face's order split (test_qwen3_5); in llama.cpp's a rank's
    key heads' value heads are not one run of rows: refused at startup, by name."""
    _, path = dense
    assert tensor_parallel_problem(load_model(path, dtype="float32").config, 1) is None
    with pytest.raises(ConfigError, match="tiled order") as caught:
        async with engine.open_engine(str(path), dtype="float32", tensor_parallel_size=2):
            pass
    assert caught.value.field == "tensor_parallel_size"
