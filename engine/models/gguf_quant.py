"""Read a GGUF's tensors with the quantized ones kept in their blocks.

The conversion cache (:mod:`engine.models.gguf_convert`) writes a dequantized Hugging Face
folder; it still supplies the config and the tokenizer, but with quantization on, the
weights come from the GGUF itself. ``gguf.GGUFReader`` parses the header (names, types,
shapes and the offset of each tensor's bytes); each tensor is then a :class:`GgufTensor`
read from the file by position (:mod:`engine.models.checkpoint`), whole for one rank or in
a tensor-parallel rank's rows or columns. A quantized tensor's rows of blocks are repacked
for the kernels (:class:`engine.ops.quant.QuantizedWeight`); tensors of other types (F32
norms, F16, or a block format the kernels lack) are dequantized as the converter does, and
the log names the block formats that were.

The per-tensor fix-ups mirror ``gguf_convert._hf_tensors`` (phi3's RoPE factor tensors
skipped, Gemma's and Qwen3.5's stored 1 + w norms undone, Qwen3.5's and the Mamba mixers'
decay rates read back as A_log, GPT-2's dense projections read transposed; their
convolution kernels stay [channels, kernel], as their mixers read them, and Mamba-2's A, D
and gated norm are read as vectors, see :mod:`engine.models.gguf_recurrent`);
llama.cpp's q/k row permutation (see
:func:`gguf_convert.unpermute_qk`) acts on whole rows within each head, and each row of a
block-quantized tensor is its own run of blocks, so it is undone on the block rows without
dequantizing, on the heads a cut covers. Expert stacks (3-D) are read one expert at a time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models import gguf_convert, gguf_recurrent
from engine.models.checkpoint import (
    CheckpointFile,
    LazyWeights,
    StoredTensor,
    Transposed,
    read_stored,
)
from engine.models.config import ModelConfig
from engine.ops.quant import LAYOUT_FORMATS, QuantizedWeight
from engine.ops.quant_formats import QuantFormat, format_of

logger = logging.getLogger("engine.models")


@dataclasses.dataclass(frozen=True, slots=True)
class GgufWeights:
    """Tensors under Hugging Face names: ``QuantizedWeight`` for kept blocks, else dense
    (or, read lazily, the :class:`GgufTensor` each reads from)."""

    weights: dict[str, QuantizedWeight | torch.Tensor] | LazyWeights
    file_tensor_bytes: int  # the file's bytes of tensor data (the 1.2x budget's base)
    kept: dict[str, int]  # block format -> tensors kept quantized
    dequantized: dict[str, int]  # non-float type -> tensors dequantized


def cut_inside_blocks(name: str, fmt: QuantFormat, start: int, stop: int, k: int) -> UnsupportedModelError:
    """The refusal of input columns ``[start, stop)`` that split ``fmt``'s blocks."""
    return UnsupportedModelError(
        f"{name}: its {fmt.name} blocks hold {fmt.block} values, and this rank's input "
        f"columns [{start}, {stop}) of {k} do not fall on block boundaries; the blocks cannot be "
        f"split for this tensor-parallel size (use another size, or --quantization none)"
    )


class GgufTensor(StoredTensor):
    """One GGUF tensor under its Hugging Face name: rows of ``row_bytes`` bytes at
    ``offset`` (a 1-D tensor is one row, read whole; ``shape`` [1, n] for the shared-expert
    gate HF stores 2-D). ``keep``: the block format it is kept in (``layout`` then says
    which), else it is dequantized; ``heads``: llama.cpp's q/k permutation to undo over
    that many heads; ``fix``: what turns its dense values into the Hugging Face weight's
    (``gguf_convert.stored_value_fix``: a norm stored as ``1 + w``, Qwen3.5's decay rate)."""

    def __init__(self, file: CheckpointFile, name: str, qtype, shape: tuple[int, ...], offset: int, *,
                 keep: QuantFormat | None, layout: str, device: torch.device, heads: int = 0,
                 fix: Any = None) -> None:
        from gguf import GGML_QUANT_SIZES

        self.file, self.name, self.qtype, self.shape, self.offset = file, name, qtype, shape, offset
        self.keep, self.device, self.heads, self.fix = keep, device, heads, fix
        self.layout = layout if keep is not None else None
        self.block, self.type_size = GGML_QUANT_SIZES[qtype]
        cols = shape[-1] if len(shape) == 2 else int(np.prod(shape))
        if cols % self.block:
            raise CorruptModelError(f"{file.path}: tensor {name!r} has {cols} columns, not whole "
                                    f"{qtype.name} blocks of {self.block}")
        self.row_bytes = cols // self.block * self.type_size
        self.dtype = gguf_convert._LOSSLESS_TORCH_DTYPES.get(qtype.name, torch.float32)

    def _rows(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    def read_rows(self, spans: list[tuple[int, int]]):
        if len(self.shape) != 2:  # a norm or bias: small, read whole and cut
            whole = self._dense(self.file.read_rows(self.offset, self.row_bytes, 0, 1)).reshape(self.shape)
            whole = self._finish(gguf_convert.unpermute_qk(whole, self.heads) if self.heads else whole)
            return whole if spans == [(0, self.shape[0])] else torch.cat([whole[a:b] for a, b in spans])
        parts = [self._span(a, b) for a, b in spans]
        raw = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._finish(raw)

    def _span(self, a: int, b: int) -> torch.Tensor:
        """Rows [a, b): block bytes for a kept tensor, else dequantized; unpermuted over the
        whole heads the rows fall in (the permutation stays inside a head)."""
        if not self.heads:
            return self._decoded(self.file.read_rows(self.offset, self.row_bytes, a, b))
        per = self.shape[0] // self.heads
        h0, h1 = a // per, -(-b // per)
        rows = self._decoded(self.file.read_rows(self.offset, self.row_bytes, h0 * per, h1 * per))
        rows = gguf_convert.unpermute_qk(rows, h1 - h0)
        return rows[a - h0 * per : b - h0 * per]

    def read_cols(self, start: int, stop: int):
        if len(self.shape) != 2:
            raise ValueError(f"{self.name}: a column cut needs a 2-D tensor, not {list(self.shape)}")
        k = self.shape[1]
        if self.keep is not None and (start % self.block or stop % self.block):
            raise cut_inside_blocks(self.name, self.keep, start, stop, k)
        b0, b1 = start // self.block, -(-stop // self.block)  # the blocks covering the cut
        raw = self.file.read_columns(self.offset, self.row_bytes, self.shape[0], b0 * self.type_size,
                                     b1 * self.type_size)
        if self.keep is not None:
            value = torch.from_numpy(raw)
        else:
            value = self._dense(raw)[:, start - b0 * self.block : stop - b0 * self.block]
        if self.heads:
            value = gguf_convert.unpermute_qk(value, self.heads)
        if self.keep is not None:
            return QuantizedWeight.from_blocks(value.contiguous(), self.keep, stop - start, device=self.device,
                                               layout=self.layout)
        return self._finish(value)

    def _decoded(self, raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(raw) if self.keep is not None else self._dense(raw)

    def _dense(self, raw: np.ndarray) -> torch.Tensor:
        """Rows of this tensor's type, dequantized (fp32; F16 and BF16 as they are)."""
        from gguf.quants import dequantize  # on use: see gguf_convert._reader_class

        try:
            array = dequantize(raw, self.qtype)
        except NotImplementedError as exc:
            raise UnsupportedModelError(f"{self.file.path}: tensor {self.name!r} has quantization type "
                                        f"{self.qtype.name}, which cannot be dequantized") from exc
        except ValueError as exc:
            raise CorruptModelError(f"{self.file.path}: tensor {self.name!r} ({self.qtype.name}) is malformed: "
                                    f"{exc}") from exc
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.dtype)

    def _finish(self, value: torch.Tensor):
        if self.keep is not None:
            return QuantizedWeight.from_blocks(value.contiguous(), self.keep, self.shape[1], device=self.device,
                                               layout=self.layout)
        if self.fix is not None:
            value = self.fix(value)  # as the converter undoes it
        return value.contiguous()


class JoinedRows(StoredTensor):
    """GGUF tensors read as one Hugging Face tensor, joined along its rows: a 2-D one's
    first axis (Granite 4's MLP: its gate's rows, then its up's), a 3-D stack's second
    (each expert's gate rows, then its up rows; read whole, dense). Kept blocks stay blocks
    when every part keeps the same format; otherwise each part is read dense."""

    def __init__(self, name: str, parts: list[GgufTensor]) -> None:
        first = parts[0]
        if any(p.shape[:-2] != first.shape[:-2] or p.shape[-1] != first.shape[-1] for p in parts):
            raise CorruptModelError(f"{first.file.path}: the parts of {name} differ in shape "
                                    f"({', '.join(str(list(p.shape)) for p in parts)})")
        if len({(p.keep, p.qtype) for p in parts}) > 1:
            for p in parts:  # blocks of two formats cannot be one weight: all dense
                p.keep, p.layout = None, None
        self.parts, self.name, self.dtype, self.layout = parts, name, first.dtype, first.layout
        rows = sum(p.shape[-2] for p in parts)
        self.shape = (*first.shape[:-2], rows, first.shape[-1])

    def read(self):
        if len(self.shape) == 2:
            return self.read_rows([(0, self.shape[0])])
        return torch.cat([p.read() for p in self.parts], dim=-2).contiguous()

    def read_rows(self, spans: list[tuple[int, int]]):
        if len(self.shape) != 2:
            raise ValueError(f"{self.name}: a stack of experts is read whole")
        pieces = []
        for a, b in spans:
            start = 0
            for p in self.parts:
                lo, hi = max(a, start), min(b, start + p.shape[0])
                if lo < hi:
                    pieces.append(p._span(lo - start, hi - start))
                start += p.shape[0]
        return self.parts[0]._finish(torch.cat(pieces) if len(pieces) > 1 else pieces[0])


def read_gguf_weights(path: Path, config: ModelConfig, *, device: torch.device, layout: str = "panels",
                      lazy: bool = False) -> GgufWeights:
    """The weights of GGUF ``path`` with the matrices of the formats ``layout``'s kernels
    read kept on ``device`` (panels: every format of ``engine.ops.quant.FORMATS``, for the C kernels;
    blocks: Q4_0/Q4_1/Q8_0/Q4_K, for the Triton kernel). ``lazy``: the
    :class:`GgufTensor` of each name instead, read when asked (see
    :mod:`engine.models.checkpoint`)."""
    stored = _gguf_tensors(path, config, device, layout)
    weights = stored.weights if lazy else {name: read_stored(w) for name, w in stored.weights.items()}
    if stored.dequantized:
        logger.info(
            "%s: dequantized %s (no kernel for these block formats; kept: %s)",
            path.name, ", ".join(f"{n} {k}" for k, n in sorted(stored.dequantized.items())),
            ", ".join(f"{n} {k}" for k, n in sorted(stored.kept.items())) or "none",
        )
    return dataclasses.replace(stored, weights=weights)


def _gguf_tensors(path: Path, config: ModelConfig, device: torch.device, layout: str) -> GgufWeights:
    formats = LAYOUT_FORMATS[layout]
    reader = gguf_convert._open_reader(path)
    arch = gguf_convert._Fields(reader, path).get("general.architecture")
    if arch not in gguf_convert._ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported")
    permuted = gguf_convert._ARCHITECTURES[arch][2]
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    file = CheckpointFile(path)
    weights: dict[str, StoredTensor] = {}
    joined: dict[str, dict[int, GgufTensor]] = {}  # parts of one tensor (gguf_recurrent.JOINED)
    kept: Counter[str] = Counter()
    dequantized: Counter[str] = Counter()
    total = 0
    for t in reader.tensors:
        if arch == "phi3" and t.name in gguf_convert._ROPE_FACTOR_TENSORS:
            continue  # read into config.json's rope_scaling by the converter
        if gguf_convert.past_last_layer(t.name, config.num_hidden_layers):
            continue  # a multi-token-prediction block: not read
        total += int(t.n_bytes)
        kind = t.tensor_type.name
        dims = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest first
        # Expert stacks (3-D) and routers are split into per-expert matrices as the
        # converter does; on CPU an expert's blocks are kept in panels (the layer stacks
        # them again: engine.models.layers.moe.stack_experts), else read dense.
        experts = dims[0] if len(dims) == 3 else 1
        # (Granite 4's experts stay stacked, as its checkpoints hold them.)
        moe = None if arch in gguf_recurrent.JOINED else gguf_convert.moe_tensor_names(
            t.name, config.architecture, experts)
        if moe is not None:
            stack = t.name.split(".")[2]
            if len(moe) > 1 or stack in gguf_convert._EXPERT_STACKS or stack == gguf_convert.GATE_UP_STACK:
                if len(dims) != 3:
                    raise CorruptModelError(f"{path}: expert tensor {t.name!r} is not 3-D ({dims})")
                # A fused gate-and-up stack: each expert's gate half, then its up half.
                parts = 2 if stack == gguf_convert.GATE_UP_STACK else 1
                if dims[1] % parts:
                    raise CorruptModelError(f"{path}: expert tensor {t.name!r} has an odd row count ({dims})")
                step = int(t.n_bytes) // (experts * parts)
                keep = format_of(kind) if layout == "panels" and kind in formats else None
                for i, name in enumerate(moe):
                    weights[name] = GgufTensor(file, name, t.tensor_type, (dims[1] // parts, dims[2]),
                                               int(t.data_offset) + i * step, keep=keep, layout=layout, device=device)
                if keep is not None:
                    kept[f"{kind} (experts)"] += 1
                    continue
            else:  # a router [E, hidden] or the shared expert's gate ([hidden] in GGUF, [1, hidden] in
                # HF), read dense; or a shared expert's projection, kept in blocks as a dense MLP's
                shape = (1, dims[0]) if len(dims) == 1 else dims
                keep = (format_of(kind) if kind in formats and len(dims) == 2 and stack.endswith("_shexp")
                        and stack != "ffn_gate_inp_shexp" else None)
                weights[moe[0]] = GgufTensor(file, moe[0], t.tensor_type, shape, int(t.data_offset), keep=keep,
                                             layout=layout, device=device)
                if keep is not None:
                    kept[kind] += 1
                    continue
            if kind not in gguf_convert._LOSSLESS_TORCH_DTYPES:
                dequantized[f"{kind} (experts)"] += 1
            continue
        name = gguf_convert.hf_tensor_name(t.name, arch)
        if name is None:
            raise UnsupportedModelError(f"{path}: unknown GGUF tensor {t.name!r}")
        dims = gguf_recurrent.hf_shape(arch, name, dims)  # Mamba-2's A, D and norm: the vectors they are
        proj = name.rsplit(".", 2)[-2] if permuted else ""
        # Qwen3.5's convolution kernels are 2-D but no matmul's: read dense whatever their type.
        matrix = len(dims) == 2 and not name.endswith("conv1d.weight")
        keep = format_of(kind) if kind in formats and matrix else None
        if keep is not None:
            kept[kind] += 1
        elif kind not in gguf_convert._LOSSLESS_TORCH_DTYPES:
            dequantized[kind] += 1
        tensor = GgufTensor(file, name, t.tensor_type, dims, int(t.data_offset), keep=keep, layout=layout,
                            device=device, heads=heads.get(proj, 0),
                            fix=gguf_convert.stored_value_fix(arch, name))
        part = gguf_recurrent.joined_part(arch, t.name)
        if part is not None:
            joined.setdefault(name, {})[part] = tensor
            continue
        # GPT-2's projections: kept blocks stay llama.cpp's [out, in] (the model reads them
        # so); dense ones read as a Hugging Face Conv1D, [in, out], as the converter writes.
        conv1d = arch == "gpt2" and name.endswith(gguf_convert.GPT2_CONV1D) and keep is None
        weights[name] = Transposed(tensor) if conv1d else tensor
    for name, parts in joined.items():
        if sorted(parts) != list(range(len(parts))) or len(parts) < 2:
            raise CorruptModelError(f"{path}: {name} has parts {sorted(parts)} of the GGUF's, not all of them")
        weights[name] = JoinedRows(name, [parts[i] for i in sorted(parts)])
    del reader  # the header's memory map goes with it: the tensors are read by position
    return GgufWeights(LazyWeights(weights, [file]), total, dict(kept), dict(dequantized))


__all__ = ["GgufTensor", "GgufWeights", "cut_inside_blocks", "read_gguf_weights"]
