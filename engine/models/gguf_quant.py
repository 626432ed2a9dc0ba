"""Read a GGUF's tensors with the quantized ones kept in their blocks.

The conversion cache (:mod:`engine.models.gguf_convert`) writes a dequantized Hugging Face
folder; it still supplies the config and the tokenizer, but with quantization on, the
weights come from the GGUF itself: ``gguf.GGUFReader`` memory-maps the file, each
quantized tensor's rows of blocks are copied out once and repacked for the kernels
(:class:`engine.ops.quant.QuantizedWeight`), and the map is dropped when the reader goes.
Tensors of other types (F32 norms, F16, or a block format the kernels lack) are
dequantized as the converter does, and the log names the block formats that were.

The per-tensor fix-ups mirror ``gguf_convert._hf_tensors`` (phi3's RoPE factor tensors
skipped, Gemma's stored 1 + w norms undone); llama.cpp's q/k row permutation (see
:func:`gguf_convert.unpermute_qk`) acts on whole rows,
and each row of a block-quantized tensor is its own run of blocks, so it is undone on the
block rows without dequantizing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from engine.errors import UnsupportedModelError
from engine.models import gguf_convert
from engine.models.config import ModelConfig
from engine.ops.quant import LAYOUT_FORMATS, QuantizedWeight

logger = logging.getLogger("engine.models")


@dataclasses.dataclass(frozen=True, slots=True)
class GgufWeights:
    """Tensors under Hugging Face names: ``QuantizedWeight`` for kept blocks, else dense."""

    weights: dict[str, QuantizedWeight | torch.Tensor]
    file_tensor_bytes: int  # the file's bytes of tensor data (the 1.2x budget's base)
    kept: dict[str, int]  # block format -> tensors kept quantized
    dequantized: dict[str, int]  # non-float type -> tensors dequantized


def read_gguf_weights(path: Path, config: ModelConfig, *, device: torch.device, layout: str = "panels") -> GgufWeights:
    """The weights of GGUF ``path`` with the matrices of the formats ``layout``'s kernels
    read kept on ``device`` (panels: Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, for the C kernels;
    blocks: Q4_0/Q4_1/Q8_0/Q4_K, for the Triton kernel)."""
    formats = LAYOUT_FORMATS[layout]
    reader = gguf_convert._open_reader(path)
    arch = gguf_convert._Fields(reader, path).get("general.architecture")
    if arch not in gguf_convert._ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported")
    permuted = gguf_convert._ARCHITECTURES[arch][2]
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    weights: dict[str, QuantizedWeight | torch.Tensor] = {}
    kept: Counter[str] = Counter()
    dequantized: Counter[str] = Counter()
    total = 0
    for t in reader.tensors:
        if arch == "phi3" and t.name in gguf_convert._ROPE_FACTOR_TENSORS:
            continue  # read into config.json's rope_scaling by the converter
        total += int(t.n_bytes)
        kind = t.tensor_type.name
        # Expert stacks (3-D) and routers are split into per-expert matrices as the
        # converter does; the expert kernels take dense weights, so their blocks are not kept.
        moe = gguf_convert._moe_tensors(t, {"model_type": config.architecture}, path)
        if moe is not None:
            weights.update(moe)
            if kind not in gguf_convert._LOSSLESS_TORCH_DTYPES:
                dequantized[f"{kind} (experts)"] += 1
            continue
        name = gguf_convert.hf_tensor_name(t.name, arch)
        if name is None:
            raise UnsupportedModelError(f"{path}: unknown GGUF tensor {t.name!r}")
        proj = name.rsplit(".", 2)[-2] if permuted else ""
        if kind in formats and len(t.shape) == 2:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # own copy of [N, bytes]
            if proj in heads:
                raw = gguf_convert.unpermute_qk(raw, heads[proj]).contiguous()
            weights[name] = QuantizedWeight.from_blocks(raw, kind, int(t.shape[0]), device=device, layout=layout)
            kept[kind] += 1
            continue
        value = gguf_convert._dequantize(t, path)
        if proj in heads:
            value = gguf_convert.unpermute_qk(value, heads[proj])
        elif arch in gguf_convert._GEMMA and name.endswith("norm.weight"):
            value = value.float() - 1.0  # llama.cpp stores Gemma's norms as 1 + w (as the converter undoes)
        if kind not in gguf_convert._LOSSLESS_TORCH_DTYPES:
            dequantized[kind] += 1
        weights[name] = value.contiguous()
    del reader  # the memory map goes with it
    if dequantized:
        logger.info(
            "%s: dequantized %s (no kernel for these block formats; kept: %s)",
            path.name, ", ".join(f"{n} {k}" for k, n in sorted(dequantized.items())),
            ", ".join(f"{n} {k}" for k, n in sorted(kept.items())) or "none",
        )
    return GgufWeights(weights, total, dict(kept), dict(dequantized))


__all__ = ["GgufWeights", "read_gguf_weights"]
