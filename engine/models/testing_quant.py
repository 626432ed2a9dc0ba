"""Quantized Hugging Face checkpoints written from a dense one, for the tests and
benchmarks of engine/models/hf_quant.py: every projection (``*proj.weight``) stored in one
of the layouts that module reads, with scales chosen so each block's, row's or group's
largest magnitude is the format's largest code; the other tensors as they are.

``LAYOUTS``: "fp8-block" (``quant_method`` fp8, ``weight_scale_inv`` per ``block``),
"ct-tensor" / "ct-channel" / "ct-block" (compressed-tensors float-quantized),
"ct-int8-channel" / "ct-int8-group" (int-quantized), "ct-w4-group" / "ct-w8-channel"
(pack-quantized, symmetric) and "ct-w4-asym" (pack-quantized with zero points). Blocks and groups must divide the matrices (transformers'
loaders, the oracle, require it).

Also :func:`quantize_q4_k`, :func:`quantize_q3_k`, :func:`quantize_q2_k` and
:func:`quantize_iq4`, GGUF rows for the tests that write a k-quant or IQ4 GGUF (the gguf
package quantizes only the 32-column formats without a table).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engine.ops.quant_formats import IQ4_VALUES

LAYOUTS = ("fp8-block", "ct-tensor", "ct-channel", "ct-block", "ct-w4-group", "ct-w4-asym",
           "ct-w8-channel", "ct-int8-channel", "ct-int8-group")


def _scales(w: torch.Tensor, layout: str, block: tuple[int, int]) -> torch.Tensor:
    """One scale per tensor, per row or per block of ``w``, so its largest value is
    e4m3's largest (448)."""
    a = w.float().abs()
    if layout == "ct-tensor":
        return a.max().clamp(min=1e-12).reshape(1) / 448.0
    if layout == "ct-channel":
        return a.amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    rows, cols = w.shape
    blocks = a.reshape(rows // block[0], block[0], cols // block[1], block[1])
    return blocks.amax(dim=(1, 3)).clamp(min=1e-12) / 448.0


def _compressed_tensors(fmt: str, weights: dict[str, Any], activations: str | None) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False, **weights}}
    if activations is not None:  # W8A8's and FP8-dynamic's: quantized per token as they run
        group["input_activations"] = {"num_bits": 8, "type": activations, "strategy": "token",
                                      "dynamic": True, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": group}}


def _quantization_config(layout: str, block: tuple[int, int], group: int) -> dict[str, Any]:
    if layout == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    grouped = layout in ("ct-int8-group", "ct-w4-group", "ct-w4-asym")
    ints = {"type": "int", "strategy": "group" if grouped else "channel",
            "group_size": group if grouped else None}
    if layout.startswith("ct-int8"):
        return _compressed_tensors("int-quantized", {"num_bits": 8, **ints}, "int")
    if layout.startswith("ct-w"):
        weights = {"num_bits": 4 if grouped else 8, **ints}
        if layout == "ct-w4-asym":
            weights["symmetric"] = False
        return _compressed_tensors("pack-quantized", weights, None)
    weights = {"num_bits": 8, "type": "float", "strategy": layout.removeprefix("ct-")}
    if layout == "ct-block":
        weights["block_structure"] = list(block)
    return _compressed_tensors("float-quantized", weights, "float")


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Signed ``bits``-bit ``values`` packed into int32 words along ``dim``: each plus
    2 ** (bits - 1), the lowest bits first (compressed-tensors' packing)."""
    per_word = 32 // bits
    if dim == 0:  # the rows padded to whole words, packed as the columns of the transpose
        pad = -values.shape[0] % per_word
        padded = torch.cat([values, torch.zeros(pad, values.shape[1])]) if pad else values
        return _pack(padded.t(), bits, 1).t().contiguous()
    u = (values + 2 ** (bits - 1)).to(torch.int64)
    words = torch.zeros(u.shape[0], u.shape[1] // per_word, dtype=torch.int64)
    for j in range(per_word):
        words |= u[:, j::per_word] << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _packed(w: torch.Tensor, bits: int, group: int, symmetric: bool = True) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized tensors of ``w``: ``bits``-bit integers, a scale
    (and, not ``symmetric``, a zero point) per ``group`` columns."""
    rows, cols = w.shape
    top = 2 ** (bits - 1) - 1
    grouped = w.float().reshape(rows, cols // group, group)
    if symmetric:
        scale = (grouped.abs().amax(-1) / top).clamp(min=1e-8).to(torch.float16)
        zero = torch.zeros(rows, cols // group)
    else:  # the group's range onto [-2 ** (bits - 1), top]
        lo, hi = grouped.amin(-1), grouped.amax(-1)
        scale = ((hi - lo) / (2 * top + 1)).clamp(min=1e-8).to(torch.float16)
        zero = torch.round(-top - 1 - lo / scale.float()).clamp(-top - 1, top)
    q = torch.round(grouped / scale.float()[..., None] + zero[..., None]).clamp(-top - 1, top)
    out = {"weight_packed": _pack(q.reshape(rows, cols), bits, 1), "weight_scale": scale,
           "weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = _pack(zero, bits, 0)
    return out


def write_quantized(dense: str | Path, out: str | Path, layout: str, *, block: tuple[int, int] = (128, 128),
                    group: int = 128) -> Path:
    """``dense``'s folder copied to ``out`` with every projection stored quantized in
    ``layout`` (fp8 ``block`` of rows x columns; integer scales per ``group`` columns)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    dense, out = Path(dense), Path(out)
    shutil.copytree(dense, out)
    stored = {}
    for name, w in load_file(str(dense / "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            stored[name] = w
            continue
        base = name.removesuffix("weight")
        if layout.startswith("ct-int8"):
            cols = group if layout == "ct-int8-group" else w.shape[1]
            scale = (w.float().reshape(w.shape[0], -1, cols).abs().amax(-1) / 127).to(torch.float16)
            codes = torch.round(w.float().reshape(w.shape[0], -1, cols) / scale.float()[..., None])
            stored[name] = codes.clamp(-128, 127).reshape(w.shape).to(torch.int8)
            stored[base + "weight_scale"] = scale
            continue
        if layout in ("ct-w4-group", "ct-w4-asym", "ct-w8-channel"):
            bits, cols = (8, w.shape[1]) if layout == "ct-w8-channel" else (4, group)
            packed = _packed(w, bits, cols, symmetric=layout != "ct-w4-asym")
            stored |= {base + k: v for k, v in packed.items()}
            continue
        scale = _scales(w, layout, block)
        per_element = (scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
                       if scale.dim() == 2 and scale.shape[1] > 1 else scale)
        stored[name] = (w.float() / per_element).to(torch.float8_e4m3fn)
        stored[base + ("weight_scale_inv" if layout == "fp8-block" else "weight_scale")] = scale
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _quantization_config(layout, block, group)
    (out / "config.json").write_text(json.dumps(config))
    return out


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """GGUF Q4_K rows ``[N, K / 256 * 144]`` uint8 of an fp32 ``weight [N, K]``.

    The gguf package quantizes only the 32-column formats, so tests that need a k-quant
    file write one with this. Each 256-column super-block holds an fp16 ``d`` and ``dmin``,
    eight 6-bit scales and mins (one per 32 columns, packed into 12 bytes) and 4-bit
    codes: ``w = d * sc * q - dmin * mn``. Scales and codes are rounded to nearest (not
    llama.cpp's error-minimising search): a valid file whose weights are close to
    ``weight``, which is all a test of the kept blocks against their own dequantization
    needs.
    """
    n, k = weight.shape
    if k % 256:
        raise ValueError(f"Q4_K needs K to be a multiple of 256, got {k}")
    x = weight.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)  # a sub-block's min, stored negated (mn >= 0)
    scale, mins = (x.max(-1) - lo) / 15, -lo  # [n, blocks, 8]
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)

    def six_bits(v: np.ndarray, unit: np.ndarray) -> np.ndarray:
        u = unit.astype(np.float32)[..., None]
        q = np.divide(v, u, out=np.zeros_like(v), where=u > 0)
        return np.clip(np.rint(q), 0, 63).astype(np.uint8)

    sc, mn = six_bits(scale, d), six_bits(mins, dmin)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[..., None] * mn)[..., None]
    q = np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)
    packed = np.empty((n, k // 256, 12), dtype=np.uint8)
    # Sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks
    # 4-7 in the nibbles of bytes 8-11, their top 2 bits in the top bits of bytes 0-7.
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    codes = q[:, :, 0::2] | (q[:, :, 1::2] << 4)  # 32 bytes per 64 columns: low, high nibble
    blocks = np.concatenate(
        [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, codes.reshape(n, k // 256, 128)],
        axis=-1,
    )
    return blocks.reshape(n, k // 256 * 144)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """Codes ``q [n, blocks, 256]`` (values 0..3 used) as GGUF's 64 bytes a super-block:
    element 128h + 32j + l in bits 2j..2j+1 of byte 32h + l."""
    n, nb = q.shape[:2]
    parts = (q & 3).reshape(n, nb, 2, 4, 32)
    out = parts[:, :, :, 0] | (parts[:, :, :, 1] << 2) | (parts[:, :, :, 2] << 4) | (parts[:, :, :, 3] << 6)
    return out.reshape(n, nb, 64).astype(np.uint8)


def quantize_q3_k(weight: np.ndarray) -> np.ndarray:
    """GGUF Q3_K rows ``[N, K / 256 * 110]`` uint8 of an fp32 ``weight [N, K]``.

    A 256-column super-block holds an fp16 ``d``, sixteen 6-bit scales stored as ``sc +
    32`` (one per 16 columns, 12 bytes) and 3-bit codes (the low two bits in ``qs``, the
    third in ``hmask``): ``w = d * sc * (q - 4)``. Each 16-column scale is signed so that
    the sub-block's largest magnitude lands on code 0 (``-4``), both signs occurring;
    rounded to nearest (not llama.cpp's search).
    """
    n, k = weight.shape
    if k % 256:
        raise ValueError(f"Q3_K needs K to be a multiple of 256, got {k}")
    x = weight.astype(np.float32).reshape(n, k // 256, 16, 16)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    scale = peak / -4.0  # [n, blocks, 16]
    d = (np.abs(scale).max(-1) / 31).astype(np.float16)  # |sc| <= 31: no scale clips
    u = d.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(scale, u, out=np.zeros_like(scale), where=u > 0)), -32, 31).astype(np.int32)
    step = (u * sc)[..., None]
    q = np.rint(np.divide(x, step, out=np.zeros_like(x), where=step != 0)) + 4
    q = np.clip(q, 0, 7).astype(np.uint8).reshape(n, k // 256, 256)
    hi = (q >> 2).reshape(n, k // 256, 8, 32)  # bit 4h + j of hmask[l]: element 128h + 32j + l
    hmask = np.zeros((n, k // 256, 32), dtype=np.uint8)
    for bit in range(8):
        hmask |= (hi[:, :, bit] << bit).astype(np.uint8)
    v = (sc + 32).astype(np.uint8)  # [n, blocks, 16], 6 bits
    scales = np.empty((n, k // 256, 12), dtype=np.uint8)
    scales[..., 0:8] = (v[..., 0:8] & 15) | ((v[..., 8:16] & 15) << 4)
    high = v >> 4  # scale j's top two bits: byte 8 + j % 4, bits 2 (j // 4)
    scales[..., 8:12] = high[..., 0:4] | (high[..., 4:8] << 2) | (high[..., 8:12] << 4) | (high[..., 12:16] << 6)
    blocks = np.concatenate([hmask, _two_bit_planes(q), scales, d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(n, k // 256 * 110)


def quantize_q2_k(weight: np.ndarray) -> np.ndarray:
    """GGUF Q2_K rows ``[N, K / 256 * 84]`` uint8 of an fp32 ``weight [N, K]``.

    A 256-column super-block holds sixteen bytes of 4-bit scale and min (one byte per 16
    columns, the scale in the low nibble), 2-bit codes, and fp16 ``d`` and ``dmin``:
    ``w = d * sc * q - dmin * mn``. Rounded to nearest, as :func:`quantize_q4_k`.
    """
    n, k = weight.shape
    if k % 256:
        raise ValueError(f"Q2_K needs K to be a multiple of 256, got {k}")
    x = weight.astype(np.float32).reshape(n, k // 256, 16, 16)
    lo = np.minimum(x.min(-1), 0.0)
    scale, mins = (x.max(-1) - lo) / 3, -lo
    d = (scale.max(-1) / 15).astype(np.float16)
    dmin = (mins.max(-1) / 15).astype(np.float16)

    def four_bits(v: np.ndarray, unit: np.ndarray) -> np.ndarray:
        u = unit.astype(np.float32)[..., None]
        return np.clip(np.rint(np.divide(v, u, out=np.zeros_like(v), where=u > 0)), 0, 15).astype(np.uint8)

    sc, mn = four_bits(scale, d), four_bits(mins, dmin)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[..., None] * mn)[..., None]
    q = np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.rint(q), 0, 3).astype(np.uint8).reshape(n, k // 256, 256)
    blocks = np.concatenate(
        [sc | (mn << 4), _two_bit_planes(q), d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)], axis=-1
    )
    return blocks.reshape(n, k // 256 * 84)


def quantize_iq4(weight: np.ndarray, kind: str) -> np.ndarray:
    """GGUF ``kind`` ("IQ4_NL": 18 bytes a 32-column block; "IQ4_XS": 136 a 256-column
    super-block) rows of an fp32 ``weight [N, K]``: each value the nearest of the 16-entry
    table (``engine.ops.quant_formats.IQ4_VALUES``) times its block's scale, the scale set so
    the block's largest magnitude meets the table's end (IQ4_XS: an fp16 ``d`` a
    super-block and a 6-bit ``sc - 32`` a 32-column sub-block). Rounded to nearest, not
    llama.cpp's search."""
    n, k = weight.shape
    per = 32 if kind == "IQ4_NL" else 256
    if k % per:
        raise ValueError(f"{kind} needs K to be a multiple of {per}, got {k}")
    table = np.asarray(IQ4_VALUES, dtype=np.float32)
    x = weight.astype(np.float32).reshape(n, k // per, per // 32, 32)
    want = np.abs(x).max(-1) / 127  # [n, blocks, sub-blocks]
    if kind == "IQ4_NL":
        d = want[..., 0].astype(np.float16)
        step = d.astype(np.float32)[..., None]
    else:
        d = (want.max(-1) / 31).astype(np.float16)
        u = d.astype(np.float32)[..., None]
        sc = np.clip(np.rint(np.divide(want, u, out=np.zeros_like(want), where=u > 0)), 0, 31).astype(np.int32)
        step = u * sc
    ratio = np.divide(x, step[..., None], out=np.zeros_like(x), where=step[..., None] > 0)
    q = np.abs(ratio[..., None] - table).argmin(-1).astype(np.uint8)  # [n, blocks, sub, 32]
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // per, per // 2)
    if kind == "IQ4_NL":
        return np.concatenate([d[..., None].view(np.uint8), codes], -1).reshape(n, k // 32 * 18)
    v = (sc + 32).astype(np.uint16)  # [n, blocks, 8], 6 bits
    high = np.zeros((n, k // 256), dtype=np.uint16)
    for ib in range(8):
        high |= (v[..., ib] >> 4) << (2 * ib)
    low = ((v[..., 0::2] & 15) | ((v[..., 1::2] & 15) << 4)).astype(np.uint8)
    blocks = np.concatenate([d[..., None].view(np.uint8), high[..., None].view(np.uint8), low, codes], -1)
    return blocks.reshape(n, k // 256 * 136)
