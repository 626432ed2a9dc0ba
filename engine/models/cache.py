"""The on-disk cache of converted models.

Converting a GGUF (parse, dequantize every tensor, rebuild the tokenizer) takes seconds;
reading the converted Hugging Face folder back takes a fraction of that. The cache keys a
converted folder by the SHA-256 of the source file's bytes plus the converter's version, so
a changed file, or a changed converter, never reads a stale conversion.

Layout::

    <cache root>/
      gguf/
        <sha256 hex>-v<converter version>/   complete converted folders only
        .tmp-<random>/                        conversions in progress (or left by a crash)

A conversion is written into a fresh ``.tmp-*`` folder and renamed into place in one step,
so a crash mid-conversion leaves at worst a stray temp folder, never a half-written entry.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# A temp folder untouched this long belongs to a process killed mid-conversion (a live one
# writes its tensors within minutes even for large models), so it is removed.
_ABANDONED_AFTER_SECONDS = 24 * 3600

# Read in 1 MiB pieces: large enough that the per-call overhead vanishes, small enough to
# keep memory flat for multi-GB files. SHA-256 measured 0.11 s on the 98 MB SmolLM2 GGUF
# (2-core dev box, SHA extensions) against 0.28 s for BLAKE2b, so SHA-256 it is.
_HASH_CHUNK_BYTES = 1 << 20


def default_cache_dir() -> Path:
    """``$ENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/engine``, else ``~/.cache/engine``.

    This is the one place the loader reads the environment; callers that want no ambient
    state pass ``cache_dir`` to :func:`engine.models.loader.load_model` instead.
    """
    explicit = os.environ.get("ENGINE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "engine"


def file_digest(path: Path) -> str:
    """Hex SHA-256 of the file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def cached_folder(
    source: Path, *, cache_dir: Path, kind: str, version: int, build: Callable[[Path], None]
) -> Path:
    """The cached conversion of ``source``; run ``build(tmp_folder)`` first if there is none.

    ``kind`` names the converter (a subfolder of the cache), ``version`` is bumped whenever
    the converter's output changes. ``build`` must fill the empty folder it is given; only
    if it returns normally does the folder become visible under its final name.
    """
    root = cache_dir / kind
    final = root / f"{file_digest(source)}-v{version}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(root)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:
            # Another process finished the same conversion first; theirs is as good.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_abandoned(root: Path) -> None:
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _ABANDONED_AFTER_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process removed it first
