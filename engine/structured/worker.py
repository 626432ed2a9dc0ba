"""A grammar-compile worker process: ``python -m engine.structured.worker``.

:class:`engine.structured.pool.CompilePool` starts these and talks to each over its stdin
and stdout in frames (a 4-byte big-endian length, then msgpack):

* first the pool sends the tokenizer (:meth:`GrammarBackend.worker_payload`); the worker
  builds its own :class:`GrammarBackend` from it and answers ``{"ready": true}``;
* then one compile at a time: ``{"kind", "text", "think"}`` (a spec's key) is answered
  ``{"backend", "data", "seconds"}`` (xgrammar's grammar serialized as JSON, or
  llguidance's grammar text), ``{"error", "param"}`` for a constraint no backend takes or
  past the size budget, or ``{"fault"}`` for anything else.

A compile runs here, not in the server, so that it can be killed: past its time budget,
when its client leaves, or when the server stops. The worker exits by itself when its
stdin closes or its parent dies (a watchdog thread: a C++ compile never reads stdin).
A fresh interpreter, not a fork of the server (which runs threads) nor multiprocessing's
spawn (which re-imports the embedding program's main module).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
import types
from typing import Any, BinaryIO

import msgpack
from tokenizers import Tokenizer

# No lazy import would make the worker start faster: ``-m`` imports the engine.structured
# package (its backend, and torch under it) before this module runs.
from engine.errors import InvalidParamError
from engine.structured.backend import GrammarBackend
from engine.structured.spec import StructuredOutputs

_HEADER = struct.Struct(">I")


def read_frame(stream: BinaryIO) -> Any:
    """The next frame from ``stream``, or None at its end."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return msgpack.unpackb(body)


def frame(value: Any) -> bytes:
    body = msgpack.packb(value)
    return _HEADER.pack(len(body)) + body


def spec_from_key(kind: str, text: str, think: str) -> StructuredOutputs:
    """The :class:`StructuredOutputs` whose ``key`` is ``(kind, text, think)``, built
    without its checks: the server ran them before sending it."""
    fields: dict[str, Any] = {f: None for f in StructuredOutputs.__dataclass_fields__}
    fields.update(json_object=False, think=think or None)
    if kind == "json_object":
        fields["json_object"] = True
    elif kind == "choice":
        fields["choice"] = tuple(json.loads(text))
    else:
        fields[kind] = text
    spec = object.__new__(StructuredOutputs)
    for name, value in fields.items():
        object.__setattr__(spec, name, value)
    return spec


def compile_one(backend: GrammarBackend, request: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    try:
        spec = spec_from_key(request["kind"], request["text"], request["think"])
        compiled = backend.compile_uncached(spec)
        if compiled.backend == "xgrammar":
            data = compiled.handle.serialize_json()
            # In memory here, and as the JSON that crosses to the server and is read back.
            size = max(int(compiled.handle.memory_size_bytes), len(data))
        else:
            data = compiled.handle
            size = len(data)
    except InvalidParamError as exc:
        return {"error": exc.message, "param": exc.param}
    except Exception as exc:  # a fault of the library, reported to the server's log
        return {"fault": f"{type(exc).__name__}: {exc}"[:2000]}
    if size > max_bytes:
        return {"error": f"the {spec.kind} constraint compiles to a grammar of {size} bytes; "
                         f"the limit is {max_bytes} (--grammar-max-bytes)",
                "param": "structured_outputs"}
    return {"backend": compiled.backend, "data": data, "seconds": compiled.seconds}


def _watch_parent(parent: int) -> None:
    # Reparenting means the server died: a compile deep in C++ would otherwise run on.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main() -> None:
    stdin = sys.stdin.buffer
    # The protocol owns file descriptor 1; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    init = read_frame(stdin)
    if init is None:
        return
    tokenizer = types.SimpleNamespace(
        backend_tokenizer=Tokenizer.from_str(init["tokenizer"]),
        skipped_special_ids=frozenset(init["skipped_special_ids"]))
    backend = GrammarBackend(tokenizer, vocab_size=init["vocab_size"],
                             stop_token_ids=tuple(init["stop_token_ids"]),
                             backend=init["backend"], cache_size=1)
    out.write(frame({"ready": True}))
    out.flush()
    while (request := read_frame(stdin)) is not None:
        out.write(frame(compile_one(backend, request, init["max_bytes"])))
        out.flush()


if __name__ == "__main__":
    main()
