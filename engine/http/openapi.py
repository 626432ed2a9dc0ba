"""``GET /openapi.json``: the OpenAPI 3.1 document of the server's routes, built from the
request bodies' JSON Schema in :mod:`engine.http.schema` (the same dictionaries that check
each body), with each route's answer and error codes."""

from __future__ import annotations

from typing import Any

from engine.http.schema import (
    CHAT,
    CLASSIFY,
    COMPLETION,
    DETOKENIZE,
    EMBEDDINGS,
    POOLING,
    RERANK,
    RESPONSES,
    SCORE,
    TOKENIZE,
)

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                             "properties": {"message": {"type": "string"},
                                            "type": {"type": "string"},
                                            "param": {"type": ["string", "null"]},
                                            "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {
    "400": "invalid parameter, malformed JSON, or prompt + max_tokens over the context",
    "401": "missing or wrong API key (when the server has one)",
    "404": "unknown model",
    "413": "body over --max-request-bytes",
    "429": "waiting queue full; retry after the Retry-After header",
    "431": "too many or too large headers",
    "500": "this request failed inside the engine (code request_failed)",
    "503": "the engine is restarting after a crash, or dead",
}
_COMPLETION_RESPONSE = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                   "created": {"type": "integer"}, "model": {"type": "string"},
                   "choices": {"type": "array", "items": {"type": "object"}},
                   "usage": {"type": ["object", "null"]}},
}


_RESPONSE = {
    "type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                   "status": {"type": "string"}, "output": {"type": "array"}},
}


def _stored_route(method: str, summary: str, ok: dict[str, Any], api_key: bool, *,
                  query: tuple[tuple[str, dict[str, Any]], ...] = ()) -> dict[str, Any]:
    """A route on one stored response: 404 when the id is not (or no longer) stored."""
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    responses = {"200": _json(ok), "404": {"description": "no such stored response", **error},
                 "400": {"description": "an unsupported or invalid query parameter", **error}}
    if api_key:
        responses["401"] = {"description": _ERRORS["401"], **error}
    parameters = [{"name": "response_id", "in": "path", "required": True,
                   "schema": {"type": "string"}},
                  *({"name": name, "in": "query", "required": False, "schema": schema}
                    for name, schema in query)]
    return {method: {"summary": summary, "parameters": parameters, "responses": responses}}


# The speech routes' form (engine.http.audio): the clip and the fields OpenAI's client sends.
_SPEECH = {"type": "object", "required": ["file"], "properties": {
    "file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
    "language": {"type": "string"}, "prompt": {"type": "string"},
    "response_format": {"enum": ["json", "text", "verbose_json", "srt", "vtt"]},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "stream": {"type": "boolean"},
    "timestamp_granularities[]": {"type": "array", "items": {"enum": ["segment"]}}}}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: {"description": _ERRORS[code], "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for code in codes}


def _post(summary: str, schema_name: str, ok: dict[str, Any], *codes: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema_name}"}}}},
        "responses": {"200": ok, **_errors(*codes)},
    }}


def _get(summary: str, ok: dict[str, Any], *codes: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*codes)}}}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _json_or_bytes(schema: dict[str, Any]) -> dict[str, Any]:
    """A pooling answer: JSON, or with encoding_format bytes / bytes_only the values as
    the body (a metadata header for bytes)."""
    ok = _json(schema, "OK: JSON, or the values themselves with encoding_format bytes")
    ok["content"]["application/octet-stream"] = {"schema": {"type": "string",
                                                            "format": "binary"}}
    return ok


def openapi(version: str, *, api_key: bool, tokenizer_info: bool = False) -> dict[str, Any]:
    """The server's OpenAPI 3.1 document (``GET /openapi.json``); ``tokenizer_info``: the
    server has ``GET /tokenizer_info`` (--enable-tokenizer-info-endpoint)."""
    generation = {"description": "the completion, or with stream: true server-sent events "
                  "(data: {chunk} ... data: [DONE])",
                  "content": {"application/json": {"schema": {
                      "$ref": "#/components/schemas/CompletionResponse"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    gen_errors = ("400", "404", "413", "429", "431", "500", "503")
    if api_key:
        gen_errors = ("401", *gen_errors)
    paths = {
        "/v1/completions": _post("Text completion", "CompletionRequest", generation, *gen_errors),
        "/v1/chat/completions": _post("Chat completion", "ChatCompletionRequest", generation,
                                      *gen_errors),
        "/v1/responses": _post("Create a response (OpenAI's Responses API, over the chat "
                               "path)", "ResponsesRequest", {
            "description": "the response object, or with stream: true typed server-sent "
                           "events (event: response.created ... response.completed)",
            "content": {"application/json": {"schema": _RESPONSE},
                        "text/event-stream": {"schema": {"type": "string"}}}}, *gen_errors),
        "/v1/responses/{response_id}": {
            **_stored_route("get", "A stored response", _RESPONSE, api_key),
            **_stored_route("delete", "Forget a stored response", {
                "type": "object", "required": ["id", "deleted"]}, api_key),
        },
        "/v1/responses/{response_id}/input_items": _stored_route(
            "get", "A stored response's input items", {
                "type": "object", "required": ["object", "data", "has_more"]}, api_key,
            query=(("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                   ("order", {"enum": ["asc", "desc"]}), ("after", {"type": "string"}))),
        "/v1/responses/{response_id}/cancel": _stored_route(
            "post", "Cancel a background response: this server runs none, so a stored "
            "response is a 400 (it is complete)", _RESPONSE, api_key),
        "/tokenize": _post("Token ids of a prompt or chat", "TokenizeRequest", _json({
            "type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
                "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                "tokens": {"type": "array", "items": {"type": "integer"}},
                "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}}),
            *(c for c in gen_errors if c not in ("429", "500", "503"))),
        "/detokenize": _post("Text of token ids", "DetokenizeRequest", _json({
            "type": "object", "required": ["prompt"], "properties": {
                "prompt": {"type": "string"}}}),
            *(c for c in gen_errors if c not in ("429", "500", "503"))),
        "/v1/embeddings": _post("Embeddings (pooling models)", "EmbeddingRequest", _json_or_bytes({
            "type": "object", "required": ["object", "data", "model", "usage"], "properties": {
                "object": {"const": "list"}, "model": {"type": "string"},
                "usage": {"type": "object"},
                "data": {"type": "array", "items": {
                    "type": "object", "required": ["object", "index", "embedding"]}}}}),
            *gen_errors),
        "/v1/score": _post("Scores of text pairs (embedding or cross-encoder models)",
                           "ScoreRequest", _json({
                               "type": "object", "required": ["object", "data", "model"],
                               "properties": {"data": {"type": "array", "items": {
                                   "type": "object", "required": ["index", "score"]}}}}),
                           *gen_errors),
        "/v1/rerank": _post("Documents ranked by relevance to a query", "RerankRequest", _json({
            "type": "object", "required": ["results", "model"], "properties": {
                "results": {"type": "array", "items": {
                    "type": "object", "required": ["index", "relevance_score"]}}}}),
            *gen_errors),
        "/classify": _post("Class probabilities of each input (classification models)",
                           "ClassificationRequest", _json({
                               "type": "object", "required": ["object", "data", "model", "usage"],
                               "properties": {"data": {"type": "array", "items": {
                                   "type": "object",
                                   "required": ["index", "label", "probs", "num_classes"]}}}}),
                           *gen_errors),
        "/pooling": _post("vLLM's generic pooling: embeddings, class probabilities or every "
                          "token's hidden state (pooling models)", "PoolingRequest", _json_or_bytes({
                              "type": "object", "required": ["object", "data", "model", "usage"],
                              "properties": {"data": {"type": "array", "items": {
                                  "type": "object", "required": ["index", "object", "data"]}}}}),
                          *gen_errors),
        "/v1/models": _get("The served model", _json({
            "type": "object", "required": ["object", "data"], "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": {
                    "type": "object", "required": ["id", "object"]}}}}),
            *(("401",) if api_key else ())),
        "/health": _get("200 while serving", _json({"type": "object"}), "503"),
        "/version": _get("Server version", _json({
            "type": "object", "required": ["version"],
            "properties": {"version": {"type": "string"}}})),
        "/metrics": _get("Prometheus metrics", {"description": "OK", "content": {
            "text/plain": {"schema": {"type": "string"}}}}),
        "/openapi.json": _get("This document", _json({"type": "object"})),
    }
    for path, summary in (("/v1/audio/transcriptions", "Transcribe a clip (Whisper)"),
                          ("/v1/audio/translations", "Translate a clip into English (Whisper)")):
        paths[path] = {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _SPEECH}}},
            "responses": {"200": {"description": "the text: JSON (json, verbose_json), plain text "
                                  "(text, srt, vtt), or with stream true server-sent events",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/plain": {"schema": {"type": "string"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **_errors(*gen_errors)}}}
    if tokenizer_info:
        paths["/tokenizer_info"] = _get("The tokenizer's configuration and chat template",
                                        _json({"type": "object"}), *(("401",) if api_key else ()))
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "engine: OpenAI-compatible LLM server", "version": version},
        "paths": paths,
        "components": {"schemas": {
            "CompletionRequest": COMPLETION, "ChatCompletionRequest": CHAT,
            "TokenizeRequest": TOKENIZE, "DetokenizeRequest": DETOKENIZE,
            "EmbeddingRequest": EMBEDDINGS, "ScoreRequest": SCORE, "RerankRequest": RERANK,
            "ClassificationRequest": CLASSIFY, "PoolingRequest": POOLING,
            "CompletionResponse": _COMPLETION_RESPONSE, "Error": _ERROR,
            "ResponsesRequest": RESPONSES,
        }},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                 "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
