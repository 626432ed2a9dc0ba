"""Checkpoints whose config.json names a ``quantization_config``: FP8, int8 and packed-integer
weights read and dequantized as they load, every other method refused by name.

Four layouts are read:

* ``quant_method`` "fp8" with a ``weight_block_size`` (DeepSeek-V3's format, Qwen3's
  ``-FP8`` releases): a linear layer's weight is ``float8_e4m3fn`` codes beside
  ``weight_scale_inv``, one fp32 scale per block of rows x columns.
* ``quant_method`` "compressed-tensors", ``format`` "float-quantized" (llm-compressor's
  ``FP8`` / ``FP8-dynamic`` models): the codes beside ``weight_scale``, one scale for the
  tensor, one per output channel, or one per block (``strategy`` tensor, channel, block).
* ``quant_method`` "compressed-tensors", ``format`` "int-quantized" (llm-compressor's
  ``W8A8`` int8 models): symmetric int8 codes in ``weight`` beside ``weight_scale``, one
  for the tensor, one per output channel, or one per ``group_size`` columns of a row.
* ``quant_method`` "compressed-tensors", ``format`` "pack-quantized" (llm-compressor's
  ``W4A16`` / ``W8A16`` models, GPTQ- or RTN-made): integers of ``num_bits``
  packed into int32 words along each row (``weight_packed``, the lowest bits first, each
  value stored plus ``2 ** (num_bits - 1)``), ``weight_shape``, and ``weight_scale``, one
  per ``group_size`` columns of a row (``strategy`` group) or per row (channel); an
  asymmetric one adds ``weight_zero_point``, as many, packed the same way down the rows.

Each weight becomes codes x the scale that covers it (integers: multiplied in the
scale's dtype, as the format's own decompressor does) when the folder is read, or, for
a tensor-parallel or pipeline rank that reads its cut of each tensor lazily, cut by cut
as it reads them; then it takes the model's dtype as any dense weight does (``--dtype``;
``auto``: config.json's ``torch_dtype``), and the scales are dropped. The model runs
dense with 16-bit activations, as vLLM runs such a checkpoint (weight-only) where it has
no kernel for its format; activation scales (``input_scale``) are not read. Tensors stored
in another dtype (norms, embeddings, an ignored ``lm_head``) pass as they are.

Other methods and formats (GPTQ's and AWQ's own, bitsandbytes, act-order integers,
asymmetric int8, ...) would need their own dequantizers: a folder naming one is refused
with an error that names it, rather than failing later on a tensor it lacks. A GGUF file
is this engine's own quantized format (``--quantization``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.checkpoint import StoredTensor

_FLOAT_STRATEGIES = ("tensor", "channel", "block")
_INT_STRATEGIES = ("group", "channel")


@dataclasses.dataclass(frozen=True, slots=True)
class QuantLayout:
    """How a checkpoint stores its quantized weights. ``kind`` "fp8": ``float8_e4m3fn``
    codes in ``weight``, scales in ``scale_name``, each covering a ``block`` of rows x
    columns (None: one for the tensor, or one per row, read from the scale's shape).
    ``kind`` "int8": int8 codes in ``weight``, a scale per ``group`` columns of a row
    (None: per row, or one for the tensor). ``kind`` "packed": ``bits``-bit integers in
    ``weight_packed``, a scale per ``group`` columns of a row (None: per row)."""

    kind: str
    scale_name: str
    block: tuple[int, int] | None = None
    bits: int = 8
    group: int | None = None
    zero_points: bool = False  # packed, asymmetric: ``weight_zero_point`` beside the scales


def checkpoint_quantization(raw_config: Mapping[str, Any], where: str) -> QuantLayout | None:
    """The layout a config.json's ``quantization_config`` names, or None without one;
    :class:`UnsupportedModelError`, naming ``where`` (the config's path) and the method,
    for anything else."""
    quant = raw_config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if method == "fp8":
        block = _pair(quant.get("weight_block_size"), where, "weight_block_size")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedModelError(f"{where}: fp8 format {quant.get('fmt')!r} is not "
                                        "supported (e4m3 is)")
        return QuantLayout("fp8", "weight_scale_inv", block)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    if method == "mxfp4":
        return QuantLayout("mxfp4", "_scales")
    raise UnsupportedModelError(
        f"{where}: quantization_config's quant_method {method!r} is not supported (this engine "
        "reads fp8, mxfp4 and compressed-tensors checkpoints, dense ones and GGUF files)")


def _pair(value: Any, where: str, field: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)):
        raise UnsupportedModelError(f"{where}: a quantized checkpoint's {field} must be two "
                                    f"positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors(quant: Mapping[str, Any], where: str) -> QuantLayout:
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "int-quantized", "pack-quantized"):
        raise UnsupportedModelError(f"{where}: compressed-tensors format {fmt!r} is not "
                                    "supported (float-quantized, int-quantized and "
                                    "pack-quantized are)")
    groups = quant.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values() if isinstance(g, Mapping)]
    if not schemes or not all(isinstance(s, Mapping) for s in schemes):
        raise UnsupportedModelError(f"{where}: compressed-tensors config_groups without weights")
    layouts = {_scheme(scheme, fmt, where) for scheme in schemes}
    if len(layouts) != 1:
        raise UnsupportedModelError(f"{where}: compressed-tensors groups with different weight "
                                    "layouts are not supported")
    return layouts.pop()


def _scheme(scheme: Mapping[str, Any], fmt: str, where: str) -> QuantLayout:
    kind, bits, strategy = scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy")
    if fmt == "float-quantized":
        if (kind, bits) != ("float", 8):
            raise UnsupportedModelError(f"{where}: compressed-tensors float-quantized weights of "
                                        f"type {kind!r} and {bits} bits are not supported "
                                        "(8-bit float is)")
        if strategy not in _FLOAT_STRATEGIES:
            raise UnsupportedModelError(f"{where}: compressed-tensors strategy {strategy!r} is not "
                                        f"supported for fp8 ({', '.join(_FLOAT_STRATEGIES)} are)")
        block = (_pair(scheme.get("block_structure"), where, "block_structure")
                 if strategy == "block" else None)
        return QuantLayout("fp8", "weight_scale", block)
    widths = (8,) if fmt == "int-quantized" else (4, 8)
    if kind != "int" or bits not in widths:
        raise UnsupportedModelError(f"{where}: compressed-tensors {fmt} weights of type {kind!r} "
                                    f"and {bits} bits are not supported "
                                    f"({' and '.join(map(str, widths))}-bit int are)")
    if strategy not in _INT_STRATEGIES + (("tensor",) if fmt == "int-quantized" else ()):
        raise UnsupportedModelError(f"{where}: compressed-tensors strategy {strategy!r} is not "
                                    f"supported for integers ({', '.join(_INT_STRATEGIES)} are)")
    asymmetric = scheme.get("symmetric") is False
    if asymmetric and fmt != "pack-quantized":
        raise UnsupportedModelError(f"{where}: asymmetric compressed-tensors {fmt} integers (zero "
                                    "points) are not supported (pack-quantized ones are)")
    if scheme.get("actorder") not in (None, False):
        raise UnsupportedModelError(f"{where}: compressed-tensors actorder "
                                    f"{scheme.get('actorder')!r} is not supported")
    group = scheme.get("group_size") if strategy == "group" else None
    if strategy == "group" and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise UnsupportedModelError(f"{where}: compressed-tensors group_size must be a positive "
                                    f"integer, got {group!r}")
    return QuantLayout("packed" if fmt == "pack-quantized" else "int8", "weight_scale",
                       bits=int(bits), group=group, zero_points=asymmetric)


def dequantize(weights: dict[str, Any], layout: QuantLayout, where: str) -> dict[str, Any]:
    """``weights`` with each quantized weight dequantized under its own name
    (``...weight``), its scales (and packing's tensors) dropped. Tensors read (a whole
    load) are multiplied now; stored ones (a rank's lazy load,
    engine/models/checkpoint.py) become :class:`DequantizedTensor` s, which multiply each
    cut as it is read."""
    if layout.kind == "mxfp4":
        return _dequantize_mxfp4(weights, where)
    packed = layout.kind == "packed"
    extras = (layout.scale_name, "weight_shape", "weight_zero_point") if packed else (layout.scale_name,)
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.endswith(extras):
            continue
        if packed and name.endswith("weight_packed"):
            base = name.removesuffix("weight_packed")
        elif not packed and tensor.dtype == (torch.int8 if layout.kind == "int8" else torch.float8_e4m3fn):
            base = name.removesuffix("weight")
        else:
            out[name] = tensor
            continue
        scale = weights.get(base + layout.scale_name)
        shape = weights.get(base + "weight_shape") if packed else None
        zero = weights.get(base + "weight_zero_point") if layout.zero_points else None
        if (scale is None or len(tensor.shape) != 2 or (packed and shape is None)
                or (layout.zero_points and zero is None)):
            raise CorruptModelError(f"{where}: the quantized tensor {name} lacks its "
                                    f"{base + layout.scale_name}" + (" or weight_shape" if packed else "")
                                    + (" or weight_zero_point" if layout.zero_points else ""))
        stored = DequantizedTensor(tensor, scale, shape, layout, f"{where}: {name}", zero)
        out[base + "weight"] = stored if isinstance(tensor, StoredTensor) else stored.read()
    return out


# The 16 values of an FP4 (E2M1) code, by its 4 bits: sign, two exponent bits, one mantissa bit.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dequantize_mxfp4(weights: dict[str, Any], where: str) -> dict[str, Any]:
    """gpt-oss's MXFP4 experts (OCP microscaling): ``X_blocks`` [E, rows, cols / 32, 16]
    bytes, two FP4 codes each (the low nibble first), and ``X_scales`` [E, rows, cols / 32],
    one E8M0 power of two (stored + 127) per 32 values; read as ``X`` [E, cols, rows], the
    dense checkpoint's layout (transformers' ``gate_up_proj`` [E, hidden, 2 * inter],
    ``down_proj`` [E, inter, hidden]). Every other tensor passes as it is."""
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in weights:
            continue
        if not name.endswith("_blocks"):
            out[name] = tensor
            continue
        base = name.removesuffix("_blocks")
        scales = weights.get(base + "_scales")
        if scales is None or len(tensor.shape) != 4 or tuple(scales.shape) != tuple(tensor.shape[:3]):
            raise CorruptModelError(f"{where}: the MXFP4 tensor {name} {tuple(tensor.shape)} lacks "
                                    f"its {base}_scales of shape {tuple(tensor.shape[:3])}")
        stored = Mxfp4Tensor(tensor, scales, f"{where}: {name}")
        out[base] = stored if isinstance(tensor, StoredTensor) else stored.read()
    return out


class Mxfp4Tensor(StoredTensor):
    """An MXFP4 weight read dequantized (fp32, exact: every value is a code times a power
    of two), in the dense layout (see :func:`_dequantize_mxfp4`); read whole."""

    def __init__(self, blocks: Any, scales: Any, what: str) -> None:
        self.blocks, self.scales, self.what = blocks, scales, what
        experts, rows, groups, _ = blocks.shape
        self.shape = (experts, groups * 32, rows)
        self.name, self.dtype, self.layout = what, torch.float32, None

    def read(self) -> torch.Tensor:
        codes = _whole(self.blocks).to(torch.uint8)
        table = torch.tensor(FP4_E2M1, dtype=torch.float32)
        values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)
        exponents = _whole(self.scales).to(torch.int32) - 127
        experts, rows, groups, _ = codes.shape
        dense = torch.ldexp(values.reshape(experts, rows, groups, 32), exponents.unsqueeze(-1))
        return dense.reshape(experts, rows, groups * 32).transpose(1, 2).contiguous()

    def read_rows(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        whole = self.read()
        return torch.cat([whole[a:b] for a, b in spans])

    def read_cols(self, start: int, stop: int) -> torch.Tensor:
        return self.read()[..., start:stop]


def _whole(t: Any) -> torch.Tensor:
    return t.read() if isinstance(t, StoredTensor) else t


class DequantizedTensor(StoredTensor):
    """A quantized weight read dequantized, whole or by rows or input columns."""

    def __init__(self, codes: Any, scale: Any, shape: Any, layout: QuantLayout, what: str,
                 zero: Any = None) -> None:
        self.codes, self.scale, self.layout_, self.what, self.zero = codes, scale, layout, what, zero
        if layout.kind == "packed":
            rows, cols = (int(v) for v in _whole(shape).tolist())
            if codes.shape[0] != rows or codes.shape[1] * (32 // layout.bits) < cols:
                raise CorruptModelError(f"{what} is {tuple(codes.shape)} int32 words, too few "
                                        f"for {rows} x {cols} {layout.bits}-bit values")
            self.shape: tuple[int, ...] = (rows, cols)
        else:
            self.shape = tuple(codes.shape)
        self.name, self.dtype, self.layout = codes.name if isinstance(codes, StoredTensor) else what, torch.float32, None

    def read(self) -> torch.Tensor:
        return self.read_rows([(0, self.shape[0])])

    def read_rows(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        codes = (self.codes.read_rows(spans) if isinstance(self.codes, StoredTensor)
                 else torch.cat([self.codes[a:b] for a, b in spans]))
        scale = self._scales()
        if scale.dim() == 2:  # one a row (or block, or group): the spans' rows of it
            scale = torch.cat([scale[a:b] for a, b in spans])
        if self.layout_.kind == "fp8":
            return codes.float() * scale
        if self.layout_.kind == "int8":  # in the scale's dtype, as the format's decompressor
            return (codes.to(scale.dtype) * scale).float()
        zero = None
        if self.zero is not None:  # packed down the rows, a value per row and group
            zero = self._unpack(_whole(self.zero).to(torch.int64), 0, self.shape[0])
            zero = torch.cat([zero[a:b] for a, b in spans])
        return self._ints(codes, scale, zero)

    def read_cols(self, start: int, stop: int) -> torch.Tensor:
        if self.layout_.kind == "packed":  # words hold 32 / bits columns: read the rows whole
            return self.read()[:, start:stop]
        scale = self._scales()
        if scale.dim() == 2 and scale.shape[1] > 1:  # blocks or groups: the columns' scales
            scale = scale[:, start:stop]
        codes = self.codes.read_cols(start, stop)
        if self.layout_.kind == "int8":
            return (codes.to(scale.dtype) * scale).float()
        return codes.float() * scale

    def _scales(self) -> torch.Tensor:
        scale = _whole(self.scale)
        if self.layout_.kind == "packed":
            return scale
        if self.layout_.kind == "int8" and self.layout_.group is not None:
            rows, cols = self.shape
            group = self.layout_.group
            if tuple(scale.shape) != (rows, -(-cols // group)):
                raise CorruptModelError(f"{self.what}: its weight_scale is {tuple(scale.shape)}, "
                                        f"not one per {group} columns of {cols}")
            return scale.repeat_interleave(group, dim=1)[:, :cols]
        return _expanded(scale if self.layout_.kind == "int8" else scale.float(), self.shape,
                         self.layout_.block, self.what)

    def _unpack(self, words: torch.Tensor, dim: int, count: int) -> torch.Tensor:
        """The signed ``bits``-bit values of int64 ``words`` packed along ``dim`` (the
        lowest bits first, each stored plus 2 ** (bits - 1)), the first ``count`` of them."""
        bits = self.layout_.bits
        per_word, mask = 32 // bits, (1 << bits) - 1
        values = torch.stack([(words >> (bits * j)) & mask for j in range(per_word)], dim=dim + 1)
        if dim == 0:
            values = values.reshape(-1, words.shape[1])[:count]
        else:
            values = values.reshape(words.shape[0], -1)[:, :count]
        return values - (1 << (bits - 1))

    def _ints(self, words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Rows of packed words, and their scales (and zero points), as float32 values."""
        cols = self.shape[1]
        values = self._unpack(words.to(torch.int64), 1, cols)  # int64: no sign carried down
        group = self.layout_.group or cols
        if scale.shape != (words.shape[0], -(-cols // group)):
            raise CorruptModelError(f"{self.what}: its weight_scale is {tuple(scale.shape)}, not "
                                    f"one per {group} columns of {cols}")
        per_value = scale.repeat_interleave(group, dim=1)[:, :cols]
        if zero is not None:
            if zero.shape != scale.shape:
                raise CorruptModelError(f"{self.what}: its weight_zero_point unpacks to "
                                        f"{tuple(zero.shape)}, not its scales' {tuple(scale.shape)}")
            values = values - zero.repeat_interleave(group, dim=1)[:, :cols]
        # In the scale's dtype, as the format's decompressor multiplies.
        return (values.to(scale.dtype) * per_value).float()


def _expanded(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None,
              what: str) -> torch.Tensor:
    """A weight's ``scale`` (per tensor, row or block) in a shape that broadcasts over it."""
    rows, cols = shape
    if block is not None:
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != want:
            raise CorruptModelError(f"{what}: its scale is {tuple(scale.shape)}, not {want} blocks "
                                    f"of {block[0]} x {block[1]} over {rows} x {cols}")
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        return full[:rows, :cols]
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.numel() == rows and scale.dim() <= 2 and (scale.dim() < 2 or scale.shape[1] == 1):
        return scale.reshape(rows, 1)
    raise CorruptModelError(f"{what}: its scale is {tuple(scale.shape)}: neither one scale nor "
                            f"one per row of {rows}")
