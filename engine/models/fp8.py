"""Checkpoints whose config.json names a ``quantization_config``: FP8 weights read and
dequantized as they load, every other method refused by name.

Two FP8 layouts are on the Hub:

* ``quant_method`` "fp8" with a ``weight_block_size`` (DeepSeek-V3's format, Qwen3's
  ``-FP8`` releases): a linear layer's weight is ``float8_e4m3fn`` codes beside
  ``weight_scale_inv``, one fp32 scale per block of rows x columns.
* ``quant_method`` "compressed-tensors" with ``format`` "float-quantized" (llm-compressor's
  ``FP8``/``FP8-dynamic`` models): the codes beside ``weight_scale``, one scale for the
  tensor, one per output channel, or one per block (``strategy`` tensor, channel,
  block), as each config group's ``weights`` says.

Either way weight = codes x the scale that covers it. Each such weight becomes that
product in fp32 when the folder is read (a tensor-parallel or pipeline rank, which reads
its cut of each tensor lazily, multiplies each cut as it reads it), then takes the model's dtype as any dense weight
does (``--dtype``; ``auto``: config.json's ``torch_dtype``), and the scales are dropped:
the model runs dense with 16-bit activations, as vLLM runs an FP8 checkpoint (weight-only)
on a device without FP8 matmuls; activation scales (``input_scale``) are not read.
Tensors stored in another dtype (norms, embeddings, an ignored ``lm_head``) pass as they
are.

Other methods and formats (GPTQ, AWQ, bitsandbytes, compressed-tensors' integer and
packed formats, ...) would need their own kernels or dequantizers: a folder naming one is
refused with an error that names it, rather than failing later on a tensor it lacks. A
GGUF file is this engine's quantized format (``--quantization``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.checkpoint import StoredTensor

_STRATEGIES = ("tensor", "channel", "block")


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Layout:
    """Where an FP8 checkpoint keeps its scales: the name each weight's scale takes in
    place of ``weight``, and the block (rows, columns) one scale covers (None: one scale
    for the tensor, or one per output row, read from the scale's shape)."""

    scale_name: str
    block: tuple[int, int] | None


def fp8_layout(raw_config: Mapping[str, Any], where: str) -> Fp8Layout | None:
    """The FP8 layout a config.json names, or None without a ``quantization_config``;
    :class:`UnsupportedModelError`, naming ``where`` (the config's path) and the method,
    for anything else."""
    quant = raw_config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if method == "fp8":
        block = _block(quant.get("weight_block_size"), where, "weight_block_size")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedModelError(f"{where}: fp8 format {quant.get('fmt')!r} is not "
                                        "supported (e4m3 is)")
        return Fp8Layout("weight_scale_inv", block)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    raise UnsupportedModelError(
        f"{where}: quantization_config's quant_method {method!r} is not supported (this engine "
        "reads fp8 checkpoints, dense ones and GGUF files)")


def _block(value: Any, where: str, field: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)):
        raise UnsupportedModelError(f"{where}: an fp8 checkpoint's {field} must be two positive "
                                    f"integers, got {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors(quant: Mapping[str, Any], where: str) -> Fp8Layout:
    fmt = quant.get("format")
    if fmt != "float-quantized":
        raise UnsupportedModelError(f"{where}: compressed-tensors format {fmt!r} is not "
                                    "supported (float-quantized, fp8 weights, is)")
    groups = quant.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values() if isinstance(g, Mapping)]
    if not schemes or not all(isinstance(s, Mapping) for s in schemes):
        raise UnsupportedModelError(f"{where}: compressed-tensors config_groups without weights")
    blocks = set()
    for scheme in schemes:
        if (scheme.get("type"), scheme.get("num_bits")) != ("float", 8):
            raise UnsupportedModelError(f"{where}: compressed-tensors weights of type "
                                        f"{scheme.get('type')!r} and {scheme.get('num_bits')} bits "
                                        "are not supported (8-bit float is)")
        strategy = scheme.get("strategy")
        if strategy not in _STRATEGIES:
            raise UnsupportedModelError(f"{where}: compressed-tensors strategy {strategy!r} is not "
                                        f"supported ({', '.join(_STRATEGIES)} are)")
        blocks.add(_block(scheme.get("block_structure"), where, "block_structure")
                   if strategy == "block" else None)
    if len(blocks) != 1:
        raise UnsupportedModelError(f"{where}: compressed-tensors groups with different weight "
                                    "scale layouts are not supported")
    return Fp8Layout("weight_scale", blocks.pop())


def dequantize_fp8(weights: dict[str, Any], layout: Fp8Layout, where: str) -> dict[str, Any]:
    """``weights`` with each ``float8_e4m3fn`` weight multiplied out by its scales (fp32),
    the scales dropped. Tensors read (a whole load) are multiplied now; stored ones (a
    tensor-parallel rank's lazy load, engine/models/checkpoint.py) become
    :class:`DequantizedTensor` s, which multiply each cut as it is read."""
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.endswith(layout.scale_name):
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            out[name] = tensor
            continue
        scale_name = name.removesuffix("weight") + layout.scale_name
        scale = weights.get(scale_name)
        if scale is None or len(tensor.shape) != 2:
            raise CorruptModelError(f"{where}: the fp8 tensor {name} has no {scale_name} "
                                    "(or is not a matrix)")
        what = f"{where}: {scale_name}"
        if isinstance(tensor, StoredTensor):
            out[name] = DequantizedTensor(tensor, scale, layout.block, what)
        else:
            out[name] = tensor.float() * _expanded(scale.float(), tensor.shape, layout.block, what)
    return out


class DequantizedTensor(StoredTensor):
    """A stored fp8 weight read dequantized: each cut of its codes (rows, or input
    columns) times the same cut of its scales, expanded over the whole matrix (a scale
    table is the weight's size over a block's, small enough to read whole each time)."""

    def __init__(self, codes: StoredTensor, scale: Any, block: tuple[int, int] | None,
                 what: str) -> None:
        self.codes, self.scale, self.block, self.what = codes, scale, block, what
        self.name, self.shape, self.dtype, self.layout = codes.name, codes.shape, torch.float32, None

    def _scales(self) -> torch.Tensor:
        scale = self.scale.read() if isinstance(self.scale, StoredTensor) else self.scale
        return _expanded(scale.float(), torch.Size(self.shape), self.block, self.what)

    def read_rows(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        scale = self._scales()
        if scale.dim() == 2:  # one a row (or block): the spans' rows of it
            scale = torch.cat([scale[a:b] for a, b in spans])
        return self.codes.read_rows(spans).float() * scale

    def read_cols(self, start: int, stop: int) -> torch.Tensor:
        scale = self._scales()
        if scale.dim() == 2 and scale.shape[1] > 1:  # blocks: the columns' scales
            scale = scale[:, start:stop]
        return self.codes.read_cols(start, stop).float() * scale


def _expanded(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None,
              what: str) -> torch.Tensor:
    """``scale`` in a shape that broadcasts over a weight of ``shape``."""
    rows, cols = shape
    if block is not None:
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != want:
            raise CorruptModelError(f"{what} is {tuple(scale.shape)}, not {want} blocks of "
                                    f"{block[0]} x {block[1]} over {rows} x {cols}")
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        return full[:rows, :cols]
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.numel() == rows and scale.dim() <= 2 and (scale.dim() < 2 or scale.shape[1] == 1):
        return scale.reshape(rows, 1)
    raise CorruptModelError(f"{what} is {tuple(scale.shape)}: neither one scale nor one per "
                            f"row of {rows}")
