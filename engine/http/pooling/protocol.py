"""The pooling routes' bodies: ``/v1/embeddings`` (OpenAI), ``/v1/score``, ``/v1/rerank``,
``/classify`` and ``/pooling`` (vLLM's; the rerank body and answer are Jina's and Cohere's).
Pure: parse a checked body into the engine call's arguments, and build the answer from its
results.

Fields that would change an answer and that a route does not honour are refused with a
400 naming them, never ignored (a score's ``normalize``, ``dimensions`` on ``/classify``, ...).
"""

from __future__ import annotations

import base64
import dataclasses
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from engine.core.pooling import Pooled
from engine.http.completions.answer import now
from engine.http.errors import APIError

# vLLM's embed_dtype and endianness: how base64 writes each value (the floats of the
# "float" format are float32 values, whatever they say, as in vLLM).
EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ENDIANNESS = ("native", "big", "little")
# vLLM's pooling tasks, and those /pooling runs here (the others are a 400 naming task).
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify", "score", "plugin")
POOLING_TASKS_BUILT = ("embed", "classify", "token_embed", "token_classify")

# vLLM's extras that change what comes back, refused where a route does not honour them.
_REFUSED = ("softmax", "activation", "mm_processor_kwargs", "instruction")
_ENCODING = ("encoding_format", "embed_dtype", "endianness")
_REFUSED_BY_ROUTE = {
    "embeddings": (*_REFUSED, "use_activation"),
    # An embeddings field on /classify would be silently meaningless: refused by name.
    "classify": (*_REFUSED, *_ENCODING, "dimensions", "normalize"),
    "score": (*_REFUSED, *_ENCODING, "use_activation", "normalize", "add_special_tokens"),
    "pooling": _REFUSED,
}
# On /pooling, the fields each task does not read (vLLM's PoolingParams refuses them too).
_REFUSED_BY_TASK = {
    "embed": ("use_activation",),
    "token_embed": ("use_activation", "dimensions"),
    "classify": ("dimensions", "normalize"),
    "token_classify": ("dimensions", "normalize"),
}
# The tasks a model runs, by its pooler's task; the first is /pooling's default (vLLM's
# per-token one where the model has it).
_MODEL_TASKS = {"embed": ("token_embed", "embed"), "classify": ("classify",),
                "token_classify": ("token_classify",)}


@dataclasses.dataclass(frozen=True, slots=True)
class Encoding:
    """How a route writes its vectors: ``float`` (JSON numbers) or ``base64`` (of each
    value as ``embed_dtype`` in ``endianness`` byte order)."""

    format: str = "float"
    embed_dtype: str = "float32"
    endianness: str = "native"


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str | None
    input: Any  # str, token ids, or a list of either (checked by the schema and the engine)
    dimensions: int | None
    truncate_prompt_tokens: int | None
    priority: int
    normalize: bool | None = None  # None: as the model's pipeline does
    add_special_tokens: bool = True
    encoding: Encoding = Encoding()
    use_activation: bool = True  # /pooling's, for task classify


@dataclasses.dataclass(frozen=True, slots=True)
class ClassifyRequest:
    model: str | None
    input: Any  # as EmbeddingRequest's
    truncate_prompt_tokens: int | None
    priority: int
    use_activation: bool
    add_special_tokens: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ScoreRequest:
    model: str | None
    first: str | list[str]
    second: str | list[str]
    truncate_prompt_tokens: int | None
    priority: int
    # rerank: how many of the best to return (None: all), and whether with their text
    top_n: int | None = None
    return_documents: bool = True


def _refuse_unsupported(body: dict[str, Any], route: str = "score") -> None:
    for name in _REFUSED_BY_ROUTE[route]:
        if body.get(name) is not None:
            raise APIError(400, f"{name} is not supported on this route", param=name,
                           code="unsupported_parameter")
    if body.get("truncation_side") not in (None, "left"):
        # vLLM's generation field: the pooling routes truncate from the left only.
        raise APIError(400, 'truncation_side: the pooling routes keep the last '
                       'truncate_prompt_tokens tokens ("left") only', param="truncation_side",
                       code="unsupported_parameter")


def parse_embedding(body: dict[str, Any], route: str = "embeddings") -> EmbeddingRequest:
    """``input``, or vLLM's ``messages`` (``input`` None: the route renders them, and
    ``add_special_tokens`` defaults to false, as the template writes the model's markers).
    Also /pooling's body, which adds ``task`` and ``use_activation``."""
    _refuse_unsupported(body, route)
    chat = body.get("messages") is not None
    if chat and body.get("input") is not None:
        raise APIError(400, "send `input` or `messages`, not both", param="messages",
                       code="invalid_value")
    if not chat and body.get("input") is None:
        raise APIError(400, "`input` is required (or chat `messages`)", param="input",
                       code="missing_required_parameter")
    return EmbeddingRequest(
        model=body.get("model"),
        input=None if chat else body["input"],
        dimensions=body.get("dimensions"),
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        priority=body.get("priority") or 0,
        normalize=body.get("normalize"),
        add_special_tokens=(body.get("add_special_tokens") is True if chat
                            else body.get("add_special_tokens") is not False),
        encoding=Encoding(body.get("encoding_format") or "float",
                          body.get("embed_dtype") or "float32", body.get("endianness") or "native"),
        use_activation=body.get("use_activation") is not False,
    )


def pooling_task(body: dict[str, Any], model_task: str) -> str:
    """The task a /pooling body runs on a model whose pooler does ``model_task``
    (``embed``, ``classify``, ``token_classify``): its ``task``, or as vLLM picks one, the
    model's per-token task (``token_embed`` for an embedding model, ``token_classify`` for
    a token classifier; a sequence classifier has none: a 400). A task not built here or
    not this model's, or a field the task does not read, is a 400 naming it."""
    runs = _MODEL_TASKS[model_task]
    task = body.get("task")
    if task is None:
        if not runs[0].startswith("token_"):
            raise APIError(400, "give a task: a sequence classifier has no per-token task "
                           "(vLLM's default); task 'classify' gives each input's class "
                           "probabilities", param="task", code="invalid_value")
        task = runs[0]
    if task not in POOLING_TASKS_BUILT:
        raise APIError(400, f"task {task!r} is not supported; this server runs "
                       f"{', '.join(POOLING_TASKS_BUILT)}", param="task",
                       code="unsupported_parameter")
    if task not in runs:
        raise APIError(400, f"task {task!r} is not this model's; it runs "
                       f"{', '.join(runs)}", param="task", code="invalid_value")
    for name in _REFUSED_BY_TASK[task]:
        if body.get(name) is not None:
            raise APIError(400, f"{name} does not apply to task {task!r}", param=name,
                           code="unsupported_parameter")
    return task


def parse_classify(body: dict[str, Any]) -> ClassifyRequest:
    _refuse_unsupported(body, "classify")
    return ClassifyRequest(
        model=body.get("model"), input=body["input"],
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        priority=body.get("priority") or 0,
        use_activation=body.get("use_activation") is not False,
        add_special_tokens=body.get("add_special_tokens") is not False,
    )


def parse_score(body: dict[str, Any]) -> ScoreRequest:
    _refuse_unsupported(body)
    return ScoreRequest(
        model=body.get("model"), first=body["text_1"], second=body["text_2"],
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        priority=body.get("priority") or 0,
    )


def parse_rerank(body: dict[str, Any]) -> ScoreRequest:
    _refuse_unsupported(body)
    documents = body["documents"]
    # Cohere's documents may be objects with a text field; Jina's are strings.
    texts = [d["text"] if isinstance(d, dict) else d for d in documents]
    return ScoreRequest(
        model=body.get("model"), first=body["query"], second=texts,
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        priority=body.get("priority") or 0, top_n=body.get("top_n"),
        return_documents=body.get("return_documents", True) is not False,
    )


def encode_base64(data: bytes, encoding: Encoding) -> str:
    """A vector's base64 (``data``: little-endian float32, as the runner writes it) of
    :func:`encode_values`' bytes."""
    return base64.b64encode(encode_values(data, encoding)).decode("ascii")


def encode_values(data: bytes, encoding: Encoding) -> bytes:
    """A vector's bytes (``data``: little-endian float32) with vLLM's ``embed_dtype`` and
    ``endianness``: each value cast as torch casts it (round to nearest even; fp8
    saturates nothing, as torch's cast), its bytes in that order ("native": this
    server's). float32 little-endian is ``data`` as it is."""
    order = sys.byteorder if encoding.endianness == "native" else encoding.endianness
    if encoding.embed_dtype == "float32" and order == "little":
        return data
    import torch

    dtype, view = {"float32": (torch.float32, torch.int32), "float16": (torch.float16, torch.int16),
                   "bfloat16": (torch.bfloat16, torch.int16),
                   "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
                   "fp8_e5m2": (torch.float8_e5m2, torch.uint8)}[encoding.embed_dtype]
    values = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
    raw = values.to(dtype).view(view).numpy()  # this machine's byte order
    if raw.itemsize > 1 and order != sys.byteorder:
        raw = raw.byteswap()
    return raw.tobytes()


def binary_response(prefix: str, model: str, pooled: Sequence[Pooled], per_token: bool,
                    encoding: Encoding) -> tuple[bytes, dict[str, str]]:
    """vLLM's ``encoding_format`` ``"bytes"`` / ``"bytes_only"``: every input's values one
    after another as :func:`encode_values` writes them (the body), and, for ``bytes``, a
    ``metadata`` header (JSON: ``id``, ``created``, ``model``, ``data`` with each input's
    ``index``, ``embed_dtype``, ``endianness``, ``start`` and ``end`` bytes and ``shape``,
    and ``usage``)."""
    body, items, offset = [], [], 0
    for i, p in enumerate(pooled):
        raw = encode_values(p.data, encoding)
        shape = list(p.matrix().shape) if per_token else [len(p.data) // 4]
        items.append({"index": i, "embed_dtype": encoding.embed_dtype,
                      "endianness": encoding.endianness, "start": offset,
                      "end": offset + len(raw), "shape": shape})
        body.append(raw)
        offset += len(raw)
    if encoding.format == "bytes_only":
        return b"".join(body), {}
    tokens = sum(p.prompt_tokens for p in pooled)
    metadata = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": now(), "model": model,
                "data": items, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return b"".join(body), {"metadata": orjson.dumps(metadata).decode()}


def pooling_response(model: str, pooled: Sequence[Pooled], task: str,
                     encoding: Encoding) -> bytes:
    """vLLM's /pooling answer: each input's ``data``, a vector (an embedding, or a
    classifier's probabilities as float32) or a row a token (``token_embed``,
    ``token_classify``), as floats or as the base64 of the values one after another."""
    data = []
    for i, p in enumerate(pooled):
        out: Any
        if encoding.format == "base64":
            out = encode_base64(p.data, encoding)
        else:
            out = (p.matrix() if task.startswith("token_") else p.vector()).astype(np.float64)
        data.append({"index": i, "object": "pooling", "data": out})
    return _list_json("pool", model, data, pooled)


def _list_json(prefix: str, model: str, data: list[dict[str, Any]],
               pooled: Sequence[Pooled]) -> bytes:
    """A pooling answer's list body as JSON bytes (orjson, numpy arrays written as
    they are), with its inputs' tokens as the usage."""
    tokens = sum(p.prompt_tokens for p in pooled)
    return orjson.dumps(
        {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": now(),
         "model": model, "data": data,
         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
        option=orjson.OPT_SERIALIZE_NUMPY)


def embedding_response(model: str, pooled: Sequence[Pooled], encoding: Encoding) -> bytes:
    """OpenAI's answer as JSON bytes: one ``embedding`` per input, in order, as floats or
    as the base64 of their little-endian float32 bytes (what the openai client decodes).

    The floats are written by orjson straight from a float64 copy of each vector: the
    standard library's ``json`` on a Python float list took 0.9 ms a 384-float vector
    (``tolist`` and ``dumps``), about a quarter of a core at 300 sentences/s, and orjson
    from numpy a twentieth of that. The float64 copy keeps the text what ``json`` wrote:
    the shortest repr of each float32 value widened to a double, so a client reading the
    floats gets the same numbers as one decoding the base64. A non-finite value (none
    comes from a normalised embedding) is ``null``, as :func:`engine.http.sse.dumps` made
    it."""
    data = [
        {"object": "embedding", "index": i,
         "embedding": (encode_base64(p.data, encoding) if encoding.format == "base64"
                       else p.vector().astype(np.float64))}
        for i, p in enumerate(pooled)
    ]
    return _list_json("embd", model, data, pooled)


def classify_response(model: str, labels: Sequence[str],
                      results: Sequence[tuple[list[float], int]]) -> dict[str, Any]:
    """vLLM's classification answer: each input's probabilities (or logits), its most
    likely label (the first of a tie) and the number of classes."""
    tokens = sum(n for _, n in results)
    data = [{"index": i, "label": labels[int(np.argmax(probs))], "probs": probs,
             "num_classes": len(probs)} for i, (probs, _) in enumerate(results)]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": now(),
            "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def score_response(model: str, scores: Sequence[tuple[float, int]]) -> dict[str, Any]:
    tokens = sum(n for _, n in scores)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": now(),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, (s, _) in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank_response(model: str, req: ScoreRequest, scores: Sequence[tuple[float, int]]) -> dict[str, Any]:
    """The documents by falling relevance (ties keep their order), the best ``top_n``."""
    assert isinstance(req.second, list)
    order = sorted(range(len(scores)), key=lambda i: -scores[i][0])
    if req.top_n is not None:
        order = order[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i][0]}
        if req.return_documents:
            result["document"] = {"text": req.second[i]}
        results.append(result)
    tokens = sum(n for _, n in scores)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
