"""Block-quantized weights (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS) kept in their blocks.

Every format stores, per row of a ``[N, K]`` weight, unsigned integer *codes* with one
``scale`` and ``min`` per group of ``G`` consecutive columns, and means
``w = code * scale + min``:

=======  =====  ====  ===================================================================
format   group  bits  scale, min of a group (d, dmin: fp16 per block; sc, mn: ints)
=======  =====  ====  ===================================================================
Q4_0     32     4     d, -8 d
Q4_1     32     4     d, m (both fp16)
Q5_0     32     5     d, -16 d
Q5_1     32     5     d, m
Q8_0     32     8     d, -128 d        (the int8 q is stored as the code q + 128)
Q2_K     16     2     d sc, -dmin mn   (sc, mn: 4-bit, one byte per 16 columns)
Q3_K     16     3     d sc, -4 d sc    (sc: 6-bit, stored as the signed sc - 32)
Q4_K     32     4     d sc, -dmin mn   (sc, mn: 6-bit, 8 per 256-column super-block)
Q5_K     32     5     d sc, -dmin mn
Q6_K     16     6     d sc, -32 d sc   (sc: int8, 16 per super-block)
IQ4_NL   32     4     d                (w = scale * IQ4_VALUES[code]: a table, not a line)
IQ4_XS   32     4     d sc             (sc: 6-bit, stored as the signed sc - 32)
=======  =====  ====  ===================================================================

This module holds the torch reference of all of it (decode a GGUF block array, dequantize,
matmul: the oracle of the C and Triton kernels, checked against ``gguf.quants``) and the
repacking into the CPU kernels' layout. :class:`QuantizedWeight` is what the loader hands
the model in place of a dense tensor. The formats' tables (``FORMATS``, ``FORMAT_CODES``,
``LAYOUT_FORMATS``, ``PANEL``...) live in ``engine.ops.quant_formats``, which the C kernels'
wrappers read too, and are exported from here with the rest of the quantized-weight API.

CPU layout ("panels"): rows are taken 16 at a time (a panel; N is padded to a multiple of
16 with zero rows) and each group of 32 columns of a panel is stored so one 64-byte load
gives an AVX-512 VNNI ``vpdpbusd`` operand: 16 rows x 4 consecutive columns (a "quad")::

    codes4[p, g, v, 4*r + j]   low nibble : code[16p + r, 32g + 4*(2v)   + j]   v = 0..3
                               high nibble: code[16p + r, 32g + 4*(2v+1) + j]   r = 0..15
    codes8[p, g, q, 4*r + j]   = code[16p + r, 32g + 4q + j]                    q = 0..7
    codes2[p, g, h, 4*r + j]   (Q2_K, Q3_K) bits 2i..2i+1 = bits 0..1 of quad q = 4h + i's code
    hi1[p, g, q]  (Q5_*, Q3_K) 64-bit mask: bit 4*r + j = bit 4 (Q3_K: bit 2) of
                               code[16p + r, 32g + 4q + j]
    hi2[p, g, h, 4*r + j]      (Q6_K) bits 2i..2i+1 = bits 4..5 of quad q = 4h + i's code

and the scales per panel, 16 rows side by side, so one load gives a vector of 16:
``d``/``m`` ``[P, K/32, 16]`` fp16 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL); ``d``/``dmin``
``[P, K/256, 16]`` fp16 and ``sc``/``mn`` ``[P, K/32, 16]`` uint8 (Q4_K, Q5_K); ``d``
``[P, K/256, 16]`` fp16 and ``sc`` ``[P, K/16, 16]`` int8 (Q6_K, Q3_K) or ``[P, K/32, 16]``
int8 (IQ4_XS); ``d``/``dmin`` ``[P, K/256, 16]`` fp16 and ``sc`` ``[P, K/16, 16]`` uint8,
the file's byte (Q2_K). The bytes equal the file's for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q6_K and IQ4_NL; Q4_K and Q5_K unpack their 6-bit scales to bytes (+2.8% and +2.3%), Q3_K
and IQ4_XS theirs to int8 (+3.6% and +1.5%).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.ops.cpu import qpack
from engine.ops.quant_formats import (
    FORMAT_CODES,
    FORMATS,
    IQ4_VALUES,
    LAYOUT_FORMATS,
    LOOKUP_FORMATS,
    PANEL,
    QuantError,
    QuantFormat,
    check_blocks,
    format_of,
)

# --- decoding GGUF blocks -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Decoded:
    """A GGUF tensor taken apart: ``codes`` [N, K] uint8 and the format's scale fields.

    ``fields`` maps names to per-row tensors: ``d``, ``m``, ``dmin`` (fp16, per block),
    ``sc``, ``mn`` (uint8 per 32 columns; int8 per 16 for Q6_K and Q3_K; for Q2_K ``sc``
    alone, uint8 per 16, the file's ``scale | min << 4``; IQ4_XS's ``sc`` int8 per 32).
    The IQ4 formats' ``codes`` are their table indices (see :meth:`dequantize`).
    """

    fmt: QuantFormat
    codes: torch.Tensor
    fields: dict[str, torch.Tensor]

    def scale_min(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``scale``, ``min`` [N, K / group], computed as the kernels compute them."""
        f, name = self.fields, self.fmt.name
        if name == "IQ4_NL":
            d = f["d"].float()
            return d, d * -128.0
        if name == "IQ4_XS":
            scale = f["d"].float().repeat_interleave(8, dim=1) * f["sc"].float()
            return scale, scale * -128.0
        if name in ("Q4_0", "Q5_0", "Q8_0"):
            d = f["d"].float()
            return d, d * {"Q4_0": -8.0, "Q5_0": -16.0, "Q8_0": -128.0}[name]
        if name in ("Q4_1", "Q5_1"):
            return f["d"].float(), f["m"].float()
        if name in ("Q4_K", "Q5_K"):
            d = f["d"].float().repeat_interleave(8, dim=1)
            dmin = f["dmin"].float().repeat_interleave(8, dim=1)
            return d * f["sc"].float(), -(dmin * f["mn"].float())
        d = f["d"].float().repeat_interleave(16, dim=1)  # Q6_K, Q3_K, Q2_K: 16 columns a scale
        if name == "Q2_K":
            dmin = f["dmin"].float().repeat_interleave(16, dim=1)
            return d * (f["sc"] & 15).float(), -(dmin * (f["sc"] >> 4).float())
        scale = d * f["sc"].float()
        return scale, scale * (-32.0 if name == "Q6_K" else -4.0)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K]."""
        scale, mn = self.scale_min()
        g = self.fmt.group
        n, k = self.codes.shape
        if self.fmt.name in LOOKUP_FORMATS:  # scale * the table's value, as gguf computes it
            values = torch.tensor(IQ4_VALUES, dtype=torch.float32)[self.codes.long()]
            return (values.view(n, k // g, g) * scale.unsqueeze(-1)).view(n, k)
        w = self.codes.float().view(n, k // g, g) * scale.unsqueeze(-1) + mn.unsqueeze(-1)
        return w.view(n, k)


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block: [N, blocks]."""
    return b[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0]


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> ([.., 8], [.., 8]) uint8."""
    lo = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo[0], hi_sc], -1), torch.cat([lo[1], hi_mn], -1)


def decode_blocks(raw: torch.Tensor, fmt: QuantFormat | str, k: int) -> Decoded:
    """Take apart ``raw`` [N, K / block * block_bytes] uint8 (GGUF's bytes of N rows)."""
    fmt = format_of(fmt) if isinstance(fmt, str) else fmt
    check_blocks(raw, fmt, k)
    nb = k // fmt.block
    n = raw.shape[0]
    b = raw.reshape(n, nb, fmt.block_bytes)
    name = fmt.name
    fields: dict[str, torch.Tensor] = {}
    if name in ("Q4_0", "Q4_1", "IQ4_NL"):
        off = 4 if name == "Q4_1" else 2
        fields["d"] = _f16(b, 0)
        if name == "Q4_1":
            fields["m"] = _f16(b, 2)
        qs = b[..., off : off + 16]
        codes = torch.cat([qs & 15, qs >> 4], -1)  # byte l: element l (low), l + 16 (high)
    elif name in ("Q5_0", "Q5_1"):
        off = 2 if name == "Q5_0" else 4  # qh: bit l of the little-endian uint32 is element l's bit 4
        fields["d"] = _f16(b, 0)
        if name == "Q5_1":
            fields["m"] = _f16(b, 2)
        qh = b[..., off : off + 4].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)
        qs = b[..., off + 4 : off + 20]
        codes = torch.cat([qs & 15, qs >> 4], -1) | ((qh & 1).reshape(n, nb, 32) << 4)
    elif name in ("Q2_K", "Q3_K"):
        # Element 128n + 32j + l holds bits 2j..2j+1 of qs[32n + l]; Q3_K's bit 2 is bit
        # 4n + j of hmask[l]. One scale per 16 elements, in order.
        qs = b[..., 16:80] if name == "Q2_K" else b[..., 32:96]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
        codes = (qs.reshape(n, nb, 2, 1, 32) >> shifts) & 3  # [n, nb, half, j, l]
        if name == "Q2_K":
            fields["sc"] = b[..., 0:16].reshape(n, nb * 16)
            fields["d"], fields["dmin"] = _f16(b, 80), _f16(b, 82)
        else:
            hm = b[..., 0:32].reshape(n, nb, 1, 1, 32)
            bit = torch.arange(8, dtype=torch.uint8).view(1, 1, 2, 4, 1)
            codes = codes | (((hm >> bit) & 1) << 2)
            s = b[..., 96:108]
            low = torch.cat([s[..., 0:8] & 15, s[..., 0:8] >> 4], -1)  # scale j's bits 0..3
            high = (s[..., 8:12].unsqueeze(-2) >> shifts.view(1, 1, 4, 1)) & 3  # [.., j // 4, j % 4]
            sc = (low | (high.reshape(n, nb, 16) << 4)).to(torch.int16) - 32
            fields["sc"] = sc.to(torch.int8).reshape(n, nb * 16)
            fields["d"] = _f16(b, 108)
    elif name == "IQ4_XS":
        # d, then the 6-bit scales of the eight 32-column sub-blocks (bits 0..3 in the
        # nibbles of 4 bytes, bits 4..5 in pairs of a uint16), then 16 bytes a sub-block
        # of codes (low nibbles its first 16 columns, high nibbles the rest).
        fields["d"] = _f16(b, 0)
        high = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # [n, nb, 1]
        high = (high >> (2 * torch.arange(8, dtype=torch.int32))) & 3  # [n, nb, 8]
        low = torch.stack([b[..., 4:8] & 15, b[..., 4:8] >> 4], -1).reshape(n, nb, 8).to(torch.int32)
        fields["sc"] = ((low | (high << 4)) - 32).to(torch.int8).reshape(n, nb * 8)
        qs = b[..., 8:136].reshape(n, nb, 8, 16)
        codes = torch.cat([qs & 15, qs >> 4], -1)
    elif name == "Q8_0":
        fields["d"] = _f16(b, 0)
        codes = b[..., 2:34] ^ 0x80  # int8 q -> q + 128, unsigned for vpdpbusd
    elif name in ("Q4_K", "Q5_K"):
        fields["d"], fields["dmin"] = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scales(b[..., 4:16])
        fields["sc"], fields["mn"] = sc.reshape(n, nb * 8), mn.reshape(n, nb * 8)
        qs = b[..., 16:144] if name == "Q4_K" else b[..., 48:176]
        qs = qs.reshape(n, nb, 4, 32)  # 32 bytes per 64 columns: sub-blocks 2c (low), 2c+1
        codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, nb, 8, 32)
        if name == "Q5_K":
            qh = b[..., 16:48].reshape(n, nb, 1, 32)  # bit s of byte l: sub-block s, column l
            shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
            codes = codes | (((qh >> shifts) & 1) << 4)
    else:  # Q6_K
        ql = b[..., 0:128].reshape(n, nb, 2, 64)
        qh = b[..., 128:192].reshape(n, nb, 2, 32)
        fields["sc"] = b[..., 192:208].contiguous().view(torch.int8).reshape(n, nb * 16)
        fields["d"] = _f16(b, 208)
        lo = torch.stack(
            [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=3
        )  # [n, nb, half, 4, 32]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
        hi = (qh.unsqueeze(3) >> shifts) & 3
        codes = lo | (hi << 4)
    return Decoded(fmt, codes.reshape(n, k).contiguous(), {k_: v.contiguous() for k_, v in fields.items()})


def dequantize_blocks(raw: torch.Tensor, fmt: QuantFormat | str, k: int) -> torch.Tensor:
    """The torch reference: GGUF blocks [N, bytes] -> fp32 [N, K]."""
    return decode_blocks(raw, fmt, k).dequantize()


# --- the CPU panel layout -----------------------------------------------------------------


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad])


def _panel_field(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, X] per-row field -> [P, X, 16]: each panel's 16 rows side by side."""
    t = _pad_rows(t, rows)
    return t.view(rows // PANEL, PANEL, t.shape[1]).transpose(1, 2).contiguous()


def pack_panels(dec: Decoded) -> dict[str, torch.Tensor]:
    """The CPU kernels' layout of ``dec`` (see the module docstring)."""
    fmt = dec.fmt
    n, k = dec.codes.shape
    rows = -(-n // PANEL) * PANEL
    p, g = rows // PANEL, k // 32
    codes = _pad_rows(dec.codes, rows)
    # [p, r, g, q, j] -> [p, g, q, r, j]: quad q of group g, 16 rows x 4 columns.
    quads = codes.view(p, PANEL, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(p, g, 8, 64)
    out: dict[str, torch.Tensor] = {}
    if fmt.bits == 8:
        out["codes8"] = quads.contiguous()
    elif fmt.bits <= 3:
        low = (quads & 3).view(p, g, 2, 4, 64)
        out["codes2"] = (low[:, :, :, 0] | (low[:, :, :, 1] << 2) | (low[:, :, :, 2] << 4) | (low[:, :, :, 3] << 6)).contiguous()
    else:
        low = quads & 15
        out["codes4"] = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).contiguous()
    if fmt.bits in (3, 5):
        bits = ((quads >> (fmt.bits - 1)) & 1).to(torch.int64)  # [p, g, 8, 64]
        weights = torch.ones(64, dtype=torch.int64) << torch.arange(64)
        out["hi1"] = (bits * weights).sum(-1).contiguous()  # int64 masks (sums of distinct bits)
    if fmt.bits == 6:
        hi = ((quads >> 4) & 3).view(p, g, 2, 4, 64)
        out["hi2"] = (hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)).contiguous()
    for name, t in dec.fields.items():
        out[name] = _panel_field(t, rows)
    return out


def unpack_panels(fmt: QuantFormat, packed: dict[str, torch.Tensor], n: int, k: int) -> Decoded:
    """Inverse of :func:`pack_panels` (the reference the kernels' layout is tested with)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    if "codes8" in packed:
        quads = packed["codes8"]
    elif "codes2" in packed:
        c2 = packed["codes2"].unsqueeze(3)  # [p, g, 2, 1, 64]
        quads = ((c2 >> shifts) & 3).reshape(c2.shape[0], c2.shape[1], 8, 64)
    else:
        c4 = packed["codes4"]
        p, g = c4.shape[:2]
        quads = torch.stack([c4 & 15, c4 >> 4], dim=3).reshape(p, g, 8, 64)
    p, g = quads.shape[:2]
    if "hi1" in packed:
        bits = (packed["hi1"].unsqueeze(-1) >> torch.arange(64)) & 1
        quads = quads | (bits.to(torch.uint8) << (fmt.bits - 1))
    if "hi2" in packed:
        h = packed["hi2"].unsqueeze(3)  # [p, g, 2, 1, 64]
        quads = quads | ((((h >> shifts) & 3) << 4).reshape(p, g, 8, 64))
    codes = quads.view(p, g, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, k)[:n]
    fields = {
        name: t.transpose(1, 2).reshape(p * PANEL, t.shape[1])[:n]
        for name, t in packed.items()
        if name not in ("codes2", "codes4", "codes8", "hi1", "hi2")
    }
    return Decoded(fmt, codes.contiguous(), fields)


# --- the weight object ----------------------------------------------------------------------


class QuantizedWeight:
    """A ``[N, K]`` weight kept in a block format.

    ``layout`` is ``"panels"`` (CPU: :func:`pack_panels`, tensors in ``data``) or
    ``"blocks"`` (GGUF's own rows, ``data["raw"]`` [N, bytes] uint8: the Triton kernel's
    input). Immutable once built; :meth:`cat_rows` makes a new one.
    """

    __slots__ = ("fmt", "shape", "layout", "data", "__weakref__")  # weakref: qmatmul caches pointers

    def __init__(self, fmt: QuantFormat, shape: tuple[int, int], layout: str, data: dict[str, torch.Tensor]):
        self.fmt, self.shape, self.layout, self.data = fmt, (int(shape[0]), int(shape[1])), layout, data

    @classmethod
    def from_blocks(
        cls, raw: torch.Tensor, fmt: QuantFormat | str, k: int, *,
        device: torch.device | str = "cpu", layout: str | None = None,
    ) -> QuantizedWeight:
        """From GGUF rows ``raw`` [N, bytes] uint8, on ``device`` in ``layout`` (``None``:
        panels on CPU, blocks elsewhere; blocks on CPU are for the Triton interpreter)."""
        fmt = format_of(fmt) if isinstance(fmt, str) else fmt
        check_blocks(raw, fmt, k)
        device = torch.device(device)
        layout = layout or ("panels" if device.type == "cpu" else "blocks")
        if layout == "blocks":
            return cls(fmt, (raw.shape[0], k), "blocks", {"raw": raw.contiguous().to(device)})
        if layout != "panels" or device.type != "cpu":
            raise QuantError(f"no {layout!r} layout on {device}: panels are CPU-only, else blocks")
        if qpack.available():  # the C repack: ~100x the torch one below
            data = qpack.pack(raw.contiguous(), fmt, k)
        else:
            data = pack_panels(decode_blocks(raw, fmt, k))
        return cls(fmt, (raw.shape[0], k), "panels", data)

    @property
    def device(self) -> torch.device:
        return next(iter(self.data.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())

    def to(self, device: torch.device | str | torch.dtype | None = None, dtype: torch.dtype | None = None) -> QuantizedWeight:
        """Itself: the blocks keep their format whatever the model dtype (``dtype`` is the
        activations'; ``w.to(torch.bfloat16)`` is accepted as for a tensor). Moving between
        devices is not supported."""
        if isinstance(device, torch.dtype):
            device = None
        if device is not None and torch.device(device).type != self.device.type:
            raise QuantError(f"a quantized weight on {self.device} cannot move to {device}")
        return self

    def contiguous(self) -> QuantizedWeight:
        return self

    def decoded(self) -> Decoded:
        n, k = self.shape
        if self.layout == "blocks":
            return decode_blocks(self.data["raw"].cpu(), self.fmt, k)
        return unpack_panels(self.fmt, self.data, n, k)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] on CPU (reference path; tests, fallbacks)."""
        return self.decoded().dequantize()

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of ``parts`` one after another (q/k/v and gate/up fused into one matmul)."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.shape[1] != first.shape[1] or p.layout != first.layout for p in parts):
            raise QuantError("only weights of one format, width and layout can be concatenated")
        n = sum(p.shape[0] for p in parts)
        if first.layout == "panels" and any(p.shape[0] % PANEL for p in parts[:-1]):
            raise QuantError(f"rows of a panel-packed weight concatenate in multiples of {PANEL}")
        data = {name: torch.cat([p.data[name] for p in parts]) for name in first.data}
        return QuantizedWeight(first.fmt, (n, first.shape[1]), first.layout, data)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.fmt.name}, shape={self.shape}, layout={self.layout!r})"


class QuantizedExperts:
    """One projection of a mixture-of-experts layer's ``E`` experts kept in their blocks
    (GGUF's ``ffn_*_exps`` stacks), panel-packed for the CPU kernels.

    ``parts`` are stacks side by side in an expert's output rows (a gated first
    projection's gate, then up; Nemotron 3's up alone; the down), each its own format, each
    ``E`` experts' ``[rows, K]`` weights one after another with every expert's rows padded
    to whole panels: expert ``e``'s panels are ``[e * P, (e + 1) * P)``, ``P =
    ceil(rows / 16)``. ``shape`` is the dense stack's ``[E, sum(rows), K]``, as
    ``Ops.fused_moe`` reads it from a dense ``w13`` or ``w2``.
    """

    __slots__ = ("parts", "rows", "shape", "__weakref__")  # weakref: the C wrapper caches pointers

    def __init__(self, parts: list[QuantizedWeight], rows: list[int], num_experts: int) -> None:
        self.parts, self.rows = parts, rows
        self.shape = (num_experts, sum(rows), parts[0].shape[1])

    @classmethod
    def stack(cls, experts: list[list[QuantizedWeight]]) -> QuantizedExperts:
        """From each expert's parts (``experts[e]``: its gate and up, or its up or down),
        every expert's part ``i`` of one format and shape, panel-packed."""
        columns = list(zip(*experts, strict=True))
        parts, rows = [], []
        for column in columns:
            first = column[0]
            if any(w.layout != "panels" or w.fmt != first.fmt or w.shape != first.shape for w in column):
                raise QuantError("stacked experts take panel-packed weights of one format and shape")
            data = {f: torch.cat([w.data[f] for w in column]) for f in first.data}
            padded = -(-first.shape[0] // PANEL) * PANEL
            parts.append(QuantizedWeight(first.fmt, (len(column) * padded, first.shape[1]), "panels", data))
            rows.append(first.shape[0])
        return cls(parts, rows, len(experts))

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to(self, device: torch.device | str | torch.dtype | None = None,
           dtype: torch.dtype | None = None) -> QuantizedExperts:
        """Itself, as :meth:`QuantizedWeight.to`."""
        for p in self.parts:
            p.to(device, dtype)
        return self

    def expert(self, e: int) -> list[QuantizedWeight]:
        """Expert ``e``'s parts, as weights of their own (views of the stacks)."""
        out = []
        for part, rows in zip(self.parts, self.rows, strict=True):
            per = -(-rows // PANEL)
            data = {f: t[e * per : (e + 1) * per] for f, t in part.data.items()}
            out.append(QuantizedWeight(part.fmt, (rows, part.shape[1]), "panels", data))
        return out

    def dense(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert ``e``'s weight ``[sum(rows), K]`` dequantized into ``dtype``."""
        return torch.cat([w.dequantize() for w in self.expert(e)]).to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The dense fp32 stack ``[E, sum(rows), K]`` (tests, fallbacks)."""
        return torch.stack([self.dense(e) for e in range(self.shape[0])])

    def __repr__(self) -> str:
        formats = "+".join(p.fmt.name for p in self.parts)
        return f"QuantizedExperts({formats}, shape={self.shape})"


def reference_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """``x @ dequantize(w).T`` in fp32: the oracle of the quantized matmul kernels."""
    return x.float() @ w.dequantize().to(x.device).T


__all__ = [
    "FORMATS",
    "FORMAT_CODES",
    "LAYOUT_FORMATS",
    "PANEL",
    "Decoded",
    "QuantError",
    "QuantFormat",
    "QuantizedExperts",
    "QuantizedWeight",
    "check_blocks",
    "decode_blocks",
    "dequantize_blocks",
    "format_of",
    "pack_panels",
    "reference_matmul",
    "unpack_panels",
]
