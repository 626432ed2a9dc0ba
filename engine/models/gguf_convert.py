"""Convert a GGUF file into a Hugging Face model folder.

llama.cpp's GGUF format differs from a Hugging Face checkpoint in these ways, which this
module undoes:

* tensor names (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``);
* shapes are written fastest-dimension first (ggml order), the reverse of torch's;
* tensors may be block-quantized (Q8_0, Q4_K, ...): they are dequantized here, through
  ``gguf.quants.dequantize``, into float32 (F16/BF16 tensors keep their own precision,
  which is lossless);
* Gemma's norm weights are stored as ``1 + w`` (llama.cpp's RMSNorm multiplies by the
  weight as is); Phi-3's longrope factors are tensors (``rope_factors_long/short``), not
  metadata, and its q/k/v and gate/up stay fused (``attn_qkv``, ``ffn_up``);
* GPT-2 (``gpt2``) has names of its own (``position_embd``, ``attn_qkv`` for ``c_attn``,
  biases beside the weights) and its Conv1D projections stored ``[out, in]``, the
  transpose of Hugging Face's ``[in, out]``: they are transposed back;
* for the ``llama`` architecture, llama.cpp's converter permutes the rows of q_proj and
  k_proj so that its interleaved ("GPT-J style") RoPE matches Hugging Face's rotate-half
  RoPE. Within each head it turns the row order ``[first half | second half]`` into
  ``[r0, r(d/2), r1, r(d/2+1), ...]``. :func:`unpermute_qk` undoes it. Qwen2 and Qwen3
  run NEOX-style RoPE in llama.cpp, so their rows are stored unpermuted.

The config comes from the ``<arch>.*`` metadata keys, the tokenizer from the
``tokenizer.ggml.*`` keys (through transformers' GGUF tokenizer builder; transformers is
used only here, at conversion time, never at run time).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models import gguf_families, gguf_recurrent

# Bump when the converter's output changes, so cached conversions are redone.
CONVERTER_VERSION = 2

# GGUF architecture -> (Hugging Face architecture, model_type, q/k rows permuted).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "gemma": ("GemmaForCausalLM", "gemma", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    # llama.cpp's converter permutes Granite's q/k rows as Llama's (its GraniteModel is one).
    "granite": ("GraniteForCausalLM", "granite", True),
    # Granite 3's MoE models (granite-3.x-*-a*m): Granite's, experts stacked as Mixtral's
    # files hold them, gate and up apart (gguf_recurrent.JOINED joins them back).
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe", True),
    # SmolLM3 too (llama.cpp rotates it as Llama); its RoPE-less layers are every fourth,
    # a rule llama.cpp fixes (no GGUF key), as transformers' default no_rope_layer_interval.
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", True),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "gpt2": ("GPT2LMHeadModel", "gpt2", False),
    # Qwen3.5: Gated DeltaNet layers between gated attention layers (see _qwen35_config).
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text", False),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", False),
} | gguf_recurrent.ARCHITECTURES  # mamba, mamba2, falcon-h1, jamba: see gguf_recurrent
_QWEN35 = frozenset({"qwen35", "qwen35moe"})

# Mixture-of-experts tensors. llama.cpp stacks each layer's experts into one tensor per
# projection (ggml shape [hidden, inter, experts] for gate/up, i.e. torch [E, inter,
# hidden]); the Hugging Face folder gets them back one expert at a time. Mixtral is GGUF
# architecture ``llama`` with ``llama.expert_count`` set.
_EXPERT_STACKS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}  # -> (gate, up, down)
# llama.cpp's converter may fuse an expert's gate and up rows (--fuse-gate-up-exps): torch
# [E, 2 * inter, hidden], each expert's gate rows, then its up rows.
GATE_UP_STACK = "ffn_gate_up_exps"
_MOE_BLOCK_NAMES = {
    "ffn_gate_inp": "gate",  # the router, [E, hidden]
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",  # 1-D [hidden] in GGUF, [1, hidden] in HF
}

_GEMMA = frozenset({"gemma", "gemma2", "gemma3"})

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Where an architecture's layer names differ from the Llama layout above: Gemma's sandwich
# norms (llama.cpp's ffn_norm is Gemma's pre-feedforward norm), Phi-3's fused projections.
_ARCH_BLOCK_NAMES = {
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # OLMo 2: norms after each block only (its q/k norms are attn_q_norm / attn_k_norm).
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    # Qwen3.5: a Gated DeltaNet layer's projections, convolution and norm (its A_log and
    # dt_bias are named in _QWEN35_BARE_NAMES), and the norm before the MLP.
    "qwen35": {
        "post_attention_norm": "post_attention_layernorm",
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_conv1d": "linear_attn.conv1d",
        "ssm_norm": "linear_attn.norm",
        "ssm_out": "linear_attn.out_proj",
    },
}
_ARCH_BLOCK_NAMES["gemma3"] = _ARCH_BLOCK_NAMES["gemma2"]
_ARCH_BLOCK_NAMES["granitemoe"] = {
    "ffn_gate_inp": "block_sparse_moe.router.layer", "ffn_gate_exps": "block_sparse_moe.input_linear",
    "ffn_up_exps": "block_sparse_moe.input_linear", "ffn_down_exps": "block_sparse_moe.output_linear"}
_ARCH_BLOCK_NAMES["qwen35moe"] = _ARCH_BLOCK_NAMES["qwen35"]
# Qwen3.5's tensors whose Hugging Face name has no .weight/.bias suffix, by what follows
# "blk.N." (llama.cpp names the decay rates ssm_a, without a suffix, as Mamba's).
_QWEN35_BARE_NAMES = {"ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log"}

# GPT-2 as llama.cpp writes it: its own tensor names (a learned position table, LayerNorms
# with biases, q/k/v fused in attn_qkv), and its four Conv1D projections transposed to
# [out, in] (Hugging Face stores them [in, out]: the converter transposes them back).
_GPT2_TOP_LEVEL_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_GPT2_BLOCK_NAMES = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
GPT2_CONV1D = tuple(f".{n}.weight" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))

# Tensors that are configuration, not weights: Phi-3's longrope factors.
_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

# llama.cpp isolates every digit before the GPT-2 split for these vocabularies (its
# llama-vocab.cpp groups them under one regex list); transformers' GGUF builder leaves
# them with the plain GPT-2 split, which keeps " 42" in one piece.
_DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact"})

# ggml types whose values survive a cast to a torch dtype exactly.
_LOSSLESS_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of a q_proj/k_proj weight (or bias).

    llama.cpp views each head's ``head_dim`` rows as ``(2, head_dim/2)`` and transposes
    to ``(head_dim/2, 2)``; this views them as ``(head_dim/2, 2)`` and transposes back.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of ``arch``, or None when the name is unknown."""
    recurrent = arch in gguf_recurrent.ARCHITECTURES
    bare = _QWEN35_BARE_NAMES if arch in _QWEN35 else gguf_recurrent.BARE_NAMES.get(arch, {})
    blk, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]
    if blk == "blk" and layer.isdigit() and rest in bare:
        return f"model.layers.{int(layer)}.{bare[rest]}"
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    gpt2 = arch == "gpt2"
    top = _GPT2_TOP_LEVEL_NAMES if gpt2 else gguf_recurrent.TOP_LEVEL_NAMES[arch] if recurrent else _TOP_LEVEL_NAMES
    if stem in top:
        return f"{top[stem]}.{suffix}"
    parts = stem.split(".")
    if recurrent:
        names = gguf_recurrent.BLOCK_NAMES[arch]
    else:
        names = _GPT2_BLOCK_NAMES if gpt2 else _BLOCK_NAMES | _ARCH_BLOCK_NAMES.get(arch, {})
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer = f"transformer.h.{int(parts[1])}" if gpt2 else f"model.layers.{int(parts[1])}"
        if parts[2] in names:
            return f"{layer}.{names[parts[2]]}.{suffix}"
    return None


def past_last_layer(gguf_name: str, layers: int | None) -> bool:
    """Whether ``gguf_name`` is a tensor of a block past the decoder's ``layers``: the
    multi-token-prediction blocks llama.cpp appends (``nextn_predict_layers``)."""
    parts = gguf_name.split(".")
    return (layers is not None and len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit()
            and int(parts[1]) >= layers)


def stored_value_fix(arch: str, hf_name: str) -> Any:
    """How a GGUF tensor's dense values differ from the Hugging Face weight ``hf_name``
    of ``arch``: a function from the stored values (fp32) to the weight's, or None.

    * llama.cpp's converter stores Gemma's norm weights, and every Qwen3.5 norm but the
      Gated DeltaNet's gated one, as ``1 + w`` (its RMSNorm multiplies by the weight as
      is; both Hugging Face families add the 1 themselves);
    * Qwen3.5's ``A_log``, and every Mamba mixer's, is stored as the decay rate it gives,
      ``-exp(A_log)``.
    """
    if hf_name.endswith("norm.weight") and (
            arch in _GEMMA or (arch in _QWEN35 and not hf_name.endswith("linear_attn.norm.weight"))):
        return _minus_one
    if (arch in _QWEN35 or arch in gguf_recurrent.ARCHITECTURES) and hf_name.endswith(".A_log"):
        return _log_of_negated
    return None


def _minus_one(value: torch.Tensor) -> torch.Tensor:
    return value.float() - 1.0


def _log_of_negated(value: torch.Tensor) -> torch.Tensor:
    return torch.log(-value.float())


def convert_gguf(path: Path, out: Path) -> None:
    """Write the Hugging Face folder for GGUF file ``path`` into the existing folder ``out``.

    Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json (with the GGUF's chat template). Raises
    :class:`CorruptModelError` for a file that does not parse and
    :class:`UnsupportedModelError` for an architecture, tensor or quantization type this
    converter does not handle; both name ``path``.
    """

    reader = _open_reader(path)
    fields = _Fields(reader, path)
    arch = fields.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(_ARCHITECTURES))}"
        )
    config = _hf_config(fields, arch, reader, path)
    tensors = _hf_tensors(reader, config, arch=arch, path=path)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(path, out, model_max_length=config.get("max_position_embeddings", config.get("n_positions")))


def _reader_class() -> type:
    # gguf (gguf-py) is imported on use (a fifth of a second): only GGUF loads need it.
    from gguf import GGUFReader

    class _PlainArrayReader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map.

        GGUFReader slices its ``np.memmap`` once per metadata value (~250k times for a
        49k-token vocabulary), and every memmap slice runs memmap's Python-level
        ``__array_finalize__``. A plain view of the same mapping skips that: measured 6.8 s
        -> 2.3 s on SmolLM2's GGUF. The mapping stays alive as the view's base.
        """

        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray)

    return _PlainArrayReader


def _open_reader(path: Path) -> Any:
    try:
        return _reader_class()(path)
    except Exception as exc:  # noqa: BLE001 -- any parse failure means a corrupt file
        # GGUFReader reports bad bytes as ValueError, IndexError, struct or numpy errors
        # depending on where the parse stops; to the caller they all mean one thing.
        raise CorruptModelError(f"{path}: not a readable GGUF file ({exc})") from exc


class _Fields:
    """Typed access to a GGUF's metadata with errors that name the file and the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = ...) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is ...:
                raise CorruptModelError(f"{self._path}: GGUF metadata lacks {key!r}")
            return default
        try:
            return field.contents()
        except Exception as exc:  # noqa: BLE001 -- a malformed field is a corrupt file
            raise CorruptModelError(f"{self._path}: GGUF metadata {key!r} is bad ({exc})") from exc


def _hf_config(fields: _Fields, arch: str, reader: Any, path: Path) -> dict[str, Any]:
    hf_arch, model_type, _ = _ARCHITECTURES[arch]
    names = {t.name: t for t in reader.tensors}
    if arch == "gpt2":
        return gguf_families.gpt2_config(fields, _natural_dtype_name(reader), names)
    if "rope_freqs.weight" in names:
        # Llama 3.1-style scaling is stored as per-frequency factors, not as the four
        # parameters Hugging Face's config wants; recovering them is not implemented.
        raise UnsupportedModelError(f"{path}: rope_freqs (Llama 3.1 RoPE scaling) is not supported")
    if "token_embd.weight" not in names:
        raise CorruptModelError(f"{path}: GGUF has no token_embd.weight tensor")
    bos, eos = _token_ids(fields)
    base = {
        # ggml shape of the embedding is [hidden, vocab].
        "vocab_size": int(names["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": _natural_dtype_name(reader),
    }
    if arch in gguf_recurrent.ARCHITECTURES:
        return gguf_recurrent.config(fields, arch, names, base, path)
    hidden = int(fields.get(f"{arch}.embedding_length"))
    heads = int(fields.get(f"{arch}.attention.head_count"))
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedModelError(f"{path}: per-layer KV head counts are not supported")
    config: dict[str, Any] = base | {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        # Qwen3.5-MoE has no dense MLP: its files may leave the dense width out.
        "intermediate_size": int(fields.get(f"{arch}.feed_forward_length", 0 if arch == "qwen35moe" else ...)),
        # A multi-token-prediction block (GLM-4.5's, Qwen3.5's) follows the decoder's blocks,
        # counted in block_count; it is not read (see past_last_layer).
        "num_hidden_layers": int(fields.get(f"{arch}.block_count")) - int(fields.get(f"{arch}.nextn_predict_layers", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        # 10000 is llama.cpp's default when the key is absent.
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": gguf_families.rope_scaling(fields, arch, path),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length")),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
    }
    if arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        config["use_sliding_window"] = False
    if arch in _GEMMA:
        config.update(gguf_families.gemma_config(fields, arch, config))
    if arch == "phi3":
        config.update(_phi3_config(fields, names, config, path))
    if arch in ("granite", "granitemoe"):  # its four multipliers, under llama.cpp's names
        for hf_key, key, default in (("embedding_multiplier", "embedding_scale", 1.0),
                                     ("residual_multiplier", "residual_scale", 1.0),
                                     ("attention_multiplier", "attention.scale", None),
                                     ("logits_scaling", "logit_scale", 1.0)):
            value = fields.get(f"{arch}.{key}", default)
            if value is not None:
                config[hf_key] = float(value)
    if int(fields.get(f"{arch}.expert_count", 0)):
        config.update(gguf_families.moe_config(fields, arch, names))
    if arch in _QWEN35:
        config.update(gguf_families.qwen35_config(fields, arch, config, path))
    return config


def _token_ids(fields: _Fields) -> tuple[int | None, int | list[int]]:
    """The BOS id (or None) and the EOS id, or ids: chat models often end a turn with a
    separate end-of-turn token, and generation stops on both."""
    bos = fields.get("tokenizer.ggml.bos_token_id", None)
    eos = [int(fields.get("tokenizer.ggml.eos_token_id"))]
    eot = fields.get("tokenizer.ggml.eot_token_id", None)
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    return None if bos is None else int(bos), eos[0] if len(eos) == 1 else eos


def _phi3_config(fields: _Fields, names: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    rotary = int(fields.get("phi3.rope.dimension_count", config["head_dim"]))
    if not 0 < rotary <= config["head_dim"]:
        raise CorruptModelError(f"{path}: phi3.rope.dimension_count {rotary} is not within head_dim {config['head_dim']}")
    extra: dict[str, Any] = {
        # Phi-4-mini rotates 96 of 128 values a head (llama.cpp's n_rot, NeoX-style as HF's).
        "partial_rotary_factor": rotary / config["head_dim"],
        "original_max_position_embeddings": int(
            fields.get("phi3.rope.scaling.original_context_length", config["max_position_embeddings"])
        ),
        "sliding_window": fields.get("phi3.attention.sliding_window", None),
    }
    present = [n for n in _ROPE_FACTOR_TENSORS if n in names]
    if present:
        if len(present) != 2:
            raise CorruptModelError(f"{path}: GGUF has only one of {', '.join(_ROPE_FACTOR_TENSORS)}")
        long, short = (_dequantize(names[n], path).reshape(-1).tolist() for n in _ROPE_FACTOR_TENSORS)
        extra["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
    return extra


def _natural_dtype_name(reader: Any) -> str:
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if kinds == {"F16"}:
        return "float16"
    if kinds == {"BF16"}:
        return "bfloat16"
    return "float32"


def _hf_tensors(reader: Any, config: dict[str, Any], *, arch: str, path: Path) -> dict[str, torch.Tensor]:
    permuted = _ARCHITECTURES[arch][2]
    tensors: dict[str, torch.Tensor] = {}
    joined: dict[str, dict[int, torch.Tensor]] = {}  # parts of one tensor (gguf_recurrent.JOINED)
    for t in reader.tensors:
        if arch == "phi3" and t.name in _ROPE_FACTOR_TENSORS:
            continue  # read into config.json's rope_scaling
        if past_last_layer(t.name, config.get("num_hidden_layers", config.get("n_layer"))):  # GPT-2's n_layer
            continue
        moe = None if arch in gguf_recurrent.JOINED else _moe_tensors(t, config, path)  # Granite's: stacked
        if moe is not None:
            tensors.update(moe)
            continue
        name = hf_tensor_name(t.name, arch)
        if name is None:
            raise UnsupportedModelError(f"{path}: unknown GGUF tensor {t.name!r}")
        value = _dequantize(t, path)
        if permuted and name.endswith(".q_proj.weight"):
            value = unpermute_qk(value, config["num_attention_heads"])
        elif permuted and name.endswith(".k_proj.weight"):
            value = unpermute_qk(value, config["num_key_value_heads"])
        elif arch == "gpt2" and name.endswith(GPT2_CONV1D):
            value = value.t()  # llama.cpp's [out, in] back to Conv1D's [in, out]
        elif (arch in _QWEN35 or arch in gguf_recurrent.ARCHITECTURES) and name.endswith("conv1d.weight"):
            value = value.unsqueeze(1)  # llama.cpp drops the depthwise kernel's middle axis
        value = value.reshape(gguf_recurrent.hf_shape(arch, name, tuple(value.shape)))
        fix = stored_value_fix(arch, name)
        if fix is not None:
            value = fix(value)
        part = gguf_recurrent.joined_part(arch, t.name)
        if part is not None:
            joined.setdefault(name, {})[part] = value
            continue
        tensors[name] = value.contiguous()
    for name, parts in joined.items():
        if sorted(parts) != list(range(len(parts))) or len(parts) < 2:
            raise CorruptModelError(f"{path}: {name} has parts {sorted(parts)} of the GGUF's, not all of them")
        tensors[name] = torch.cat([parts[i] for i in sorted(parts)], dim=-2).contiguous()  # rows; a stack's each
    return tensors


def moe_tensor_names(gguf_name: str, model_type: str, experts: int) -> list[str] | None:
    """The Hugging Face names of a GGUF expert stack (one per expert, in order; a fused
    gate-and-up stack two per expert, gate then up) or of a router / shared-expert tensor
    (one); None for any other tensor."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or suffix != "weight":
        return None
    kind = parts[2]
    mixtral = model_type == "mixtral"
    module = {"mixtral": "block_sparse_moe", "jamba": "feed_forward", "nemotron_h": "mixer"}.get(model_type, "mlp")
    prefix = f"model.layers.{int(parts[1])}.{module}."
    if kind == "ffn_gate_inp" and model_type == "jamba":
        return [f"{prefix}router.weight"]
    if model_type == "nemotron_h" and kind.endswith("_shexp"):
        return None  # Nemotron 3's shared expert: a block's own tensors (gguf_recurrent.BLOCK_NAMES)
    if kind in _MOE_BLOCK_NAMES:
        return [f"{prefix}{_MOE_BLOCK_NAMES[kind]}.weight"]
    projections = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    if kind == GATE_UP_STACK:
        return [f"{prefix}experts.{e}.{projections[j]}.weight" for e in range(experts) for j in (0, 1)]
    if kind not in _EXPERT_STACKS:
        return None
    return [f"{prefix}experts.{e}.{projections[_EXPERT_STACKS[kind]]}.weight" for e in range(experts)]


def _moe_tensors(t: Any, config: dict[str, Any], path: Path) -> dict[str, torch.Tensor] | None:
    """The Hugging Face tensors of a GGUF expert or router tensor; None for any other."""
    experts = int(t.shape[-1]) if len(t.shape) == 3 else 1
    names = moe_tensor_names(t.name, config["model_type"], experts)
    if names is None:
        return None
    value = _dequantize(t, path)
    kind = t.name.split(".")[2]
    if kind not in _EXPERT_STACKS and kind != GATE_UP_STACK:
        if kind == "ffn_gate_inp_shexp":
            value = value.reshape(1, -1)
        return {names[0]: value.contiguous()}
    if value.dim() != 3:
        raise CorruptModelError(f"{path}: expert tensor {t.name!r} is not 3-D ({tuple(value.shape)})")
    if kind == GATE_UP_STACK:  # each expert's gate rows, then its up rows
        halves = value.reshape(value.shape[0] * 2, value.shape[1] // 2, value.shape[2])
        return {name: halves[i].clone() for i, name in enumerate(names)}
    return {name: value[e].clone() for e, name in enumerate(names)}


def _dequantize(t: Any, path: Path) -> torch.Tensor:
    from gguf.quants import dequantize  # on use: see _reader_class

    kind = t.tensor_type.name
    try:
        array = dequantize(t.data, t.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedModelError(
            f"{path}: tensor {t.name!r} has quantization type {kind}, which cannot be dequantized"
        ) from exc
    except ValueError as exc:
        raise CorruptModelError(f"{path}: tensor {t.name!r} ({kind}) is malformed: {exc}") from exc
    # ggml lists dimensions fastest first; torch wants them slowest first.
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    # F32 and F16 come back as views of the read-only memory map; torch wants its own copy.
    writable = array if array.flags.writeable else np.array(array)
    tensor = torch.from_numpy(np.ascontiguousarray(writable)).reshape(shape)
    return tensor.to(_LOSSLESS_TORCH_DTYPES.get(kind, torch.float32))


def _write_tokenizer(path: Path, out: Path, *, model_max_length: int) -> None:
    arch, tokenizer_dict, tokenizer_config = _gguf_tokenizer(path)
    backend = _build_backend(arch, tokenizer_dict, path)
    if tokenizer_dict.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE_TOKENIZERS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    backend.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer_config.get("bos_token"),
        "eos_token": tokenizer_config.get("eos_token"),
        "unk_token": tokenizer_config.get("unk_token"),
        "pad_token": tokenizer_config.get("pad_token"),
        "add_bos_token": bool(tokenizer_config.get("add_bos_token", False)),
        "add_eos_token": bool(tokenizer_config.get("add_eos_token", False)),
        "chat_template": tokenizer_config.get("chat_template"),
        "model_max_length": model_max_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _gguf_tokenizer(path: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    # transformers is heavy (seconds to import): only a GGUF's first conversion needs it.
    from transformers.integrations.gguf import get_gguf_tokenizer

    try:
        return get_gguf_tokenizer(str(path))
    except (KeyError, TypeError, IndexError) as exc:
        raise CorruptModelError(
            f"{path}: GGUF tokenizer metadata is missing or bad ({exc})"
        ) from exc


def _build_backend(arch: str, tokenizer_dict: dict[str, Any], path: Path) -> Any:
    from transformers.integrations.gguf import convert_gguf_tokenizer  # on use: see _gguf_tokenizer

    if "tokens" not in tokenizer_dict:
        raise CorruptModelError(f"{path}: GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    try:
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except ValueError as exc:
        raise UnsupportedModelError(f"{path}: tokenizer cannot be converted: {exc}") from exc
    return backend
