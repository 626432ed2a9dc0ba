"""The KV store: full prompt blocks kept as files in a shared folder (``--kv-transfer-config``).

An engine whose role writes (``kv_producer``, ``kv_both``) saves every full block of a
prompt it computes, right after the step that completed the block; an engine whose role
reads (``kv_consumer``, ``kv_both``) looks a new prompt's leading blocks up there, past
what its own prefix cache holds, and copies them into its pool instead of computing them.
Engines that share the folder (a prefill engine and a decode engine, data-parallel
cores, one engine before and after a restart) thus share their prompts' KV, as vLLM's
``ExampleConnector`` shares it through a folder.

Names. A block's file is named by a chained SHA-256 digest: of the digest of the block
before it (the first block's: the store's *namespace*), the request's prefix-cache salt
and the block's token ids (images as their content hash, as the prefix cache keys them).
Equal digests therefore mean equal prefixes. The namespace is a digest of everything the
KV depends on besides the tokens: the model's files (their names, sizes and a hash of
their first and last MiB), the dtype, ``hf_overrides`` and the pool's layout (each K/V
tensor's dtype and block shape: kv_cache_dtype, block size, heads). Engines that differ
in any of these never read each other's blocks; each has a folder of its own below the
shared one: ``<shared_storage_path>/<namespace>/<digest[:2]>/<digest>.kv``.

A file is a header (magic, the block's digest, the payload's length) and the block's
bytes in every layer's K and V tensors (scales included), in the pool's layout. It is
written to a temporary name and renamed, so a reader sees a whole file or none. A file
that is missing, short or does not carry its own digest ends the lookup there: the block
and those after it are computed, as vLLM's ``recompute`` load-failure policy does.
Reading happens off the event loop, before the request is scheduled
(:mod:`engine.actors.kv_store`); writing happens on the model thread after the step.

Nothing is ever deleted: the folder grows with the distinct prompts computed, and any
file may be removed at any time (it is then a miss).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.kv_transfer import KVTransferConfig
from engine.ops import KVCache, QuantizedKV

logger = logging.getLogger(__name__)

MAGIC = b"EKV1"
HEADER = struct.Struct("<4s32sQ")  # magic, the block's digest, payload bytes
FORMAT_VERSION = 1
_SAMPLE = 1 << 20  # bytes of each model file's head and tail in the fingerprint


def pool_tensors(kv_caches: Sequence[tuple[KVCache, KVCache]]) -> list[torch.Tensor]:
    """Every tensor of the pool a block has rows in, in a fixed order: each layer's K then
    V (one latent tensor once), codes then scales, each viewed as bytes."""
    out: list[torch.Tensor] = []
    for k, v in kv_caches:
        for cache in (k,) if k is v else (k, v):
            for t in (cache.data, cache.scale) if isinstance(cache, QuantizedKV) else (cache,):
                out.append(t.view(torch.uint8))
    return out


def model_fingerprint(path: Path) -> list[tuple[str, int, str]]:
    """The model's files as the namespace sees them: (name, size, SHA-256 of the first and
    last MiB) of the checkpoint file, or of a folder's weight and config files."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".gguf", ".json"))
    out = []
    for f in files:
        size = f.stat().st_size
        digest = hashlib.sha256()
        with open(f, "rb") as handle:
            digest.update(handle.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                handle.seek(size - _SAMPLE)
            digest.update(handle.read(_SAMPLE))
        out.append((f.name, size, digest.hexdigest()))
    return out


class KVStore:
    """One engine's view of the shared folder: its namespace's blocks."""

    def __init__(self, root: str | Path, identity: dict[str, Any], block_nbytes: int, *, saves: bool,
                 loads: bool, model_path: Path | None = None) -> None:
        self.root = Path(root)
        self.block_nbytes = block_nbytes
        self.saves = saves
        self.loads = loads
        self._identity = identity  # what the namespace digests, the model's files but
        self._model_path = model_path  # read again by refresh()
        self._name(identity)
        self.blocks_written = 0
        self.blocks_read = 0
        self._write_failed = False

    @classmethod
    def for_engine(cls, kv: KVTransferConfig, kv_caches: Sequence[tuple[KVCache, KVCache]], *,
                   model_path: Path, dtype: str, hf_overrides: str | None) -> KVStore:
        """The store of an engine with this pool and model."""
        tensors = pool_tensors(kv_caches)
        layout = [(str(t.dtype), list(t.shape[1:])) for t in tensors]
        identity = {"format": FORMAT_VERSION, "model": model_fingerprint(model_path), "dtype": dtype,
                    "hf_overrides": hf_overrides, "layout": layout}
        nbytes = sum(t[0].numel() for t in tensors)
        return cls(kv.shared_storage_path, identity, nbytes, saves=kv.saves, loads=kv.loads,
                   model_path=model_path)

    def _name(self, identity: dict[str, Any]) -> None:
        self.namespace = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        self.folder = self.root / self.namespace
        self._seed = bytes.fromhex(self.namespace)

    def refresh(self) -> None:
        """The model was read again from its checkpoint (sleep mode's level 2 wake-up,
        ``reload_weights``): its files are fingerprinted again, so that weights a trainer
        rewrote share blocks only with engines on the same weights."""
        if self._model_path is not None:
            self._identity = {**self._identity, "model": model_fingerprint(self._model_path)}
            self._name(self._identity)

    # -- names -------------------------------------------------------------------------------

    def digests(self, token_ids: Sequence[int], salt: str | None, block_size: int) -> tuple[bytes, ...]:
        """The digest of each full block of ``token_ids`` (cache keys: an image's
        placeholders are negative), chained from the namespace."""
        salt_bytes = b"" if salt is None else b"\1" + salt.encode("utf-8", "surrogatepass")
        out = []
        parent = self._seed
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            digest = hashlib.sha256(parent)
            digest.update(struct.pack("<I", len(salt_bytes)) + salt_bytes)
            digest.update(struct.pack(f"<{block_size}q", *token_ids[start:start + block_size]))
            parent = digest.digest()
            out.append(parent)
        return tuple(out)

    def path(self, digest: bytes) -> Path:
        name = digest.hex()
        return self.folder / name[:2] / f"{name}.kv"

    # -- reading (a worker thread) -------------------------------------------------------------

    def read_prefix(self, digests: Sequence[bytes]) -> list[bytearray]:
        """The payloads of the leading blocks of ``digests`` found whole in the folder,
        stopping at the first that is not."""
        out = []
        for digest in digests:
            payload = self._read(digest)
            if payload is None:
                break
            out.append(payload)
        return out

    def _read(self, digest: bytes) -> bytearray | None:
        try:
            with open(self.path(digest), "rb") as f:
                header = f.read(HEADER.size)
                if len(header) != HEADER.size:
                    return None
                magic, stored, length = HEADER.unpack(header)
                if magic != MAGIC or stored != digest or length != self.block_nbytes:
                    return None
                payload = bytearray(length)
                if f.readinto(payload) != length or f.read(1):
                    return None
        except OSError:
            return None
        return payload

    # -- the pool (the model thread) -------------------------------------------------------------

    def save(self, kv_caches: Sequence[tuple[KVCache, KVCache]],
             blocks: Sequence[tuple[int, bytes]]) -> int:
        """Write each ``(block_id, digest)`` block of the pool not in the folder yet; how
        many were written. A folder that cannot be written is logged (once) and skipped:
        the blocks are then only not shared."""
        todo = [(b, d) for b, d in blocks if not self.path(d).exists()]
        if not todo:
            return 0
        tensors = pool_tensors(kv_caches)
        ids = torch.tensor([b for b, _ in todo], dtype=torch.long, device=tensors[0].device)
        rows = torch.cat([t.index_select(0, ids).reshape(len(todo), -1) for t in tensors], dim=1).cpu()
        written = 0
        for row, (_, digest) in zip(rows, todo, strict=True):
            try:
                self._write(digest, row.numpy().tobytes())
                written += 1
            except OSError as exc:
                if not self._write_failed:
                    logger.warning("kv_transfer_config: cannot write KV blocks to %s (%s); "
                                   "they are not shared", self.folder, exc)
                    self._write_failed = True
                break
        self.blocks_written += written
        return written

    def _write(self, digest: bytes, payload: bytes) -> None:
        path = self.path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(HEADER.pack(MAGIC, digest, len(payload)))
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def load(self, kv_caches: Sequence[tuple[KVCache, KVCache]],
             blocks: Sequence[tuple[int, Any]]) -> None:
        """Copy each ``(block_id, payload)`` (a payload :meth:`read_prefix` returned) into the
        pool."""
        if not blocks:
            return
        tensors = pool_tensors(kv_caches)
        device = tensors[0].device
        rows = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for _, p in blocks]).to(device)
        ids = torch.tensor([b for b, _ in blocks], dtype=torch.long, device=device)
        offset = 0
        for t in tensors:
            width = t[0].numel()
            t.index_copy_(0, ids, rows[:, offset:offset + width].reshape(len(blocks), *t.shape[1:]))
            offset += width
        self.blocks_read += len(blocks)
