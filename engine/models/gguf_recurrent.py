"""GGUF files of the state-space families, as llama.cpp's converter writes them:
``mamba`` (Mamba, and FalconMamba when ``ssm.dt_b_c_rms`` is set), ``mamba2``,
``falcon-h1``, ``jamba``, ``nemotron_h`` and ``nemotron_h_moe`` (Nemotron 3), ``granitehybrid``.
engine.models.gguf_convert reads every GGUF; this module holds what these differ in.

* **Names.** The mixer's tensors are ``ssm_*``: ``ssm_in``, ``ssm_conv1d``, ``ssm_x``
  (Mamba-1's x_proj), ``ssm_dt`` (Mamba-1's dt_proj; Mamba-2's dt bias is ``ssm_dt.bias``
  alone), ``ssm_a`` and ``ssm_d`` (no ``.weight`` suffix), ``ssm_norm``, ``ssm_out``, and
  Jamba's ``ssm_dt_norm`` / ``ssm_b_norm`` / ``ssm_c_norm``. Mamba's and Mamba-2's layer
  norm is ``attn_norm``; Falcon-H1's norm before the MLP is ``ffn_norm``, with no suffix
  either. Jamba's experts are stacked like Mixtral's; its router is ``ffn_gate_inp``.
* **Values.** ``ssm_a`` holds the decay rate ``-exp(A_log)``, not A_log. The convolution
  kernels lose their middle axis (``[channels, kernel]``). Mamba-2's and Falcon-H1's A and D
  are stored ``[heads, 1]``, and their gated norm ``[groups, width / groups]``; here they
  are read back as the vectors the checkpoints hold.
* **Falcon-H1's multipliers** are folded into the weights they scale (the embedding, the
  head, q/k/v, o, in_proj's five parts, out_proj, the MLP's gate and down); no key is
  written. Each scales a linear map or its input, so the model read here runs every
  multiplier at 1 and gives the same numbers. llama.cpp runs the mixer's gated norm after
  the gate, whatever the original's order, and this reads it so.
* **Layer kinds.** Nemotron-H's blocks are attention where ``attention.head_count_kv``
  (a count a block) is not zero, its MLP where ``feed_forward_length`` is not, Mamba-2
  elsewhere; in Nemotron 3's files (``nemotron_h_moe``) the blocks with a feed-forward
  width are its experts' instead, stacked as Mixtral's (up and down alone: no gate), with
  the router's selection bias ``exp_probs_b.bias``, the shared expert's ``*_shexp`` and
  the latent projections ``ffn_latent_down`` / ``ffn_latent_up``. Jamba's attention layers are those with a non-zero
  ``attention.head_count_kv`` (a list, a count a layer), its expert layers those with a
  router; transformers' config states both as a period and an offset, recovered here (a
  layout that no period gives is refused, by name).
* FalconMamba's dt, B and C norms use the file's RMS epsilon, as llama.cpp runs them
  (transformers' ``mixer_rms_eps`` is not written).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.gguf_families import rope_scaling

# GGUF architecture -> (Hugging Face architecture, model_type, q/k rows permuted).
ARCHITECTURES = {
    "mamba": ("MambaForCausalLM", "mamba", False),
    "mamba2": ("Mamba2ForCausalLM", "mamba2", False),
    # llama.cpp rotates Falcon-H1 NEOX-style, as Hugging Face does: its rows are unpermuted.
    "falcon-h1": ("FalconH1ForCausalLM", "falcon_h1", False),
    "jamba": ("JambaForCausalLM", "jamba", False),
    # Nemotron-H's converter is Granite's, a Llama's: q/k rows permuted (its attention has
    # no positions, so llama.cpp would not notice; undone here for transformers' layout).
    "nemotron_h": ("NemotronHForCausalLM", "nemotron_h", True),
    "nemotron_h_moe": ("NemotronHForCausalLM", "nemotron_h", True),  # Nemotron 3: its "E" blocks
    # Granite 4's hybrid models (granite-4.0-h-*): a Granite (Llama) converter, q/k permuted.
    "granitehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid", True),
}

# The engine's names: Mamba's and Mamba-2's stacks read model.* (their checkpoints'
# backbone.* names mapped so), Falcon-H1's and Jamba's their checkpoints' own.
TOP_LEVEL_NAMES = {
    "mamba": {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    "falcon-h1": {"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm", "output": "lm_head"},
}
TOP_LEVEL_NAMES["mamba2"] = TOP_LEVEL_NAMES["nemotron_h"] = TOP_LEVEL_NAMES["nemotron_h_moe"] = TOP_LEVEL_NAMES["mamba"]
TOP_LEVEL_NAMES["granitehybrid"] = TOP_LEVEL_NAMES["mamba"]
TOP_LEVEL_NAMES["jamba"] = TOP_LEVEL_NAMES["falcon-h1"]

_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}
_FFN = {"ffn_norm": "pre_ff_layernorm", "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
        "ffn_down": "feed_forward.down_proj"}


def _mixer(module: str, *kinds: str) -> dict[str, str]:
    hf = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_x": "x_proj", "ssm_dt": "dt_proj",
          "ssm_norm": "norm", "ssm_out": "out_proj", "ssm_dt_norm": "dt_layernorm", "ssm_b_norm": "b_layernorm",
          "ssm_c_norm": "c_layernorm"}
    return {k: f"{module}.{hf[k]}" for k in kinds}


BLOCK_NAMES = {
    "mamba": {"attn_norm": "norm"} | _mixer("mixer", "ssm_in", "ssm_conv1d", "ssm_x", "ssm_dt", "ssm_out"),
    "mamba2": {"attn_norm": "norm"} | _mixer("mixer", "ssm_in", "ssm_conv1d", "ssm_norm", "ssm_out"),
    "falcon-h1": {"attn_norm": "input_layernorm"} | _ATTENTION | _FFN
                 | _mixer("mamba", "ssm_in", "ssm_conv1d", "ssm_norm", "ssm_out"),
    "jamba": {"attn_norm": "input_layernorm"} | _ATTENTION | _FFN
             | _mixer("mamba", "ssm_in", "ssm_conv1d", "ssm_x", "ssm_dt", "ssm_dt_norm", "ssm_b_norm",
                      "ssm_c_norm", "ssm_out"),
    # One mixer a block, all under mixer.: Mamba-2, attention or the squared-ReLU MLP.
    "nemotron_h": {"attn_norm": "norm", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj"}
                  | {k: v.replace("self_attn.", "mixer.") for k, v in _ATTENTION.items()}
                  | _mixer("mixer", "ssm_in", "ssm_conv1d", "ssm_norm", "ssm_out"),
    # Nemotron 3: the experts' stacks and router are gguf_convert.moe_tensor_names's.
    "nemotron_h_moe": {"attn_norm": "norm", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
                       "ffn_up_shexp": "mixer.shared_experts.up_proj",
                       "ffn_down_shexp": "mixer.shared_experts.down_proj",
                       "ffn_latent_down": "mixer.fc1_latent_proj", "ffn_latent_up": "mixer.fc2_latent_proj"}
                      | {k: v.replace("self_attn.", "mixer.") for k, v in _ATTENTION.items()}
                      | _mixer("mixer", "ssm_in", "ssm_conv1d", "ssm_norm", "ssm_out"),
    # Granite 4: its MLP's gate and up are one tensor in the checkpoint (JOINED below), the
    # experts stacked; llama.cpp splits the one and keeps the others.
    "granitehybrid": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"} | _ATTENTION
                     | _mixer("mamba", "ssm_in", "ssm_conv1d", "ssm_norm", "ssm_out")
                     | {"ffn_gate": "shared_mlp.input_linear", "ffn_up": "shared_mlp.input_linear",
                        "ffn_gate_shexp": "shared_mlp.input_linear", "ffn_up_shexp": "shared_mlp.input_linear",
                        "ffn_down": "shared_mlp.output_linear", "ffn_down_shexp": "shared_mlp.output_linear",
                        "ffn_gate_exps": "block_sparse_moe.input_linear", "ffn_up_exps": "block_sparse_moe.input_linear",
                        "ffn_down_exps": "block_sparse_moe.output_linear",
                        "ffn_gate_inp": "block_sparse_moe.router.layer"},
}

# The GGUF tensors that are parts of one Hugging Face tensor, joined along its rows (a 2-D
# tensor's first axis, a 3-D stack's second: each expert's gate rows, then its up rows):
# the part each is, by what follows "blk.N.".
# Granite 3's MoE files (``granitemoe``, read by gguf_convert's common path) split their
# experts the same way.
JOINED = {"granitehybrid": {"ffn_gate": 0, "ffn_up": 1, "ffn_gate_shexp": 0, "ffn_up_shexp": 1,
                            "ffn_gate_exps": 0, "ffn_up_exps": 1},
          "granitemoe": {"ffn_gate_exps": 0, "ffn_up_exps": 1}}


def joined_part(arch: str, gguf_name: str) -> int | None:
    """Which part of its Hugging Face tensor GGUF tensor ``gguf_name`` is (see
    :data:`JOINED`), or None for a tensor that is one whole."""
    parts = gguf_name.split(".")
    return JOINED.get(arch, {}).get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None

# Tensors named without a .weight/.bias suffix in one of the two, by what follows "blk.N.".
BARE_NAMES = {
    "mamba": {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D"},
    "mamba2": {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias"},
    # llama.cpp names Falcon-H1's norm before the MLP without a suffix too.
    "falcon-h1": {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias",
                  "ffn_norm": "pre_ff_layernorm.weight"},
    "jamba": {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D"},
    "nemotron_h": {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias"},
    "nemotron_h_moe": {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias",
                       "exp_probs_b.bias": "mixer.gate.e_score_correction_bias"},
    "granitehybrid": {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"},
}

# Mamba-2's mixers: A and D stored [heads, 1], the gated norm [groups, width / groups].
_FLATTENED = frozenset({"mamba2", "falcon-h1", "nemotron_h", "nemotron_h_moe", "granitehybrid"})


def hf_shape(arch: str, hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of tensor ``hf_name`` that ``arch``'s file stores as
    ``shape`` (torch order): Mamba-2's A, D and gated norm flattened; any other as stored."""
    if arch in _FLATTENED and hf_name.endswith((".A_log", ".D", "mixer.norm.weight", "mamba.norm.weight")):
        return (math.prod(shape),)
    return shape


def config(fields: Any, arch: str, names: dict[str, Any], base: dict[str, Any], path: Path) -> dict[str, Any]:
    """The config.json of a ``mamba``, ``mamba2``, ``falcon-h1`` or ``jamba`` file from its
    metadata ``fields`` and tensors ``names``; ``base`` holds what every family shares
    (vocabulary, token ids, dtype, tied head)."""
    hf_arch, model_type, _ = ARCHITECTURES[arch]
    # (less the multi-token-prediction blocks the converter appends: not read)
    layers = int(fields.get(f"{arch}.block_count")) - int(fields.get(f"{arch}.nextn_predict_layers", 0))
    hidden = int(fields.get(f"{arch}.embedding_length"))
    inner = int(fields.get(f"{arch}.ssm.inner_size"))
    ssm = {"conv": int(fields.get(f"{arch}.ssm.conv_kernel")), "state": int(fields.get(f"{arch}.ssm.state_size")),
           "rank": int(fields.get(f"{arch}.ssm.time_step_rank"))}
    # (Nemotron-H's converter writes the RMS norms' epsilon under the LayerNorm key alone,
    # which llama.cpp reads for both.)
    eps = float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", None)
                or fields.get(f"{arch}.attention.layer_norm_epsilon"))
    first_mixer = min((int(n.split(".")[1]) for n in names if n.endswith(".ssm_in.weight")), default=0)
    conv_bias = f"blk.{first_mixer}.ssm_conv1d.bias" in names
    proj_bias = f"blk.{first_mixer}.ssm_in.bias" in names
    out: dict[str, Any] = base | {"architectures": [hf_arch], "model_type": model_type, "hidden_size": hidden,
                                  "num_hidden_layers": layers, "hidden_act": "silu"}
    if arch == "mamba":
        falcon = bool(fields.get("mamba.ssm.dt_b_c_rms", False))
        return out | {
            "architectures": ["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"],
            "model_type": "falcon_mamba" if falcon else "mamba",
            "state_size": ssm["state"], "intermediate_size": inner,
            "conv_kernel": ssm["conv"], "time_step_rank": ssm["rank"], "layer_norm_epsilon": eps,
            "use_bias": proj_bias, "use_conv_bias": conv_bias, "residual_in_fp32": True,
            **({"mixer_rms_eps": eps} if falcon else {}),
        }
    groups = int(fields.get(f"{arch}.ssm.group_count", 1))
    if arch in ("nemotron_h", "nemotron_h_moe"):
        return out | _nemotron_h(fields, arch, names, layers, inner, ssm, groups, eps, conv_bias, proj_bias, path)
    if arch == "granitehybrid":
        return out | _granite_hybrid(fields, names, layers, hidden, inner, ssm, groups, eps, conv_bias, proj_bias,
                                     path)
    if arch == "mamba2":
        heads = ssm["rank"]  # llama.cpp's time-step rank is Mamba-2's head count
        if not heads or inner % heads:
            raise CorruptModelError(f"{path}: mamba2.ssm.inner_size {inner} is not whole heads of "
                                    f"time_step_rank {heads}")
        return out | {
            "state_size": ssm["state"], "expand": _ratio(inner, hidden, arch, path), "conv_kernel": ssm["conv"],
            "n_groups": groups, "num_heads": heads, "head_dim": inner // heads, "layer_norm_epsilon": eps,
            "use_bias": proj_bias, "use_conv_bias": conv_bias, "residual_in_fp32": True,
        }
    attention = {
        "intermediate_size": int(fields.get(f"{arch}.feed_forward_length")),
        "num_attention_heads": int(fields.get(f"{arch}.attention.head_count")),
        "rms_norm_eps": eps,
        "max_position_embeddings": int(fields.get(f"{arch}.context_length")),
        "attention_bias": f"blk.{_first_attention(names)}.attn_q.bias" in names,
    }
    if arch == "falcon-h1":
        return out | attention | _falcon_h1(fields, names, inner, ssm, groups, conv_bias, proj_bias, path)
    return out | attention | _jamba(fields, names, layers, hidden, inner, ssm, conv_bias, proj_bias, path)


def _falcon_h1(fields: Any, names: dict[str, Any], inner: int, ssm: dict[str, int], groups: int, conv_bias: bool,
               proj_bias: bool, path: Path) -> dict[str, Any]:
    heads, head_dim = ssm["rank"], int(fields.get("falcon-h1.attention.key_length"))
    if not heads or inner % heads:
        raise CorruptModelError(f"{path}: falcon-h1.ssm.inner_size {inner} is not whole heads of "
                                f"time_step_rank {heads}")
    # llama.cpp scales the scores by attention.scale where the file sets it, else by
    # head_dim ** -0.5; Falcon-H1 states the difference as its key multiplier.
    scale = float(fields.get("falcon-h1.attention.scale", 0.0))
    key = scale * math.sqrt(head_dim) if scale else 1.0
    return {
        "num_key_value_heads": int(fields.get("falcon-h1.attention.head_count_kv")),
        "head_dim": head_dim,
        "rope_theta": float(fields.get("falcon-h1.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(fields, "falcon-h1", path),
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "mamba_d_ssm": inner, "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_n_groups": groups,
        "mamba_d_state": ssm["state"], "mamba_d_conv": ssm["conv"], "mamba_conv_bias": conv_bias,
        "mamba_proj_bias": proj_bias, "mamba_rms_norm": "blk.0.ssm_norm.weight" in names,
        "mamba_norm_before_gate": False,
        # Folded into the weights by the converter (the module docstring).
        "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0, "key_multiplier": key,
        "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5,
        "mlp_multipliers": [1.0, 1.0], "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0,
    }


def _jamba(fields: Any, names: dict[str, Any], layers: int, hidden: int, inner: int, ssm: dict[str, int],
           conv_bias: bool, proj_bias: bool, path: Path) -> dict[str, Any]:
    kv_list = _per_layer(fields.get("jamba.attention.head_count_kv"), layers, "attention.head_count_kv", path)
    attention = [i for i, k in enumerate(kv_list) if k]
    if len({kv_list[i] for i in attention}) > 1:
        raise UnsupportedModelError(f"{path}: Jamba attention layers with different KV head counts are not supported")
    heads = int(fields.get("jamba.attention.head_count"))
    if int(fields.get("jamba.attention.key_length", hidden // heads)) * heads != hidden:
        raise UnsupportedModelError(f"{path}: Jamba with jamba.attention.key_length other than hidden / heads "
                                    "is not supported")
    experts = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    attn_period, attn_offset = _period(attention, layers, "attention", path)
    expert_period, expert_offset = _period(experts, layers, "expert", path)
    return {
        "num_key_value_heads": kv_list[attention[0]] if attention else heads,
        "attn_layer_period": attn_period, "attn_layer_offset": attn_offset,
        "expert_layer_period": expert_period, "expert_layer_offset": expert_offset,
        "num_experts": int(fields.get("jamba.expert_count", 1)) if experts else 1,
        "num_experts_per_tok": int(fields.get("jamba.expert_used_count", 1)) if experts else 1,
        "mamba_d_state": ssm["state"], "mamba_d_conv": ssm["conv"], "mamba_dt_rank": ssm["rank"],
        "mamba_expand": _ratio(inner, hidden, "jamba", path), "mamba_conv_bias": conv_bias,
        "mamba_proj_bias": proj_bias,
    }


def _nemotron_h(fields: Any, arch: str, names: dict[str, Any], layers: int, inner: int, ssm: dict[str, int],
                groups: int, eps: float, conv_bias: bool, proj_bias: bool, path: Path) -> dict[str, Any]:
    """Nemotron-H's blocks as its ``hybrid_override_pattern``: attention where the block
    has KV heads (``attention.head_count_kv``, a count a block), the MLP where it has a
    feed-forward width (``feed_forward_length``, likewise; in a ``nemotron_h_moe`` file
    the experts), Mamba-2 elsewhere."""
    nextn = int(fields.get(f"{arch}.nextn_predict_layers", 0))
    kv = _per_layer(fields.get(f"{arch}.attention.head_count_kv"), layers, "attention.head_count_kv", path, nextn)
    ff = _per_layer(fields.get(f"{arch}.feed_forward_length"), layers, "feed_forward_length", path, nextn)
    moe = arch == "nemotron_h_moe"
    # (The converter writes a dense model whose config.json lists num_experts_per_tok, as
    # transformers 5 writes every one, as nemotron_h_moe, its MLP blocks' widths as 0: an
    # MLP block is then known by its tensors.)
    mlp = {i for i in range(layers) if f"blk.{i}.ffn_up.weight" in names}
    pattern = "".join("*" if kv[i] else ("E" if moe and i not in mlp else "-") if ff[i] or i in mlp else "M"
                      for i in range(layers))
    mlp_width = next((int(names[f"blk.{i}.ffn_up.weight"].shape[1]) for i in sorted(mlp)), 0)  # ggml [hidden, width]
    heads_m = ssm["rank"]  # as Mamba-2's: the time-step rank is the head count
    if not heads_m or inner % heads_m:
        raise CorruptModelError(f"{path}: {arch}.ssm.inner_size {inner} is not whole heads of "
                                f"time_step_rank {heads_m}")
    heads = int(fields.get(f"{arch}.attention.head_count"))
    out = {
        "hybrid_override_pattern": pattern, "num_attention_heads": heads,
        "num_key_value_heads": next((k for k in kv if k), heads),
        "head_dim": int(fields.get(f"{arch}.attention.key_length")),
        "intermediate_size": mlp_width if moe else next((f for f in ff if f), 0),
        "mamba_num_heads": heads_m, "mamba_head_dim": inner // heads_m, "n_groups": groups,
        "ssm_state_size": ssm["state"], "conv_kernel": ssm["conv"], "use_conv_bias": conv_bias, "use_bias": proj_bias,
        "layer_norm_epsilon": eps, "max_position_embeddings": int(fields.get(f"{arch}.context_length")),
        "attention_bias": f"blk.{_first_attention(names)}.attn_q.bias" in names,
        "mlp_bias": any(n.endswith((".ffn_up.bias", ".ffn_up_shexp.bias")) for n in names), "mlp_hidden_act": "relu2",
    }
    experts = moe and "E" in pattern
    widths = [f for i, f in enumerate(ff) if i not in mlp]
    return out | (_nemotron_experts(fields, arch, widths, layers, path) if experts else {})


def _nemotron_experts(fields: Any, arch: str, ff: list[int], layers: int, path: Path) -> dict[str, Any]:
    """Nemotron 3's experts under transformers' keys, from the converter's: one width for
    every expert block (a file of several, NVIDIA's Puzzle models, is refused), and the
    expert groups (a file of several groups that does not say how many a token may use
    is refused, as llama.cpp refuses it)."""
    widths = {f for f in ff if f}
    per_expert = fields.get(f"{arch}.expert_feed_forward_length")
    if isinstance(per_expert, list):
        widths |= {int(f) for f in per_expert[:layers] if int(f)}
    if len(widths) > 1:
        raise UnsupportedModelError(f"{path}: Nemotron 3 with experts of several widths {sorted(widths)} "
                                    "(a Puzzle model) is not supported")
    n_group = int(fields.get(f"{arch}.expert_group_count", 1) or 1)
    used = int(fields.get(f"{arch}.expert_group_used_count", 0) or 0)
    if n_group > 1 and not 0 < used < n_group:
        raise CorruptModelError(f"{path}: {arch}.expert_group_count is {n_group} and expert_group_used_count "
                                f"{used or 'missing'}: the groups a token may use are not known")
    latent = fields.get(f"{arch}.moe_latent_size", None)
    return {
        "n_routed_experts": int(fields.get(f"{arch}.expert_count")),
        "num_experts_per_tok": int(fields.get(f"{arch}.expert_used_count")),
        "moe_intermediate_size": widths.pop() if widths else 0,
        "moe_shared_expert_intermediate_size": int(fields.get(f"{arch}.expert_shared_feed_forward_length", 0)),
        "norm_topk_prob": bool(fields.get(f"{arch}.expert_weights_norm", False)),
        "routed_scaling_factor": float(fields.get(f"{arch}.expert_weights_scale", 1.0)),
        "n_group": n_group, "topk_group": used if n_group > 1 else 1,
        "moe_latent_size": int(latent) if latent else None,
    }


def _granite_hybrid(fields: Any, names: dict[str, Any], layers: int, hidden: int, inner: int, ssm: dict[str, int],
                    groups: int, eps: float, conv_bias: bool, proj_bias: bool, path: Path) -> dict[str, Any]:
    """Granite 4's hybrid config: attention where ``attention.head_count_kv`` is not zero,
    Mamba-2 elsewhere; Granite's four multipliers under llama.cpp's names (its attention
    scale head_dim ** -0.5 where the file has none, as llama.cpp reads it); RoPE only where
    ``rope.scaling.finetuned`` says so (the "h" models have none); the shared MLP's and the
    experts' widths from their tensors."""
    a = "granitehybrid"
    kv = _per_layer(fields.get(f"{a}.attention.head_count_kv"), layers, "attention.head_count_kv", path)
    heads = int(fields.get(f"{a}.attention.head_count"))
    if hidden % heads or int(fields.get(f"{a}.attention.key_length", hidden // heads)) != hidden // heads:
        raise UnsupportedModelError(f"{path}: Granite 4 with a head width other than hidden / heads is not supported")
    heads_m = ssm["rank"]
    if not heads_m or inner % heads_m:
        raise CorruptModelError(f"{path}: {a}.ssm.inner_size {inner} is not whole heads of time_step_rank {heads_m}")
    shared = names.get("blk.0.ffn_gate_shexp.weight") or names.get("blk.0.ffn_gate.weight")
    if shared is None:
        raise CorruptModelError(f"{path}: the GGUF has no shared MLP (ffn_gate or ffn_gate_shexp)")
    experts = int(fields.get(f"{a}.expert_count", 0))
    stack = names.get("blk.0.ffn_gate_exps.weight")
    return {
        "layer_types": ["attention" if kv[i] else "mamba" for i in range(layers)],
        "num_attention_heads": heads, "num_key_value_heads": next((k for k in kv if k), heads),
        "shared_intermediate_size": int(shared.shape[1]),  # ggml [hidden, width]
        "intermediate_size": int(stack.shape[1]) if experts and stack is not None else int(shared.shape[1]),
        "num_local_experts": experts, "num_experts_per_tok": int(fields.get(f"{a}.expert_used_count", 0)),
        "mamba_n_heads": heads_m, "mamba_d_head": inner // heads_m, "mamba_n_groups": groups,
        "mamba_d_state": ssm["state"], "mamba_d_conv": ssm["conv"], "mamba_expand": _ratio(inner, hidden, a, path),
        "mamba_conv_bias": conv_bias, "mamba_proj_bias": proj_bias,
        "rms_norm_eps": eps, "max_position_embeddings": int(fields.get(f"{a}.context_length")),
        "rope_theta": float(fields.get(f"{a}.rope.freq_base", 10000.0)),
        "position_embedding_type": "rope" if fields.get(f"{a}.rope.scaling.finetuned", True) else "nope",
        "embedding_multiplier": float(fields.get(f"{a}.embedding_scale", 1.0)),
        "residual_multiplier": float(fields.get(f"{a}.residual_scale", 1.0)),
        "attention_multiplier": float(fields.get(f"{a}.attention.scale", (hidden // heads) ** -0.5)),
        "logits_scaling": float(fields.get(f"{a}.logit_scale", 1.0)),
        "attention_bias": f"blk.{_first_attention(names)}.attn_q.bias" in names,
    }


def _per_layer(value: Any, layers: int, key: str, path: Path, extra: int = 0) -> list[int]:
    """A per-layer metadata list (or one count for every layer): the decoder's ``layers``
    of it, where the list may also cover the ``extra`` multi-token-prediction blocks the
    converter appends (Nemotron 3 Super's, not read)."""
    counts = [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers
    if len(counts) not in (layers, layers + extra):
        raise CorruptModelError(f"{path}: {key} lists {len(counts)} layers, the model has {layers}")
    return counts[:layers]


def _period(layers_on: list[int], layers: int, what: str, path: Path) -> tuple[int, int]:
    """The period and offset (layer ``i`` is one when ``i % period == offset``) that give
    exactly ``layers_on`` of ``layers``; refused where none does."""
    if not layers_on:
        return layers + 1, layers  # no layer: an offset past the last
    period = layers_on[1] - layers_on[0] if len(layers_on) > 1 else layers
    offset = layers_on[0] % period
    if [i for i in range(layers) if i % period == offset] != layers_on:
        raise UnsupportedModelError(f"{path}: Jamba's {what} layers {layers_on} are not every n-th layer "
                                    "from an offset, as its config states them")
    return period, offset


def _first_attention(names: dict[str, Any]) -> int:
    return min((int(n.split(".")[1]) for n in names if n.endswith(".attn_q.weight")), default=0)


def _ratio(inner: int, hidden: int, arch: str, path: Path) -> int:
    if inner % hidden:
        raise UnsupportedModelError(f"{path}: {arch}.ssm.inner_size {inner} is not a whole multiple of the "
                                    f"hidden size {hidden}")
    return inner // hidden


__all__ = ["ARCHITECTURES", "BARE_NAMES", "BLOCK_NAMES", "JOINED", "TOP_LEVEL_NAMES", "config", "hf_shape", "joined_part"]
