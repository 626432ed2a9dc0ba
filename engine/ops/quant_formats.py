"""The GGUF block formats kept quantized, as tables: what each format's bytes hold, the
C kernels' format codes, which layout has a kernel for which format, and the shapes of the
CPU panel layout.

``engine.ops.quant`` (the torch reference and :class:`~engine.ops.quant.QuantizedWeight`;
its docstring has the formats' table and the panel layout) and the C kernels' wrappers in
``engine.ops.cpu`` both read these; kept apart so the wrappers need nothing of the weight
object's module, which uses them.
"""

from __future__ import annotations

import dataclasses

import torch

PANEL = 16  # rows per panel: one AVX-512 vector of 16 int32 / fp32 lanes

# The panel field holding a format's low code bits, by bits per code: 8 bits a byte, the
# low 4 bits two to a byte, the low 2 bits four to a byte (above them, ``hi1`` holds bit 4
# of a 5-bit code and bit 2 of a 3-bit one, ``hi2`` bits 4 and 5 of a 6-bit code).
CODE_FIELDS = {8: "codes8", 6: "codes4", 5: "codes4", 4: "codes4", 3: "codes2", 2: "codes2"}


@dataclasses.dataclass(frozen=True, slots=True)
class QuantFormat:
    """One GGUF block format: ``block`` columns in ``block_bytes`` bytes."""

    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    block: int  # columns per block (K must be a multiple)
    block_bytes: int
    group: int  # columns sharing one scale and min
    bits: int  # bits per code


FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("Q4_0", 2, 32, 18, 32, 4),
        QuantFormat("Q4_1", 3, 32, 20, 32, 4),
        QuantFormat("Q8_0", 8, 32, 34, 32, 8),
        QuantFormat("Q4_K", 12, 256, 144, 32, 4),
        QuantFormat("Q5_K", 13, 256, 176, 32, 5),
        QuantFormat("Q6_K", 14, 256, 210, 16, 6),
        QuantFormat("Q5_0", 6, 32, 22, 32, 5),
        QuantFormat("Q5_1", 7, 32, 24, 32, 5),
        QuantFormat("Q3_K", 11, 256, 110, 16, 3),
        QuantFormat("Q2_K", 10, 256, 84, 16, 2),
        QuantFormat("IQ4_NL", 20, 32, 18, 32, 4),
        QuantFormat("IQ4_XS", 23, 256, 136, 32, 4),
    )
}

# IQ4_NL's and IQ4_XS's 4-bit codes index this table of int8 values (llama.cpp's
# kvalues_iq4nl): w = scale * IQ4_VALUES[code]. The kernels multiply the unsigned value + 128
# (their codes are unsigned) with a min of -128 * scale, as for Q8_0.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
LOOKUP_FORMATS = ("IQ4_NL", "IQ4_XS")

# The C kernels' format codes (enum in engine/ops/cpu/quant.c).
FORMAT_CODES = {name: i for i, name in enumerate(FORMATS)}

# The formats each layout has a kernel for: the C kernels read every format in panels;
# the Triton kernel (engine/ops/triton/quant_matmul.py, whose format codes are this order)
# reads these in GGUF's blocks. The loader dequantizes what the model's kernels lack.
LAYOUT_FORMATS = {"panels": tuple(FORMATS), "blocks": ("Q4_0", "Q4_1", "Q8_0", "Q4_K")}


class QuantError(ValueError):
    """A quantized tensor whose shape or bytes do not fit its format."""


def format_of(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise QuantError(f"unsupported quantization format {name!r}; supported: {', '.join(FORMATS)}") from None


def check_blocks(raw: torch.Tensor, fmt: QuantFormat, k: int) -> None:
    """Raise :class:`QuantError` unless ``raw`` holds whole rows of K columns of ``fmt``."""
    if k <= 0 or k % fmt.block:
        raise QuantError(f"{fmt.name}: K = {k} is not a positive multiple of {fmt.block}")
    nb = k // fmt.block
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != nb * fmt.block_bytes or raw.shape[0] < 1:
        raise QuantError(
            f"{fmt.name}: expected uint8 [N >= 1, {nb * fmt.block_bytes}] for K = {k}, got "
            f"{raw.dtype} {list(raw.shape)}"
        )


def panel_shapes(fmt: QuantFormat, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of each tensor of the panel layout of an [n, k] weight."""
    p, g, sb = -(-n // PANEL), k // 32, k // 256
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    codes = CODE_FIELDS[fmt.bits]
    out[codes] = ((p, g, {"codes8": 8, "codes4": 4, "codes2": 2}[codes], 64), torch.uint8)
    if fmt.bits in (3, 5):
        out["hi1"] = ((p, g, 8), torch.int64)
    if fmt.bits == 6:
        out["hi2"] = ((p, g, 2, 64), torch.uint8)
    if fmt.block == 32:
        out["d"] = ((p, g, PANEL), torch.float16)
        if fmt.name in ("Q4_1", "Q5_1"):
            out["m"] = ((p, g, PANEL), torch.float16)
    else:
        out["d"] = ((p, sb, PANEL), torch.float16)
        if fmt.name in ("Q6_K", "Q3_K"):
            out["sc"] = ((p, 2 * g, PANEL), torch.int8)
        elif fmt.name == "IQ4_XS":
            out["sc"] = ((p, g, PANEL), torch.int8)  # the 6-bit scale - 32, one per 32 columns
        elif fmt.name == "Q2_K":
            out["dmin"] = ((p, sb, PANEL), torch.float16)
            out["sc"] = ((p, 2 * g, PANEL), torch.uint8)  # the file's byte: scale | min << 4
        else:
            out["dmin"] = ((p, sb, PANEL), torch.float16)
            out["sc"] = ((p, g, PANEL), torch.uint8)
            out["mn"] = ((p, g, PANEL), torch.uint8)
    return out


__all__ = [
    "CODE_FIELDS",
    "FORMATS",
    "FORMAT_CODES",
    "IQ4_VALUES",
    "LAYOUT_FORMATS",
    "LOOKUP_FORMATS",
    "PANEL",
    "QuantError",
    "QuantFormat",
    "check_blocks",
    "format_of",
    "panel_shapes",
]
