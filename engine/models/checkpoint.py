"""A checkpoint's tensors read when asked, whole or in slices: what a tensor-parallel rank
loads (issue 41).

One rank loads every tensor at once (:func:`engine.models.loader.load_model`). A rank of
``N`` keeps about ``1 / N`` of the model, and reading the whole checkpoint to cut it would
cost every rank the model's full size in host memory at its peak. A lazy load
(``load_model(..., lazy=True)``) instead maps each Hugging Face name to a
:class:`StoredTensor`, which reads from the file only what the model asks of it, when it
asks: :class:`~engine.models.layers.shard.ShardedWeights` asks for the rank's rows
(:meth:`StoredTensor.read_rows`) or input columns (:meth:`StoredTensor.read_cols`) and
the replicated tensors whole (:meth:`StoredTensor.read`). So a rank's host memory peaks
at its own slice plus one tensor's cut in flight, and the ranks read the same file at
once without waiting for each other.

The bytes come from positioned reads of the file (``os.preadv`` into the tensor's own
buffer), not from a memory map: a mapped page a process touched counts in its resident
size until the map goes, so reading a column cut through a map would show every rank
holding the whole tensor. Rows are contiguous in both formats (one read); a column cut
reads each row's run of bytes. Every read is counted (:attr:`LazyWeights.bytes_read`),
which is what the tests hold to the rank's share.

This module reads safetensors (its header is a length and a JSON table of dtype, shape
and byte offsets); :mod:`engine.models.gguf_quant` builds GGUF's stored tensors on the
same reads.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from engine.errors import CorruptModelError, UnsupportedModelError

# safetensors dtype names -> torch dtypes (the ones a model's weights come in).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    # fp8 checkpoints' weight codes (engine/models/fp8.py reads them dequantized).
    "F8_E4M3": torch.float8_e4m3fn,
}
# A header larger than this is not a safetensors file (the format's own readers cap it at
# 100 MB: a table of tens of thousands of tensors is a few MB).
MAX_HEADER_BYTES = 100 * 2**20


class CheckpointFile:
    """One file read by position, counting the bytes it reads (thread-safe: the ranks of
    one process, and tests, may read at once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        self.bytes_read = 0
        self._lock = threading.Lock()

    def read_into(self, buffer: np.ndarray, offset: int) -> None:
        """Fill ``buffer`` (contiguous, writable) with the file's bytes from ``offset``."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._pread(fd, buffer, offset)
        finally:
            os.close(fd)

    def _pread(self, fd: int, buffer: np.ndarray, offset: int) -> None:
        view = memoryview(buffer).cast("B")
        if offset < 0 or offset + len(view) > self.size:
            raise CorruptModelError(f"{self.path}: a tensor's bytes [{offset}, {offset + len(view)}) "
                                    f"lie outside the file ({self.size} bytes)")
        done = 0
        while done < len(view):  # preadv may return short (2 GiB at most per call on Linux)
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CorruptModelError(f"{self.path}: the file ended inside a tensor")
            done += n
        with self._lock:
            self.bytes_read += len(view)

    def read_rows(self, offset: int, row_bytes: int, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of a row-major array of ``row_bytes``-byte rows at
        ``offset``: uint8 ``[stop - start, row_bytes]``, one read."""
        out = np.empty((stop - start, row_bytes), dtype=np.uint8)
        self.read_into(out, offset + start * row_bytes)
        return out

    def read_columns(self, offset: int, row_bytes: int, rows: int, lo: int, hi: int) -> np.ndarray:
        """Bytes ``[lo, hi)`` of each of ``rows`` rows: uint8 ``[rows, hi - lo]``, one read
        per row (only the cut's bytes leave the file)."""
        out = np.empty((rows, hi - lo), dtype=np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for r in range(rows):
                self._pread(fd, out[r], offset + r * row_bytes + lo)
        finally:
            os.close(fd)
        return out


class StoredTensor:
    """A tensor in a checkpoint file, not read yet: its Hugging Face ``name``, ``shape``
    (2-D weights ``[rows, columns]``: output and input features), the ``dtype`` it is
    read as, and ``layout``: ``"panels"`` / ``"blocks"`` where it is read as a
    :class:`~engine.ops.quant.QuantizedWeight` kept in its GGUF blocks, else ``None``.
    Each read returns a tensor in its own storage."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str | None = None

    def read(self):
        """The whole tensor."""
        return self.read_rows([(0, self.shape[0])])

    def read_rows(self, spans: list[tuple[int, int]]):
        """Rows ``[start, stop)`` of each span, concatenated in order."""
        raise NotImplementedError

    def read_cols(self, start: int, stop: int):
        """Columns ``[start, stop)`` (input features) of a 2-D tensor."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {list(self.shape)}, {self.dtype}, layout={self.layout})"


class SafetensorsTensor(StoredTensor):
    """One tensor of a safetensors file."""

    def __init__(self, file: CheckpointFile, name: str, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> None:
        self.file, self.name, self.dtype, self.shape, self.offset = file, name, dtype, shape, offset
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def _row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.itemsize if self.shape else self.itemsize

    def _tensor(self, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(raw).view(self.dtype).reshape(shape)

    def read_rows(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        if not self.shape:  # a scalar
            return self._tensor(self.file.read_rows(self.offset, self.itemsize, 0, 1), ())
        row = self._row_bytes()
        parts = [self._tensor(self.file.read_rows(self.offset, row, a, b), (b - a, *self.shape[1:])) for a, b in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_cols(self, start: int, stop: int) -> torch.Tensor:
        if len(self.shape) != 2:
            raise ValueError(f"{self.name}: a column cut needs a 2-D tensor, not {list(self.shape)}")
        raw = self.file.read_columns(self.offset, self._row_bytes(), self.shape[0], start * self.itemsize,
                                     stop * self.itemsize)
        return self._tensor(raw, (self.shape[0], stop - start))


class Transposed(StoredTensor):
    """A stored 2-D tensor read transposed (GPT-2's Conv1D weights, stored ``[in, out]``,
    read as ``[out, in]``): a row cut is a column cut of the stored tensor, and the other
    way round."""

    def __init__(self, stored: StoredTensor) -> None:
        self.stored = stored
        self.name, self.dtype, self.layout = stored.name, stored.dtype, stored.layout
        self.shape = tuple(reversed(stored.shape))

    def read(self) -> torch.Tensor:
        return self.stored.read().t()  # one read of the whole, not one per stored row

    def read_rows(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        return torch.cat([self.stored.read_cols(a, b) for a, b in spans], dim=1).t()

    def read_cols(self, start: int, stop: int) -> torch.Tensor:
        return self.stored.read_rows([(start, stop)]).t()


def read_safetensors_header(file: CheckpointFile) -> dict[str, SafetensorsTensor]:
    """The tensors a safetensors file holds, by stored name (nothing of their data read)."""
    path = file.path
    head = np.empty(8, dtype=np.uint8)
    file.read_into(head, 0)
    (length,) = struct.unpack("<Q", head.tobytes())
    if length > min(MAX_HEADER_BYTES, file.size - 8):
        raise CorruptModelError(f"{path}: not a readable safetensors file (a header of {length} bytes)")
    raw = np.empty(length, dtype=np.uint8)
    file.read_into(raw, 8)
    try:
        table = json.loads(raw.tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"{path}: not a readable safetensors file ({exc})") from exc
    if not isinstance(table, dict):
        raise CorruptModelError(f"{path}: not a readable safetensors file (its header is not a table)")
    base, data_bytes = 8 + length, file.size - 8 - length
    out = {}
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModelError(f"{path}: tensor {name!r} has a malformed header entry") from exc
        dtype = SAFETENSORS_DTYPES.get(kind)
        if dtype is None:
            raise UnsupportedModelError(f"{path}: tensor {name!r} is stored as {kind}, which is not read")
        t = SafetensorsTensor(file, name, dtype, shape, base + int(begin))
        want = int(np.prod(shape, dtype=np.int64)) * t.itemsize
        if not 0 <= begin <= end <= data_bytes or end - begin != want:
            raise CorruptModelError(f"{path}: tensor {name!r} ({kind} {list(shape)}) has byte offsets "
                                    f"[{begin}, {end}) that do not fit it or the file")
        out[name] = t
    return out


class LazyWeights(Mapping):
    """Hugging Face name -> :class:`StoredTensor`, over the ``files`` they read from."""

    def __init__(self, tensors: dict[str, StoredTensor], files: list[CheckpointFile]) -> None:
        self._tensors, self.files = tensors, files

    def __getitem__(self, name: str):
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def bytes_read(self) -> int:
        """Bytes read from the files so far: tensor data, and safetensors' headers (a
        GGUF's header is parsed by gguf's reader, not counted)."""
        return sum(f.bytes_read for f in self.files)


def read_stored(w):
    """``w`` whole: a :class:`StoredTensor` read, anything else as it is."""
    return w.read() if isinstance(w, StoredTensor) else w


__all__ = [
    "CheckpointFile",
    "LazyWeights",
    "SafetensorsTensor",
    "StoredTensor",
    "Transposed",
    "read_safetensors_header",
    "read_stored",
]
