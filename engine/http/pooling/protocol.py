"""The pooling routes' bodies: ``/v1/embeddings`` (OpenAI), ``/v1/score``, ``/v1/rerank``
and ``/classify`` (vLLM's; the rerank body and answer are Jina's and Cohere's). Pure: parse
a checked body into the engine call's arguments, and build the answer from its results.

Fields that would change an answer and that a route does not honour are refused with a
400 naming them, never ignored (vLLM's ``embed_dtype``, a score's ``normalize``, ...).
"""

from __future__ import annotations

import base64
import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from engine.core.pooling import Pooled
from engine.http.completions.answer import now
from engine.http.errors import APIError

ENCODING_FORMATS = ("float", "base64")

# vLLM's extras that change what comes back, refused where a route does not honour them.
_REFUSED = ("embed_dtype", "endianness", "softmax", "activation", "mm_processor_kwargs",
            "instruction")
_REFUSED_BY_ROUTE = {
    "embeddings": (*_REFUSED, "use_activation"),
    # An embeddings field on /classify would be silently meaningless: refused by name.
    "classify": (*_REFUSED, "encoding_format", "dimensions", "normalize"),
    "score": (*_REFUSED, "use_activation", "normalize", "add_special_tokens"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str | None
    input: Any  # str, token ids, or a list of either (checked by the schema and the engine)
    encoding_format: str
    dimensions: int | None
    truncate_prompt_tokens: int | None
    priority: int
    normalize: bool | None = None  # None: as the model's pipeline does
    add_special_tokens: bool = True


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


def parse_embedding(body: dict[str, Any]) -> EmbeddingRequest:
    """``input``, or vLLM's ``messages`` (``input`` None: the route renders them, and
    ``add_special_tokens`` defaults to false, as the template writes the model's markers)."""
    _refuse_unsupported(body, "embeddings")
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
        encoding_format=body.get("encoding_format") or "float",
        dimensions=body.get("dimensions"),
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        priority=body.get("priority") or 0,
        normalize=body.get("normalize"),
        add_special_tokens=(body.get("add_special_tokens") is True if chat
                            else body.get("add_special_tokens") is not False),
    )


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


def embedding_response(model: str, pooled: Sequence[Pooled], encoding_format: str) -> bytes:
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
         "embedding": (base64.b64encode(p.data).decode("ascii") if encoding_format == "base64"
                       else p.vector().astype(np.float64))}
        for i, p in enumerate(pooled)
    ]
    tokens = sum(p.prompt_tokens for p in pooled)
    return orjson.dumps(
        {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": now(),
         "model": model, "data": data,
         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
        option=orjson.OPT_SERIALIZE_NUMPY)


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
