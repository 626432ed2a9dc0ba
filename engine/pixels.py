"""Preprocessed pixels as an :class:`~engine.messages.ImageInput` carries them.

An image processor (transformers') resizes an 8-bit picture, then rescales and normalises
every value by its channel's constants: ``v = (x * rescale - mean[c]) / std[c]``. Those
float32 values take four bytes each, and a request's pixels are bounded (a share of an
engine-core frame; engine.core.admission.MAX_IMAGE_BYTES). Where the values are exactly
that affine map of 8-bit ones, :func:`pack` sends the 8-bit values and the two constants
of each channel instead, a quarter of the bytes; :func:`unpack` gives the float32 values
back (equal to within float32 rounding, checked before packing). Anything else (a
processor whose resize is not 8-bit, one without normalisation constants) travels as
float32, as before.

The packed form::

    b"PX8\\0"  outer, channels, inner (3 x uint32)  a[channels], b[channels] (float32)
    the 8-bit values, ``[outer, channels, inner]`` in C order     (v = x * a[c] + b[c])

where ``[outer, channels, inner]`` is a view of the values in their own order: ``(1, C,
H * W)`` for an image ``(C, H, W)``, ``(N, C, T * P * P)`` for Qwen-VL's patch rows.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

MAGIC = b"PX8\0"
_HEADER = struct.Struct("<4sIII")


def normalisation(processor: Any) -> tuple[float, tuple[float, ...], tuple[float, ...]] | None:
    """``(rescale, mean, std)`` of a transformers image processor, or None where it does
    not rescale 8-bit values (nothing to pack)."""
    rescale = getattr(processor, "rescale_factor", None)
    if not getattr(processor, "do_rescale", True) or not rescale:
        return None
    mean = tuple(getattr(processor, "image_mean", None) or ())
    std = tuple(getattr(processor, "image_std", None) or ())
    if not getattr(processor, "do_normalize", True) or not mean or len(mean) != len(std):
        mean, std = (0.0,) * 3, (1.0,) * 3
    return float(rescale), tuple(float(m) for m in mean), tuple(float(s) for s in std)


def pack(values: np.ndarray, norm: tuple[float, Sequence[float], Sequence[float]] | None) -> bytes:
    """``values`` (float32, ``[outer, channels, inner]``) as the bytes an ImageInput
    carries: packed 8-bit where they are exactly ``norm``'s map of 8-bit values, else
    float32 in their own order."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if norm is not None and values.ndim == 3 and values.shape[1] == len(norm[1]) and values.size:
        rescale, mean, std = norm
        a = (np.float32(rescale) / np.asarray(std, dtype=np.float32)).astype(np.float32)
        b = (-np.asarray(mean, dtype=np.float32) / np.asarray(std, dtype=np.float32)).astype(np.float32)
        raw = np.rint((values - b[None, :, None]) / a[None, :, None])
        if raw.min() >= 0 and raw.max() <= 255:
            back = raw.astype(np.float32) * a[None, :, None] + b[None, :, None]
            if np.abs(back - values).max() <= 1e-5:
                outer, channels, inner = values.shape
                return (_HEADER.pack(MAGIC, outer, channels, inner) + a.tobytes() + b.tobytes()
                        + raw.astype(np.uint8).tobytes())
    return values.tobytes()


def unpack(pixels: bytes, shape: Sequence[int]) -> torch.Tensor:
    """The float32 values of ``shape`` that ``pixels`` (:func:`pack`'s) carries."""
    count = int(np.prod(shape)) if len(shape) else 1
    if pixels[:4] == MAGIC and len(pixels) >= _HEADER.size:
        _, outer, channels, inner = _HEADER.unpack_from(pixels)
        start = _HEADER.size + 8 * channels
        if outer * channels * inner == count and len(pixels) == start + count:
            ab = torch.frombuffer(bytearray(pixels[_HEADER.size:start]), dtype=torch.float32)
            raw = torch.frombuffer(bytearray(pixels[start:]), dtype=torch.uint8).view(outer, channels, inner)
            out = raw.float() * ab[:channels].view(1, -1, 1) + ab[channels:].view(1, -1, 1)
            return out.view(*shape)
    return torch.frombuffer(bytearray(pixels), dtype=torch.float32).view(*shape)


__all__ = ["MAGIC", "normalisation", "pack", "unpack"]
