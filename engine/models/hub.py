"""Models by name: a Hugging Face Hub id becomes a local folder or GGUF file.

:func:`resolve_name` is called wherever a model is named (``--model``, ``--tokenizer``, a
speculative draft's ``model``, ``open_engine(model=...)``), before anything heavy loads. A
local file or folder is itself. Anything else must look like a Hub id
(``ORG/NAME``, ``NAME``; ``ORG/NAME-GGUF:Q4_K_M`` picks a GGUF repo's file of that
quantization, as llama.cpp's ``-hf`` does) and is looked up with ``huggingface_hub``, never a
hand-written HTTP client, in the Hugging Face cache layout
(``CACHE/models--ORG--NAME/{blobs,refs,snapshots}``) that transformers and vLLM write too:

1. online (``HF_HUB_OFFLINE`` unset): one ``model_info`` call gives the commit the
   revision points at and every file's size and hash; the files the engine reads are chosen
   from that listing (:func:`plan_files`), the free space of the cache is checked against
   what is missing, and only those files are fetched (``hf_hub_download``, pinned to the
   commit, so all come from one commit even if the branch moves meanwhile; its file locks
   let two servers fetch the same model at once; an interrupted transfer resumes by HTTP
   Range within the call);
2. offline, or the Hub unreachable: the snapshot the cache's ``refs/REVISION`` names.

Each file the engine reads is checked against its hash, which the cache's layout carries:
a blob is named by its ETag, the sha256 of an LFS file (weights) or the git blob sha1 of
a small one. Hashing gigabytes at every start would cost seconds, so a blob hashed once is
recorded with its size and mtime (under the engine's cache folder, not inside the Hub's);
a later start re-hashes only a blob whose size or mtime changed. A blob that fails is
fetched again (online) or refused (offline): a truncated or corrupted file never loads.

A LoRA adapter by Hub id (``--lora-modules name=ORG/NAME``, ``/v1/load_lora_adapter``)
goes the same way with ``adapter=True``: only ``adapter_config.json`` and
``adapter_model.safetensors`` are fetched (an adapter repo's README, training arguments and
checkpoints stay on the Hub); a repo with the weights as ``adapter_model.bin`` only, or one
that adds vocabulary, is refused before its weights are fetched.

Refusals, each before any weight is fetched: an id that is neither a path nor a Hub id; a
repo or revision the Hub does not have; a gated or private repo without a token; not
cached while offline; weights only as pickles (``*.bin``, ``*.pt``: the engine reads
safetensors and never unpickles); a config with ``auto_map`` (the engine runs no
downloaded code); several GGUF files and no tag; not enough free disk.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from tqdm.auto import tqdm

from engine.errors import (
    CorruptModelError,
    ModelAccessError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from engine.models import cache

logger = logging.getLogger("engine")

# huggingface_hub's own rule for repo ids (validate_repo_id): a name of at most 96
# characters from these, not starting or ending with - or ., with no -- or .. inside.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}")
# A GGUF tag names a quantization (Q4_K_M, IQ2_XS, F16, BF16, q8_0).
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
_COMMIT = re.compile(r"[0-9a-f]{40}")

# What the engine reads of a Hugging Face folder besides its weights: the configs, the
# tokenizer and its chat template, image processors, sentence-transformers' pooling files.
MODEL_FILES = (
    "config.json", "generation_config.json", "preprocessor_config.json",
    "processor_config.json", "modules.json", "sentence_bert_config.json",
    "config_sentence_transformers.json", "*_Pooling/config.json",
)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json",
    # A byte-level BPE in the slow format, read where there is no tokenizer.json (OPT's).
    "vocab.json", "merges.txt",
)
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# A peft LoRA adapter's files (engine.models.lora reads these two), and those of an adapter
# that adds tokens (refused there, and here before anything is fetched).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
ADAPTER_VOCAB_FILES = ("added_tokens.json", "new_embeddings.safetensors")


@dataclasses.dataclass(frozen=True, slots=True)
class HubName:
    """A Hub id as written: ``repo_id`` and, for a GGUF repo, the quantization ``tag``."""

    repo_id: str
    tag: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.tag is None else f"{self.repo_id}:{self.tag}"


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file of a repo: its path in the repo, size, and the blob name (ETag) it is
    cached under: the sha256 of an LFS file, the git blob sha1 of another. ``size`` and
    ``etag`` are None for a file known only from a cached snapshot."""

    name: str
    size: int | None = None
    etag: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Resolved:
    """Where a name points: ``path`` (a folder, or a ``.gguf`` file) and, for a Hub id,
    the id and the commit it was read at (both None for a local path)."""

    path: Path
    name: HubName | None = None
    commit: str | None = None


def parse_name(name: str) -> HubName | None:
    """``None`` when ``name`` is an existing local path (it is then used as it is);
    else its :class:`HubName`. A string that is neither (a path that does not exist, a
    traversal, anything shell-looking) raises :class:`ModelNotFoundError`."""
    if Path(name).expanduser().exists():
        return None
    repo, _, tag = name.partition(":")
    looks_local = name.startswith(("/", ".", "~")) or name.endswith(".gguf") or "\\" in name
    if looks_local or not _REPO_ID.fullmatch(repo) or ".." in repo or "--" in repo \
            or (tag and not _TAG.fullmatch(tag)) or name.endswith(":"):
        raise ModelNotFoundError(
            f"model {name!r} not found: no such local file or folder, and not a Hugging Face "
            "Hub id (ORG/NAME, or ORG/NAME-GGUF:QUANT for one file of a GGUF repo)")
    return HubName(repo, tag or None)


def disk_free(path: Path) -> int:
    """Free bytes of the filesystem that holds ``path`` (its nearest existing parent)."""
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    raise OSError(f"no existing parent of {path}")


def resolve_name(
    name: str, *, revision: str | None = None, token: str | None = None,
    cache_dir: str | Path | None = None, endpoint: str | None = None,
    offline: bool | None = None, tokenizer_only: bool = False, adapter: bool = False,
    free_bytes: Callable[[Path], int] = disk_free, record_dir: Path | None = None,
) -> Resolved:
    """The local :class:`Resolved` of ``name`` (see the module docstring).

    ``revision``: a branch, tag or commit (default ``main``). ``token``: None reads
    ``HF_TOKEN`` or the saved login, as huggingface_hub does. ``cache_dir``: None is
    ``HF_HUB_CACHE`` (``HF_HOME/hub``). ``endpoint``: None is ``HF_ENDPOINT``.
    ``offline``: None is ``HF_HUB_OFFLINE``. ``tokenizer_only``: fetch the tokenizer's
    files only (``--tokenizer``). ``adapter``: a peft LoRA adapter's files only.
    ``free_bytes`` measures the cache's free space (tests
    give their own); ``record_dir`` keeps which blobs were hashed (None: the engine's cache).
    Raises :class:`ModelNotFoundError`, :class:`ModelAccessError`,
    :class:`UnsupportedModelError`, :class:`CorruptModelError` or :class:`ModelLoadError`
    (no space), each naming the repo."""
    hub = parse_name(name)
    if hub is None:
        return Resolved(Path(os.path.abspath(Path(name).expanduser())))
    if hub.tag is not None and (tokenizer_only or adapter):
        what = "tokenizer" if tokenizer_only else "adapter"
        raise ModelNotFoundError(f"{what} {name!r}: a {what} is a repo id, not one GGUF file")
    # huggingface_hub reads HF_ENDPOINT once, at import; its metadata calls and its file
    # URLs are both given the endpoint, so that they never ask two different hosts.
    fetch = _Fetch(hub, revision or "main", token,
                   Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser(),
                   endpoint or constants.ENDPOINT, tokenizer_only, free_bytes,
                   record_dir if record_dir is not None else cache.default_cache_dir() / "hub-checked",
                   adapter=adapter)
    is_offline = constants.HF_HUB_OFFLINE if offline is None else offline
    return fetch.from_cache(None) if is_offline else fetch.online()


def plan_files(hub: HubName, files: Sequence[RemoteFile], *, tokenizer_only: bool = False,
               where: str = "", adapter: bool = False,
               read_index: Callable[[RemoteFile], Any] | None = None) -> list[RemoteFile]:
    """The files of ``files`` (a repo's listing) that the engine reads: for a GGUF repo the
    one file ``hub.tag`` picks; else the configs, the tokenizer and the safetensors (those
    ``model.safetensors.index.json`` names, read by ``read_index``, when there is one).
    Refuses a repo it cannot serve (see the module docstring); ``where`` names the listing
    in messages (the Hub, or a cache folder)."""
    names = {f.name: f for f in files}
    if adapter:
        return _plan_adapter(hub, names, where)
    wanted = [f for f in files if _matches(f.name, TOKENIZER_FILES)]
    if tokenizer_only:
        if "tokenizer.json" not in names and not {"vocab.json", "merges.txt"} <= names.keys():
            raise ModelNotFoundError(f"{hub}{where}: no tokenizer.json (a fast tokenizer is "
                                     "required, or a byte-level BPE's vocab.json and merges.txt)")
        return wanted
    ggufs = [f for f in files if f.name.lower().endswith(".gguf") and "mmproj" not in f.name.lower()]
    safetensors = [f for f in files if f.name.endswith(".safetensors") and "/" not in f.name]
    if hub.tag is not None or (ggufs and not safetensors):
        return [_pick_gguf(hub, ggufs, where)]
    if "config.json" not in names:
        raise ModelNotFoundError(f"{hub}{where}: no config.json (not a Hugging Face model repo)")
    if not safetensors:
        pickles = sorted(f.name for f in files if _matches(f.name, PICKLED))
        if pickles:
            raise UnsupportedModelError(
                f"{hub}{where}: its weights are pickles only ({', '.join(pickles[:4])}); the "
                "engine reads safetensors and never unpickles a download: pick a repo (or a "
                "revision) with *.safetensors")
        raise ModelNotFoundError(f"{hub}{where}: no weights (no *.safetensors and no .gguf)")
    index = names.get("model.safetensors.index.json")
    if index is not None and read_index is not None:
        # The shards the index names, not every *.safetensors: Mistral's repos carry a
        # consolidated copy of the same weights beside them (twice the download).
        data = read_index(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptModelError(f"{hub}{where}: model.safetensors.index.json has no weight_map")
        shards = sorted(set(map(str, weight_map.values())))
        absent = [name for name in shards if name not in names]
        if absent:
            raise ModelNotFoundError(f"{hub}{where}: the index names shard(s) the repo lacks: "
                                     f"{', '.join(absent)}")
        wanted += [index] + [names[name] for name in shards]
    else:
        # Without an index the loader reads every root *.safetensors.
        wanted += safetensors
    wanted += [f for f in files if _matches(f.name, MODEL_FILES)]
    return wanted


def _plan_adapter(hub: HubName, names: dict[str, RemoteFile], where: str) -> list[RemoteFile]:
    if ADAPTER_FILES[0] not in names:
        raise ModelNotFoundError(f"{hub}{where}: no {ADAPTER_FILES[0]} (not a peft LoRA adapter repo)")
    vocab = [n for n in ADAPTER_VOCAB_FILES if n in names]
    if vocab:
        raise UnsupportedModelError(f"{hub}{where}: it adds vocabulary ({', '.join(vocab)}); adapters "
                                    "with extra tokens are not supported")
    if ADAPTER_FILES[1] not in names:
        pickles = sorted(n for n in names if _matches(n, PICKLED) and "/" not in n)
        if pickles:
            raise UnsupportedModelError(
                f"{hub}{where}: its weights are pickles only ({', '.join(pickles[:4])}); the "
                "engine reads adapter_model.safetensors and never unpickles a download")
        raise ModelNotFoundError(f"{hub}{where}: no {ADAPTER_FILES[1]}")
    return [names[n] for n in ADAPTER_FILES]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _pick_gguf(hub: HubName, ggufs: list[RemoteFile], where: str) -> RemoteFile:
    if not ggufs:
        raise ModelNotFoundError(f"{hub}{where}: no .gguf file in the repo")
    listed = ", ".join(sorted(f.name for f in ggufs))
    if hub.tag is None:
        if len(ggufs) > 1:
            raise ModelNotFoundError(
                f"{hub}{where} holds {len(ggufs)} GGUF files ({listed}): name one quantization "
                f"as {hub.repo_id}:TAG (e.g. :Q4_K_M)")
        chosen = ggufs
    else:
        # The tag stands as a whole word of the file name: Q4_K does not pick Q4_K_M.
        word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(hub.tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
        chosen = [f for f in ggufs if word.search(PurePosixPath(f.name).name)]
        if not chosen:
            raise ModelNotFoundError(f"{hub}{where}: no GGUF file of quantization {hub.tag} "
                                     f"(the repo has {listed})")
    if len(chosen) > 1:
        raise UnsupportedModelError(
            f"{hub}{where}: {', '.join(f.name for f in chosen)} all match; a GGUF split in "
            "several files is not supported")
    if re.search(r"-\d{5}-of-\d{5}\.gguf$", chosen[0].name):
        raise UnsupportedModelError(f"{hub}{where}: {chosen[0].name} is one part of a split "
                                    "GGUF; split files are not supported")
    return chosen[0]


class _Fetch:
    """One resolution of a Hub id: the online path, the cached one, and the checks."""

    def __init__(self, hub: HubName, revision: str, token: str | None, cache_dir: Path,
                 endpoint: str, tokenizer_only: bool,
                 free_bytes: Callable[[Path], int], record_dir: Path, *, adapter: bool = False) -> None:
        self.hub, self.revision, self.token = hub, revision, token
        self.cache_dir, self.endpoint, self.tokenizer_only = cache_dir, endpoint, tokenizer_only
        self.adapter = adapter
        self.free_bytes, self.record_dir = free_bytes, record_dir
        self.storage = cache_dir / ("models--" + hub.repo_id.replace("/", "--"))
        self.what = "tokenizer" if tokenizer_only else "adapter" if adapter else "model"

    # -- online -------------------------------------------------------------------------

    def online(self) -> Resolved:
        try:
            info = HfApi(endpoint=self.endpoint, token=self.token).model_info(
                self.hub.repo_id, revision=self.revision, files_metadata=True)
        except GatedRepoError as exc:
            raise self._no_access(exc) from None
        except RevisionNotFoundError:
            raise ModelNotFoundError(
                f"{self.what} {self.hub}: the Hub has no revision {self.revision!r} "
                "(a branch, tag or commit)") from None
        except RepositoryNotFoundError:
            # The Hub answers 401 for a repo it will not name to an anonymous client, so
            # a typo and a private repo read alike: the message says both.
            raise ModelNotFoundError(
                f"{self.what} {self.hub!s} not found: no such local file or folder, and the "
                f"Hugging Face Hub has no repo {self.hub.repo_id!r} (or it is private: set "
                "HF_TOKEN or --hf-token)") from None
        except HfHubHTTPError as exc:
            if exc.response is not None and exc.response.status_code in (401, 403):
                raise self._no_access(exc) from None
            return self.from_cache(exc)
        except (httpx2.TransportError, OfflineModeIsEnabled) as exc:
            return self.from_cache(exc)
        listing = [RemoteFile(s.rfilename, s.lfs.size if s.lfs else s.size,
                              s.lfs.sha256 if s.lfs else s.blob_id) for s in info.siblings or ()]
        commit = str(info.sha)
        snapshot = self.storage / "snapshots" / commit

        def read_index(index: RemoteFile) -> Any:
            if not (snapshot / index.name).exists():
                self._hf_download(index.name, commit, force=False, quiet=True)
            self._verify(snapshot, index, commit, online=True)
            return _read_json(self.hub, snapshot / index.name)

        files = plan_files(self.hub, listing, tokenizer_only=self.tokenizer_only, adapter=self.adapter,
                           read_index=read_index)
        self._check_space(files)
        self._download(files, commit, snapshot)
        for f in files:
            self._verify(snapshot, f, commit, online=True)
        self._write_ref(commit)
        return self._result(snapshot, files, commit)

    def _no_access(self, exc: Exception) -> ModelAccessError:
        how = ("the token given was refused" if self.token or os.environ.get("HF_TOKEN")
               else "set HF_TOKEN or pass --hf-token")
        return ModelAccessError(
            f"{self.what} {self.hub}: the Hugging Face Hub refused access to {self.hub.repo_id!r} "
            f"(a gated or private repo: {how}; a gated repo's terms are accepted on its page)")

    def _check_space(self, files: list[RemoteFile]) -> None:
        missing = sum(f.size or 0 for f in files
                      if f.etag is None or not (self.storage / "blobs" / f.etag).is_file())
        if not missing:
            return
        free = self.free_bytes(self.cache_dir)
        if free < missing:
            raise ModelLoadError(
                f"{self.what} {self.hub}: {_size(missing)} to download and {self.cache_dir} has "
                f"{_size(free)} free; free some space or give another --download-dir")

    def _download(self, files: list[RemoteFile], commit: str, snapshot: Path) -> None:
        # config.json first: a config that asks for remote code is refused before the
        # weights are fetched. A bar per file on a terminal (huggingface_hub's own tqdm),
        # a log line per file otherwise, then one line for the whole.
        quiet = not sys.stderr.isatty()
        t0, fetched = time.monotonic(), 0
        for f in sorted(files, key=lambda f: f.name != "config.json"):
            pointer = snapshot / f.name
            if not pointer.exists():
                t1 = time.monotonic()
                self._hf_download(f.name, commit, force=False, quiet=quiet)
                size = f.size if f.size is not None else pointer.stat().st_size
                fetched += size
                if quiet:
                    logger.info("downloaded %s/%s (%s) in %.1f s", self.hub.repo_id, f.name,
                                _size(size), time.monotonic() - t1)
            if f.name == "config.json":
                self._refuse_remote_code(snapshot)
        if fetched:
            logger.info("downloaded %s of %s at %s in %.1f s into %s", _size(fetched),
                        self.hub, commit[:12], time.monotonic() - t0, self.storage)

    def _hf_download(self, filename: str, commit: str, *, force: bool, quiet: bool) -> None:
        try:
            hf_hub_download(self.hub.repo_id, filename, revision=commit,
                            cache_dir=self.cache_dir, token=self.token, endpoint=self.endpoint,
                            force_download=force, tqdm_class=_Silent if quiet else None)
        except GatedRepoError as exc:
            raise self._no_access(exc) from None
        except (HfHubHTTPError, httpx2.TransportError, OSError, ValueError) as exc:
            # OSError: huggingface_hub's size check of a transfer that ended short, or no
            # cached copy to fall back on; ValueError: a forced re-fetch that failed.
            raise ModelLoadError(f"{self.what} {self.hub}: downloading {filename} failed "
                                 f"({type(exc).__name__}: {exc})") from None

    def _refuse_remote_code(self, snapshot: Path) -> None:
        config = snapshot / "config.json"
        if self.tokenizer_only or self.adapter or not config.is_file():
            return
        data = _read_json(self.hub, config)
        if isinstance(data, dict) and data.get("auto_map"):
            raise UnsupportedModelError(
                f"{self.hub}: its config.json names auto_map (architecture code shipped in the "
                "repo, trust_remote_code): the engine never runs downloaded Python")

    def _write_ref(self, commit: str) -> None:
        if self.revision == commit:
            return
        ref = self.storage / "refs" / self.revision
        if ref.is_file() and ref.read_text().strip() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(commit)
        os.replace(tmp, ref)  # atomic: a concurrent reader sees the old or the new commit

    # -- cached -------------------------------------------------------------------------

    def from_cache(self, why: Exception | None) -> Resolved:
        """The cached snapshot of the revision; ``why`` is the reason the Hub was not
        asked (None: offline by choice)."""
        reason = ("HF_HUB_OFFLINE is set" if why is None
                  else f"the Hub could not be reached ({type(why).__name__}: {why})")
        commit = self.revision if _COMMIT.fullmatch(self.revision) else None
        ref = self.storage / "refs" / self.revision
        if commit is None and ref.is_file():
            commit = ref.read_text().strip()
        snapshot = self.storage / "snapshots" / (commit or "-")
        if commit is None or not snapshot.is_dir():
            raise ModelNotFoundError(
                f"{self.what} {self.hub} (revision {self.revision}) is not in the Hugging Face "
                f"cache {self.cache_dir} and {reason}")
        listing = [RemoteFile(p.relative_to(snapshot).as_posix())
                   for p in sorted(snapshot.rglob("*")) if p.is_file()]
        def read_index(index: RemoteFile) -> Any:
            self._verify(snapshot, index, commit, online=False)
            return _read_json(self.hub, snapshot / index.name)

        try:
            files = plan_files(self.hub, listing, tokenizer_only=self.tokenizer_only, adapter=self.adapter,
                               where=f" (cached at {snapshot})", read_index=read_index)
        except ModelLoadError as exc:
            raise type(exc)(f"{exc}; {reason}") from None
        self._refuse_remote_code(snapshot)
        for f in files:
            self._verify(snapshot, f, commit, online=False)
        logger.info("%s %s: from the cache at %s (%s)", self.what, self.hub, snapshot, reason)
        return self._result(snapshot, files, commit)

    def _result(self, snapshot: Path, files: list[RemoteFile], commit: str) -> Resolved:
        if not self.tokenizer_only and not self.adapter and len(files) == 1 and files[0].name.lower().endswith(".gguf"):
            return Resolved(snapshot / files[0].name, self.hub, commit)
        return Resolved(snapshot, self.hub, commit)

    # -- integrity ----------------------------------------------------------------------

    def _verify(self, snapshot: Path, f: RemoteFile, commit: str, *, online: bool) -> None:
        pointer = snapshot / f.name
        problem = self._problem(pointer, f)
        if problem is None:
            return
        if not online:
            raise CorruptModelError(
                f"{self.hub}: the cached {f.name} ({pointer}) {problem}; it is fetched again "
                "when the Hub can be reached (HF_HUB_OFFLINE unset)")
        logger.warning("%s: the cached %s %s: fetching it again", self.hub, f.name, problem)
        self._hf_download(f.name, commit, force=True, quiet=not sys.stderr.isatty())
        problem = self._problem(pointer, f)
        if problem is not None:
            raise CorruptModelError(f"{self.hub}: {f.name} as served by the Hub {problem}")

    def _problem(self, pointer: Path, f: RemoteFile) -> str | None:
        """Why the cached file cannot be trusted, or None. A blob already hashed and
        unchanged since (size and mtime as recorded) is trusted without reading it."""
        if not pointer.is_file():
            return "is missing"
        blob = Path(os.path.realpath(pointer))
        etag = f.etag or blob.name  # the blob's name is its ETag
        st = blob.stat()
        if f.size is not None and st.st_size != f.size:
            return f"has {st.st_size} bytes where the Hub lists {f.size}"
        record = self.record_dir / hashlib.sha1(str(blob).encode()).hexdigest()
        stamp = f"{etag} {st.st_size} {st.st_mtime_ns}"
        try:
            if record.read_text() == stamp:
                return None
        except OSError:
            pass
        digest = _digest(blob, etag)
        if digest is not None and digest != etag:
            return f"does not match its hash (expected {etag}, read {digest})"
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f"{record.name}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(stamp)
            os.replace(tmp, record)
        except OSError as exc:  # a read-only cache still serves, hashing again next time
            logger.debug("cannot record the check of %s: %s", blob, exc)
        return None


def _read_json(hub: HubName, path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(f"{hub}: cannot read {path}: {exc}") from None


def _digest(blob: Path, etag: str) -> str | None:
    """``blob``'s hash of the kind ``etag`` is (None: an ETag of no known kind)."""
    if re.fullmatch(r"[0-9a-f]{64}", etag):
        h = hashlib.sha256()
    elif re.fullmatch(r"[0-9a-f]{40}", etag):
        h = hashlib.sha1(b"blob %d\0" % blob.stat().st_size)  # git's blob id
    else:
        return None
    with open(blob, "rb") as fh:
        while chunk := fh.read(1 << 22):  # 4 MiB reads: few syscalls, little memory
            h.update(chunk)
    return h.hexdigest()


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


class _Silent(tqdm):
    """huggingface_hub's bar, never drawn (stderr is not a terminal: a log line instead)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
