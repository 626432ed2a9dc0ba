"""GGUFs of the state-space families (llama.cpp's ``mamba``, ``mamba2``, ``falcon-h1`` and
``jamba``) against transformers.

The files are written here as llama.cpp's converter writes them, from the tiny models
transformers builds and saves (the families' own test writers): tensor names from the gguf
package's table for the architecture (``gguf.get_tensor_name_map``, what llama.cpp reads),
metadata under the converter's keys, and its changes to the values written out from what
it does: A_log stored as ``-exp(A_log)``; convolution kernels without their middle axis;
Mamba-2's A and D as ``[heads, 1]``, its gated norm ``[groups, width / groups]`` and its
dt bias as ``ssm_dt.bias``; Jamba's experts stacked; Falcon-H1's multipliers multiplied
into the weights they scale. The engine reads each file (converted, and with its blocks
kept) and must give transformers' greedy tokens and logprobs for the model it came from.
(``bench/recurrent_gguf.py`` runs llama.cpp's own converter on the same families.)
"""

from __future__ import annotations

import json
import math
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
from hybrid_helpers import assert_engine_matches, prompts_of
from safetensors.torch import load_file
from test_falcon_h1 import write_falcon_h1
from test_granite4_mamba import write_hybrid
from test_jamba import write_jamba
from test_loader import _add_tokenizer, _llama_cpp_permute, quantize_array
from test_mamba1 import write_mamba1
from test_mamba2 import write_mamba2
from test_nemotron_h import write_nemotron_h

from engine.errors import UnsupportedModelError
from engine.models.layers.linear import QuantLinear
from engine.models.layers.mamba import MambaMixer
from engine.models.layers.mamba1 import Mamba1Mixer
from engine.models.loader import load_model
from engine.ops.cpu import qmatmul as cq

pytestmark = pytest.mark.usefixtures("one_thread")

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
ARCH = {"mamba": gguf.MODEL_ARCH.MAMBA, "falcon_mamba": gguf.MODEL_ARCH.MAMBA, "mamba2": gguf.MODEL_ARCH.MAMBA2,
        "falcon_h1": gguf.MODEL_ARCH.FALCON_H1, "jamba": gguf.MODEL_ARCH.JAMBA,
        "nemotron_h": gguf.MODEL_ARCH.NEMOTRON_H, "nemotron_h_moe": gguf.MODEL_ARCH.NEMOTRON_H_MOE,
        "granitemoehybrid": gguf.MODEL_ARCH.GRANITE_HYBRID,
        "granitemoe": gguf.MODEL_ARCH.GRANITE_MOE}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))


def write(family: str, folder: Path, **extra: Any) -> Any:
    """The family's tiny model, built and saved by transformers (its test module's writer)."""
    if family in ("mamba", "falcon_mamba"):
        # llama.cpp's FalconMamba norms dt, B and C at the layer norms' epsilon (its files
        # carry no other): the oracle is built so.
        extra = ({"mixer_rms_eps": 1e-5, "layer_norm_epsilon": 1e-5} if family == "falcon_mamba" else {}) | extra
        return write_mamba1(folder, falcon=family == "falcon_mamba", **extra)
    if family == "granitemoe":  # Granite 3's MoE (test_moe's shape), its multipliers away from 1
        from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

        torch.manual_seed(0)
        return write_hf_model(GraniteMoeForCausalLM(GraniteMoeConfig(**(dict(
            vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.3, logits_scaling=4.0,
            tie_word_embeddings=False) | extra))), folder, norms=True)
    if family == "granitemoehybrid":
        # Released as the "h" models are: attention without positions (llama.cpp's
        # converter runs a hybrid's attention so whatever its config says).
        return write_hybrid(folder, **({"position_embedding_type": "nope"} | extra))
    return {"mamba2": write_mamba2, "falcon_h1": write_falcon_h1, "jamba": write_jamba,
            "nemotron_h": write_nemotron_h}[family](folder, **extra)


def as_stored(hf: Any) -> Any:
    """``hf`` with the A_log the file holds: through the converter's fp32 ``-exp`` and back,
    so that the oracle and the engine start from the same numbers."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.exp(p.float())))
    return hf


def _falcon_fold(name: str, array: np.ndarray, cfg: dict[str, Any], key_in_weights: bool) -> np.ndarray:
    """Falcon-H1's multipliers multiplied into the weight ``name`` scales, as the converter does."""
    mlp, attn_in = cfg["mlp_multipliers"], cfg["attention_in_multiplier"]
    if "down_proj" in name:
        return array * mlp[1]
    if "gate_proj" in name:
        return array * mlp[0]
    if "k_proj" in name:
        return array * (cfg["key_multiplier"] if key_in_weights else 1.0) * attn_in
    if "q_proj" in name or "v_proj" in name:
        return array * attn_in
    if "o_proj" in name:
        return array * cfg["attention_out_multiplier"]
    if "out_proj" in name:
        return array * cfg["ssm_out_multiplier"]
    if "in_proj" in name:
        d, gs = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        rows = np.concatenate([np.full(n, m, dtype=np.float32) for n, m in zip(
            (d, d, gs, gs, array.shape[0] - 2 * d - 2 * gs), cfg["ssm_multipliers"], strict=True)])
        return array * cfg["ssm_in_multiplier"] * rows[:, None]
    if "lm_head" in name:
        return array * cfg["lm_head_multiplier"]
    if "embed_tokens" in name:
        return array * cfg["embedding_multiplier"]
    return array


def _metadata(w: gguf.GGUFWriter, family: str, cfg: dict[str, Any], key_in_weights: bool,
              attention_layers: list[int] | None) -> None:
    """The converter's keys for ``family`` (its set_gguf_parameters)."""
    hidden = cfg["hidden_size"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(hidden)
    if family in ("mamba", "falcon_mamba"):
        w.add_context_length(2 ** 20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(cfg["conv_kernel"])
        w.add_ssm_inner_size(cfg["intermediate_size"])
        w.add_ssm_state_size(cfg["state_size"])
        w.add_ssm_time_step_rank(cfg["time_step_rank"])
        w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])
        w.add_ssm_dt_b_c_rms(family == "falcon_mamba")
    elif family == "mamba2":
        inner = cfg["expand"] * hidden
        w.add_context_length(2 ** 20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(cfg["conv_kernel"])
        w.add_ssm_inner_size(inner)
        w.add_ssm_state_size(cfg["state_size"])
        w.add_ssm_time_step_rank(inner // cfg["head_dim"])
        w.add_ssm_group_count(cfg["n_groups"])
        w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])
    elif family == "falcon_h1":
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_inner_size(cfg["mamba_d_ssm"])
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_time_step_rank(cfg["mamba_d_ssm"] // cfg["mamba_d_head"])
        w.add_ssm_group_count(cfg["mamba_n_groups"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_rope_freq_base(cfg.get("rope_parameters", cfg).get("rope_theta"))
        if not key_in_weights:  # the key multiplier as llama.cpp's score scale instead
            w.add_attention_scale(cfg["key_multiplier"] / math.sqrt(cfg["head_dim"]))
    elif family in ("nemotron_h", "nemotron_h_moe"):  # Granite's hybrid converter's keys, the blocks' kinds as lists
        kinds = _nemotron_kinds(cfg)
        inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
        w.add_context_length(2 ** 20)  # no RoPE: the converter's arbitrary length
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if k == "*" else 0 for k in kinds])
        if family == "nemotron_h_moe":  # the expert blocks' width in the list, then the experts' keys
            w.add_feed_forward_length([cfg["moe_intermediate_size"] if k == "E" else 0 for k in kinds])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
            w.add_expert_count(cfg["n_routed_experts"])
            w.add_expert_shared_count(cfg["n_shared_experts"])
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
            w.add_expert_group_count(cfg["n_group"])
            if cfg.get("moe_latent_size") is not None:
                w.add_moe_latent_size(cfg["moe_latent_size"])
        else:
            w.add_feed_forward_length([cfg["intermediate_size"] if k == "-" else 0 for k in kinds])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])  # (its config has no rms_norm_eps: the LayerNorm key)
        w.add_ssm_conv_kernel(cfg["conv_kernel"])
        w.add_ssm_state_size(cfg["ssm_state_size"])
        w.add_ssm_group_count(cfg["n_groups"])
        w.add_ssm_inner_size(inner)
        w.add_ssm_time_step_rank(cfg["mamba_num_heads"])
    elif family == "granitemoe":  # Granite's (a Llama's) keys, and its experts'
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(cfg.get("rope_parameters", cfg).get("rope_theta", 10000.0))
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    elif family == "granitemoehybrid":  # Granite's (a Llama's) keys, then the hybrid's
        kinds, experts = cfg["layer_types"], cfg.get("num_local_experts") or 0
        w.add_context_length(2 ** 20)  # no RoPE in a hybrid (rope.scaling.finetuned false)
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if k in ("attention", "full_attention") else 0 for k in kinds])
        w.add_rope_freq_base(cfg.get("rope_parameters", cfg).get("rope_theta", 10000.0))
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_expert_count(experts)
        if experts:
            w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_group_count(cfg["mamba_n_groups"])
        w.add_ssm_inner_size(cfg["mamba_expand"] * hidden)
        w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
        w.add_rope_scaling_finetuned(False)
    else:  # jamba
        layers, offset, period = cfg["num_hidden_layers"], cfg["attn_layer_offset"], cfg["attn_layer_period"]
        if attention_layers is None:
            attention_layers = [i for i in range(offset, layers) if (i - offset) % period == 0]
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv([cfg["num_key_value_heads"] if i in attention_layers else 0 for i in range(layers)])
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_inner_size(cfg["mamba_expand"] * hidden)
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_time_step_rank(cfg["mamba_dt_rank"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])


def _nemotron_kinds(cfg: dict[str, Any]) -> str:
    """Nemotron-H's block kinds as a pattern ("M" Mamba-2, "*" attention, "-" MLP), from
    the config transformers wrote (its list of names, or the pattern)."""
    names = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
    kinds = cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern")
    return kinds if isinstance(kinds, str) else "".join(names[k] for k in kinds)


def _granite_split(name: str, array: np.ndarray, cfg: dict[str, Any]) -> list[tuple[str, np.ndarray]] | None:
    """Granite's MLP tensors as the converter writes them (``blk.{bid}.`` names): the
    shared MLP's [gate; up] split in two (``ffn_gate`` / ``ffn_up``, or the ``_shexp``
    pair beside experts), the experts' stacked [gate; up] split along each expert's rows,
    their down stack and router as they are; None for any other tensor."""
    shexp = "_shexp" if cfg.get("num_local_experts") else ""
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = np.split(array, 2, axis=0)
        return [(f"blk.{{bid}}.ffn_gate{shexp}", gate), (f"blk.{{bid}}.ffn_up{shexp}", up)]
    if name.endswith("shared_mlp.output_linear.weight"):
        return [(f"blk.{{bid}}.ffn_down{shexp}", array)]
    if name.endswith("block_sparse_moe.input_linear.weight"):
        gate, up = np.split(array, 2, axis=1)
        return [("blk.{bid}.ffn_gate_exps", gate), ("blk.{bid}.ffn_up_exps", up)]
    if name.endswith("block_sparse_moe.output_linear.weight"):
        return [("blk.{bid}.ffn_down_exps", array)]
    if name.endswith("block_sparse_moe.router.layer.weight"):
        return [("blk.{bid}.ffn_gate_inp", array)]
    return None


def _stored(name: str, array: np.ndarray, family: str, cfg: dict[str, Any], key_in_weights: bool) -> np.ndarray:
    """One Hugging Face tensor's values as the converter stores them (the module docstring)."""
    if family == "falcon_h1":
        array = _falcon_fold(name, array, cfg, key_in_weights)
    if family in ("nemotron_h", "nemotron_h_moe", "granitemoehybrid", "granitemoe") and name.endswith(
            ("q_proj.weight", "k_proj.weight")):
        heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
        array = _llama_cpp_permute(array, heads)
    if name.endswith("A_log"):
        array = -np.exp(array)
    if name.endswith("conv1d.weight"):
        array = array.squeeze(1)
    if family in ("mamba2", "falcon_h1", "nemotron_h", "nemotron_h_moe", "granitemoehybrid"):
        if name.endswith(("A_log", ".D")):
            array = array.reshape(-1, 1)
        elif name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
            groups = cfg["mamba_n_groups"] if family in ("falcon_h1", "granitemoehybrid") else cfg["n_groups"]
            array = array.reshape(groups, -1)
    return array


def write_gguf(folder: Path, out: Path, *, quant: gguf.GGMLQuantizationType = F32, key_in_weights: bool = True,
               dense_experts: bool = False, attention_layers: list[int] | None = None) -> Path:
    """The GGUF llama.cpp's converter makes of the folder ``folder`` (Mamba, FalconMamba,
    Mamba-2, Falcon-H1 or Jamba): matrices in ``quant`` where their rows are whole blocks
    (else F32, as llama.cpp's quantizer falls back), the convolution kernels, routers,
    norms and suffix-less vectors F32; ``key_in_weights`` false: Falcon-H1's key multiplier
    written as ``attention.scale`` instead of into k_proj; ``dense_experts``: Jamba's
    expert stacks F32; ``attention_layers``: the Jamba layers its KV head counts name
    (else its config's)."""
    cfg = json.loads((folder / "config.json").read_text())
    family = cfg["model_type"]
    if family == "nemotron_h":  # transformers 5 writes its blocks' kinds, not their count
        cfg["num_hidden_layers"] = len(_nemotron_kinds(cfg))
        if "E" in _nemotron_kinds(cfg):  # the converter's MoE architecture (Nemotron 3)
            family = "nemotron_h_moe"
    arch = ARCH[family]
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(w, family, cfg, key_in_weights, attention_layers)
    _add_tokenizer(w, folder, cfg | {"bos_token_id": 0, "eos_token_id": 2})  # the tiny tokenizer's ids

    def add(gname: str, array: np.ndarray, *, dense: bool = False) -> None:
        qtype = quant if (array.ndim in (2, 3) and not dense and array.shape[-1] % 32 == 0
                          and gname.endswith(".weight") and "_norm" not in gname) else F32
        w.add_tensor(gname, quantize_array(np.ascontiguousarray(array, dtype=np.float32), qtype), raw_dtype=qtype)

    stored = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    done: set[str] = set()
    for name, array in stored.items():
        if name in done:
            continue
        if family.startswith("granitemoe") and (granite := _granite_split(name, array, cfg)) is not None:
            for stem, part in granite:  # the converter's split of Granite's fused MLP tensors
                add(stem.format(bid=name.split(".")[2]) + ".weight", part, dense=stem.endswith("gate_inp"))
            continue
        if ".feed_forward.experts." in name:  # each layer's experts stacked, one tensor a projection
            prefix = name.split(".feed_forward.experts.")[0]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                parts = [f"{prefix}.feed_forward.experts.{e}.{proj}.weight" for e in range(cfg["num_experts"])]
                done.update(parts)
                add(names.get_name(f"{prefix}.mlp.experts.{proj}") + ".weight", np.stack([stored[p] for p in parts]),
                    dense=dense_experts)
            continue
        if ".mixer.experts." in name:  # Nemotron 3's experts stacked as Mixtral's: up and down, no gate
            prefix = name.split(".mixer.experts.")[0].replace("backbone.", "model.")
            for proj in ("up_proj", "down_proj"):
                parts = [f"{name.split('.mixer.experts.')[0]}.mixer.experts.{e}.{proj}.weight"
                         for e in range(cfg["n_routed_experts"])]
                done.update(parts)
                add(names.get_name(f"{prefix}.mlp.experts.{proj}") + ".weight", np.stack([stored[p] for p in parts]),
                    dense=dense_experts)
            continue
        if name.endswith("dt_bias"):  # Mamba-2's rename before the table
            name_for_table = name.replace("dt_bias", "dt_proj.bias")
        elif name.endswith("e_score_correction_bias"):  # the converter's rename: exp_probs_b.bias
            name_for_table = name.replace("e_score_correction_bias", "e_score_correction.bias")
        else:
            name_for_table = name
        gname = names.get_name(name_for_table, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        value = _stored(name, array, family, cfg, key_in_weights)
        add(gname, value, dense=name.endswith(("conv1d.weight", "router.weight", "mixer.gate.weight")))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


FAMILIES = ["mamba", "falcon_mamba", "mamba2", "falcon_h1", "jamba", "nemotron_h", "granitemoehybrid"]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_f32_gguf_matches_transformers(tmp_path: Path, family: str) -> None:
    hf = as_stored(write(family, tmp_path / "hf"))
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    loaded = assert_greedy_matches(hf, path, "cpu", fused=False)
    c, got = hf.config, loaded.config
    if family in ("mamba", "falcon_mamba"):
        m = got.mamba1
        assert m is not None and (m.d_inner, m.dt_rank, m.d_state) == (c.intermediate_size, c.time_step_rank,
                                                                       c.state_size)
        # (the file's epsilon is a float32)
        assert m.bcdt_norm_eps == (pytest.approx(c.mixer_rms_eps) if family == "falcon_mamba" else None)
    elif family == "mamba2":
        m = got.mamba
        assert m is not None and (m.n_heads, m.head_dim, m.n_groups, m.d_state) == (
            c.num_heads, c.head_dim, c.n_groups, c.state_size)
    elif family == "falcon_h1":
        m = got.mamba
        assert m is not None and (m.n_heads, m.head_dim, m.n_groups, got.head_dim) == (
            c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.head_dim)
    elif family == "nemotron_h":
        m, kinds = got.mamba, _nemotron_kinds(c.to_dict())
        assert m is not None and (m.layers, m.mlp_layers) == (
            tuple(i for i, k in enumerate(kinds) if k == "M"), tuple(i for i, k in enumerate(kinds) if k == "-"))
        assert (m.n_heads, m.head_dim, m.n_groups, got.num_key_value_heads) == (
            c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.num_key_value_heads)
        # The q/k rows back in transformers' order (llama.cpp's permutation would not show
        # in the tokens: these blocks attend without positions), from the file read either way.
        layer = kinds.index("*")
        for kept in (load_model(path, dtype="float32"), load_model(path, dtype="float32", quantization="none")):
            for proj in ("q_proj", "k_proj"):
                want = hf.state_dict()[f"model.layers.{layer}.mixer.{proj}.weight"]
                assert torch.equal(kept.weights[f"model.layers.{layer}.mixer.{proj}.weight"].float(), want), proj
    elif family == "granitemoehybrid":
        m = got.mamba
        assert m is not None and m.layers == tuple(i for i, t in enumerate(c.layer_types) if "linear" in t)
        assert (got.embedding_multiplier, got.residual_multiplier, got.logits_scaling) == pytest.approx(
            (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling))  # (float32 in the file)
        assert got.attention_multiplier == pytest.approx(c.attention_multiplier)
        assert got.nope_layers == tuple(range(c.num_hidden_layers)) and got.moe is None
    else:
        m, moe = got.mamba1, got.moe
        assert m is not None and moe is not None
        assert m.layers == tuple(i for i, t in enumerate(c.layers_block_type) if t == "mamba")
        assert moe.sparse_layers == tuple(i for i, n in enumerate(c.layers_num_experts) if n > 1)
        assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (c.num_experts, c.num_experts_per_tok, False)


@pytest.mark.parametrize("family", ["mamba2", "falcon_h1"])
def test_chunked_prompts_match_transformers(tmp_path: Path, family: str) -> None:
    hf = as_stored(write(family, tmp_path / "hf"))
    assert_chunked_greedy_matches(hf, write_gguf(tmp_path / "hf", tmp_path / "m.gguf"), "cpu", prompts=2,
                                  chunk_size=5)


def test_falcon_h1s_gated_norm_and_its_key_multiplier_as_the_score_scale(tmp_path: Path) -> None:
    """The mixer's gated norm, stored in groups and read back as one vector, after the
    gate as llama.cpp runs it; the key multiplier written as llama.cpp's
    ``attention.scale`` instead of into k_proj."""
    hf = as_stored(write("falcon_h1", tmp_path / "hf", mamba_rms_norm=True, mamba_norm_before_gate=False))
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", key_in_weights=False)
    loaded = assert_greedy_matches(hf, path, "torch", fused=False)
    assert loaded.config.mamba is not None and loaded.config.mamba.gated_norm
    assert loaded.config.falcon_h1 is not None and loaded.config.falcon_h1.key == pytest.approx(
        hf.config.key_multiplier)


@pytest.mark.skipif(not cq.available(), reason="C kernels not built")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_q8_0_gguf_keeps_its_blocks_and_matches_the_dequantized_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """The mixers' projections keep their Q8_0 blocks (Jamba's expert stacks are read one
    expert at a time, dequantized); over the torch reference matmul, the same greedy tokens
    and logprobs as the file dequantized, prefilled in chunks."""
    write(family, tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "q8.gguf", quant=Q8_0)

    def check(runner: Any) -> None:
        mixers = [getattr(layer, a) for layer in runner.model.layers for a in ("mamba", "mixer")
                  if isinstance(getattr(layer, a, None), (MambaMixer, Mamba1Mixer))]
        recurrent = runner.model.config.mamba or runner.model.config.mamba1
        assert recurrent is not None and len(mixers) == len(recurrent.layers)
        assert all(isinstance(m.in_proj, QuantLinear) and isinstance(m.out_proj, QuantLinear) for m in mixers)

    assert_kept_blocks_match_dequantized(path, monkeypatch, check)


@pytest.mark.parametrize("family", ["falcon_h1", "jamba", "nemotron_h"])
async def test_the_engine_serves_it_batched_chunked_and_preempted(tmp_path: Path, family: str) -> None:
    hf = as_stored(write(family, tmp_path / "hf"))
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    stats = await assert_engine_matches(hf, path, prompts_of((17, 21, 12, 19), 384, seed=21), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0


def test_jamba_layers_no_period_gives_are_refused(tmp_path: Path) -> None:
    """Attention in layers 0, 1 and 3 of four is no period and offset, which is all
    transformers' Jamba config can state: refused, naming the layers."""
    write("jamba", tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", attention_layers=[0, 1, 3])
    with pytest.raises(UnsupportedModelError, match=r"attention layers \[0, 1, 3\]"):
        load_model(path, dtype="float32")


async def test_falcon_h1_over_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    """Each rank reads its rows of the file's tensors: its heads of A, D and dt's bias and
    its groups of the gated norm (stored [heads, 1] and [groups, width / groups]), its rows
    of in_proj, attention and the MLP."""
    hf = as_stored(write("falcon_h1", tmp_path / "hf", mamba_rms_norm=True, mamba_norm_before_gate=False))
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    stats = await assert_engine_matches(hf, path, prompts_of((17, 21, 12, 19), 384, seed=10), tensor_parallel_size=2)
    assert stats.preemptions > 0


async def test_mamba_over_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    """Each rank reads its channels' rows of the file's in_proj, convolution, dt_proj, A
    (stored as the decay rate, 2-D) and D, and x_proj's and out_proj's columns."""
    hf = as_stored(write("mamba", tmp_path / "hf"))
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    stats = await assert_engine_matches(hf, path, prompts_of((17, 21, 12, 19), 384, seed=10), tensor_parallel_size=2)
    assert stats.preemptions > 0


def test_granite_4s_experts_from_a_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """granite-4.0-h-tiny's layout: experts beside the shared MLP in every layer. The
    converter splits the stacked [gate; up] of each and keeps the stacks; read back, they
    give transformers' tokens (F32), and kept in blocks the dequantized file's."""
    moe = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    hf = as_stored(write("granitemoehybrid", tmp_path / "hf", **moe))
    loaded = assert_greedy_matches(hf, write_gguf(tmp_path / "hf", tmp_path / "m.gguf"), "torch", fused=False)
    assert loaded.config.moe is not None and loaded.config.moe.num_experts == 4
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.input_linear.weight"
    assert torch.equal(loaded.weights[name], stored[name])  # each expert's gate rows, then its up rows
    path = write_gguf(tmp_path / "hf", tmp_path / "q8.gguf", quant=Q8_0)

    def check(runner: Any) -> None:
        assert any(isinstance(getattr(layer, "gate_up", None), QuantLinear) for layer in runner.model.layers)

    assert_kept_blocks_match_dequantized(path, monkeypatch, check)


def test_granite_3s_moe_from_a_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's ``granitemoe`` (granite-3.x-*-a*m): every layer's experts, their fused
    [gate; up] split by the converter, joined back; Granite's multipliers; q/k rows
    unpermuted. Transformers' tokens from the F32 file (RoPE: a permutation left in would
    show), and the dequantized file's from Q8_0."""
    hf = write("granitemoe", tmp_path / "hf")
    loaded = assert_greedy_matches(hf, write_gguf(tmp_path / "hf", tmp_path / "m.gguf"), "cpu", fused=True)
    c, got = hf.config, loaded.config
    assert got.moe is not None and (got.moe.num_experts, got.moe.top_k, got.moe.intermediate_size) == (
        c.num_local_experts, c.num_experts_per_tok, c.intermediate_size)
    assert (got.embedding_multiplier, got.residual_multiplier, got.logits_scaling, got.attention_multiplier) == (
        pytest.approx(c.embedding_multiplier), pytest.approx(c.residual_multiplier), pytest.approx(c.logits_scaling),
        pytest.approx(c.attention_multiplier))
    def check(runner: Any) -> None:  # attention in blocks (the experts' kernels take them dense)
        assert all(isinstance(layer.qkv, QuantLinear) for layer in runner.model.layers)

    assert_kept_blocks_match_dequantized(write_gguf(tmp_path / "hf", tmp_path / "q8.gguf", quant=Q8_0), monkeypatch,
                                         check)


async def test_granite_4_over_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    """Each rank reads its rows of the joined [gate; up] (its share of each half, from the
    file's two tensors), its share of every expert from the stacks, its heads and Mamba
    heads."""
    hf = as_stored(write("granitemoehybrid", tmp_path / "hf", num_local_experts=4, num_experts_per_tok=2,
                         intermediate_size=32))
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    stats = await assert_engine_matches(hf, path, prompts_of((17, 21, 12, 19), 384, seed=10), tensor_parallel_size=2)
    assert stats.preemptions > 0
