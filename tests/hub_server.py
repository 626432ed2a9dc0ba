"""A fake Hugging Face Hub on 127.0.0.1 for the tests: ``huggingface_hub``'s real client
talks to it through ``HF_ENDPOINT`` (or ``endpoint=``).

It speaks the parts of the Hub's HTTP API that huggingface_hub 2.x calls to resolve and
fetch a model (read from its source: ``hf_api.py`` and ``file_download.py``):

* ``GET /api/models/{repo}[/revision/{rev}]``: ``model_info`` (``?blobs=true`` adds the
  sizes and hashes: ``siblings[].size``, ``blobId``, ``lfs.{sha256,size,pointerSize}``);
* ``GET /api/models/{repo}/tree/{rev}``: ``list_repo_tree`` (one page, recursive);
* ``HEAD`` and ``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (the git
  blob sha1) or, for an LFS file, ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``;
  ``Range: bytes=N-`` answers 206, as a resumed download asks;
* errors as the Hub sends them: 404 with ``X-Error-Code: RepoNotFound``,
  ``RevisionNotFound`` or ``EntryNotFound``; a gated repo's files answer 401
  ``GatedRepo`` without its token (its metadata stays public, as on the Hub).

No Xet headers are ever sent, so huggingface_hub downloads over plain HTTP. The server
counts every request (``requests``) and can drop a file's first transfer halfway
(``drop_once``) to exercise resuming.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

# What the Hub stores with git LFS (the rest are plain git blobs).
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclasses.dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)
    refs: dict[str, str] = dataclasses.field(default_factory=dict)
    token: str | None = None  # gated: files need this token


class FakeHub:
    """``with FakeHub() as hub: hub.add_folder("org/name", folder)``; ``hub.url``."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.drop_once: set[tuple[str, str]] = set()  # (repo, path): cut the first GET
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_commit(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main",
                   token: str | None = None) -> str:
        """Add a commit holding ``files`` to ``repo_id`` and point ``branch`` at it."""
        digest = hashlib.sha1(repr((repo_id, sorted(files.items()))).encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[digest] = dict(files)
        repo.refs[branch] = digest
        if token is not None:
            repo.token = token
        return digest

    def add_folder(self, repo_id: str, folder: Path, **kwargs: Any) -> str:
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add_commit(repo_id, files, **kwargs)

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def _log(self, line: str) -> None:
        with self._lock:
            self.requests.append(line)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet: the tests read hub.requests
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    def _route(self, *, body: bool) -> None:
        rng = self.headers.get("Range")
        self.fake._log(f"{self.command} {self.path}" + (f" Range={rng}" if rng else ""))
        path = unquote(urlsplit(self.path).path)
        if m := re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(?:/.*)?", path):
            self._tree(m[1], m[2])
        elif m := re.fullmatch(r"/api/models/(.+?)(?:/revision/(.+))?", path):
            self._info(m[1], m[2] or "main")
        elif m := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
            self._file(m[1], m[2], m[3], body=body)
        else:
            self._error(404, "RepoNotFound", "no such route")

    # -- helpers ----------------------------------------------------------------------

    def _commit(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        sha = repo.refs.get(rev, rev)
        if sha not in repo.commits:
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return None
        return repo, sha

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _json(self, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    @staticmethod
    def _entry(name: str, data: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {"size": len(data), "blobId": git_blob_id(data)}
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
        return entry

    # -- routes -----------------------------------------------------------------------

    def _info(self, repo_id: str, rev: str) -> None:
        found = self._commit(repo_id, rev)
        if found is None:
            return
        repo, sha = found
        files = repo.commits[sha]
        self._json({
            "id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
            "gated": "manual" if repo.token else False, "disabled": False,
            "siblings": [{"rfilename": n, **self._entry(n, d)} for n, d in sorted(files.items())],
        })

    def _tree(self, repo_id: str, rev: str) -> None:
        found = self._commit(repo_id, rev)
        if found is None:
            return
        repo, sha = found
        out = []
        for name, data in sorted(repo.commits[sha].items()):
            entry = self._entry(name, data)
            item = {"type": "file", "oid": entry["blobId"], "size": len(data), "path": name}
            if "lfs" in entry:
                item["lfs"] = {"oid": entry["lfs"]["sha256"], "size": len(data), "pointerSize": 134}
            out.append(item)
        self._json(out)

    def _file(self, repo_id: str, rev: str, name: str, *, body: bool) -> None:
        found = self._commit(repo_id, rev)
        if found is None:
            return
        repo, sha = found
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(401, "GatedRepo", "Access to this gated repo is restricted")
            return
        data = repo.commits[sha].get(name)
        if data is None:
            self._error(404, "EntryNotFound", "Entry not found")
            return
        entry = self._entry(name, data)
        start = 0
        if m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
            start = int(m[1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", sha)
        if "lfs" in entry:
            self.send_header("X-Linked-Etag", f'"{entry["lfs"]["sha256"]}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("ETag", f'"{entry["lfs"]["sha256"]}"')
        else:
            self.send_header("ETag", f'"{entry["blobId"]}"')
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if not body:
            return
        key = (repo_id, name)
        if not start and key in self.fake.drop_once:
            self.fake.drop_once.discard(key)
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True  # the client sees the body end short
            return
        self.wfile.write(data[start:])
