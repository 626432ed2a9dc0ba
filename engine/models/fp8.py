"""Checkpoints whose config.json names a ``quantization_config``: block-scaled FP8 read
and dequantized as it loads, every other method refused by name.

The FP8 checkpoints on the Hub (DeepSeek-V3's format, Qwen3's ``-FP8`` releases:
``quant_method`` "fp8", ``fmt`` "e4m3", ``weight_block_size`` ``[128, 128]``) store a
linear layer's weight as ``float8_e4m3fn`` codes beside ``weight_scale_inv``, one fp32
scale per block of rows x columns: weight = codes x the scale of its block. Here each such
weight becomes that product in fp32 when the folder is read, then takes the model's
dtype as any dense weight does (``--dtype``; ``auto``: config.json's ``torch_dtype``),
and the scales are dropped: the model runs dense, as vLLM runs an FP8 checkpoint on a
device without FP8 matmuls. Tensors stored in another dtype (norms, embeddings, a
``modules_to_not_convert`` layer) pass as they are.

Other methods (GPTQ, AWQ, bitsandbytes, compressed-tensors, ...) would need their own
kernels or dequantizers: a folder naming one is refused with an error that names it,
rather than failing later on a tensor it lacks. A GGUF file is this engine's quantized
format (``--quantization``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.errors import CorruptModelError, UnsupportedModelError

SCALE_SUFFIX = "weight_scale_inv"


def fp8_block_size(raw_config: Mapping[str, Any], where: str) -> tuple[int, int] | None:
    """The ``(rows, columns)`` of a block-scaled FP8 checkpoint's scale blocks, or None for
    a checkpoint without a ``quantization_config``; :class:`UnsupportedModelError`, naming
    ``where`` (the config's path) and the method, for any other."""
    quant = raw_config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if method != "fp8":
        raise UnsupportedModelError(
            f"{where}: quantization_config's quant_method {method!r} is not supported (this "
            "engine reads block-scaled fp8 checkpoints, dense ones and GGUF files)")
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedModelError(
            f"{where}: an fp8 checkpoint without a weight_block_size of two positive integers "
            f"(per-tensor fp8 scales) is not supported, got {block!r}")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(f"{where}: fp8 format {quant.get('fmt')!r} is not supported "
                                    "(e4m3 is)")
    return int(block[0]), int(block[1])


def dequantize_fp8(weights: dict[str, torch.Tensor], block: tuple[int, int],
                   where: str) -> dict[str, torch.Tensor]:
    """``weights`` with each ``float8_e4m3fn`` weight multiplied out by its
    ``weight_scale_inv`` blocks (fp32), the scales dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            out[name] = tensor
            continue
        scale_name = name.removesuffix("weight") + SCALE_SUFFIX
        scale = weights.get(scale_name)
        if scale is None or tensor.dim() != 2:
            raise CorruptModelError(f"{where}: the fp8 tensor {name} has no {scale_name} "
                                    "(or is not a matrix)")
        rows, cols = tensor.shape
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != want:
            raise CorruptModelError(f"{where}: {scale_name} is {tuple(scale.shape)}, not {want} "
                                    f"blocks of {block[0]} x {block[1]} over {name}'s {rows} x {cols}")
        full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        out[name] = tensor.float() * full[:rows, :cols]
    return out
