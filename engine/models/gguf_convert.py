"""Convert a GGUF file into a Hugging Face model folder.

llama.cpp's GGUF format differs from a Hugging Face checkpoint in four ways this module
undoes:

* tensor names (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``);
* shapes are written fastest-dimension first (ggml order), the reverse of torch's;
* tensors may be block-quantized (Q8_0, Q4_K, ...): they are dequantized here, through
  ``gguf.quants.dequantize``, into float32 (F16/BF16 tensors keep their own precision,
  which is lossless);
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

from engine.errors import CorruptModelError, UnsupportedModelError

# Bump when the converter's output changes, so cached conversions are redone.
CONVERTER_VERSION = 1

# GGUF architecture -> (Hugging Face architecture, model_type, q/k rows permuted).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

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


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when the name is unknown."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def convert_gguf(path: Path, out: Path) -> None:
    """Write the Hugging Face folder for GGUF file ``path`` into the existing folder ``out``.

    Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json (with the GGUF's chat template). Raises
    :class:`CorruptModelError` for a file that does not parse and
    :class:`UnsupportedModelError` for an architecture, tensor or quantization type this
    converter does not handle; both name ``path``.
    """
    from safetensors.torch import save_file

    reader = _open_reader(path)
    fields = _Fields(reader, path)
    arch = fields.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(_ARCHITECTURES))}"
        )
    config = _hf_config(fields, arch, reader, path)
    tensors = _hf_tensors(reader, config, permuted=_ARCHITECTURES[arch][2], path=path)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(path, out, model_max_length=config["max_position_embeddings"])


def _reader_class() -> type:
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
    if "rope_freqs.weight" in names:
        # Llama 3.1-style scaling is stored as per-frequency factors, not as the four
        # parameters Hugging Face's config wants; recovering them is not implemented.
        raise UnsupportedModelError(f"{path}: rope_freqs (Llama 3.1 RoPE scaling) is not supported")
    if "token_embd.weight" not in names:
        raise CorruptModelError(f"{path}: GGUF has no token_embd.weight tensor")
    hidden = int(fields.get(f"{arch}.embedding_length"))
    heads = int(fields.get(f"{arch}.attention.head_count"))
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedModelError(f"{path}: per-layer KV head counts are not supported")
    bos = fields.get("tokenizer.ggml.bos_token_id", None)
    eos = [int(fields.get("tokenizer.ggml.eos_token_id"))]
    # Chat models often end a turn with a separate end-of-turn token; stop on both.
    eot = fields.get("tokenizer.ggml.eot_token_id", None)
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        # ggml shape of the embedding is [hidden, vocab].
        "vocab_size": int(names["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(fields.get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(fields.get(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        # 10000 is llama.cpp's default when the key is absent.
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(fields, arch, path),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": _natural_dtype_name(reader),
        "hidden_act": "silu",
    }
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    return config


def _rope_scaling(fields: _Fields, arch: str, path: Path) -> dict[str, Any] | None:
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(fields.get(f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = int(fields.get(f"{arch}.rope.scaling.original_context_length"))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported")


def _natural_dtype_name(reader: Any) -> str:
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if kinds == {"F16"}:
        return "float16"
    if kinds == {"BF16"}:
        return "bfloat16"
    return "float32"


def _hf_tensors(
    reader: Any, config: dict[str, Any], *, permuted: bool, path: Path
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            raise UnsupportedModelError(f"{path}: unknown GGUF tensor {t.name!r}")
        value = _dequantize(t, path)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            value = unpermute_qk(value, config["num_attention_heads"])
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            value = unpermute_qk(value, config["num_key_value_heads"])
        tensors[name] = value.contiguous()
    return tensors


def _dequantize(t: Any, path: Path) -> torch.Tensor:
    from gguf.quants import dequantize

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
        from tokenizers import pre_tokenizers

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
    from transformers.integrations.gguf import get_gguf_tokenizer

    try:
        return get_gguf_tokenizer(str(path))
    except (KeyError, TypeError, IndexError) as exc:
        raise CorruptModelError(
            f"{path}: GGUF tokenizer metadata is missing or bad ({exc})"
        ) from exc


def _build_backend(arch: str, tokenizer_dict: dict[str, Any], path: Path) -> Any:
    from transformers.integrations.gguf import convert_gguf_tokenizer

    if "tokens" not in tokenizer_dict:
        raise CorruptModelError(f"{path}: GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    try:
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except ValueError as exc:
        raise UnsupportedModelError(f"{path}: tokenizer cannot be converted: {exc}") from exc
    return backend
