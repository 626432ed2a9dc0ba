"""The request bodies as JSON Schema: what each body is checked against, and what
``GET /openapi.json`` publishes, from one set of definitions.

Every field's type and range is written once here (the ranges come from
:mod:`engine.params`, which checks them again in the engine); :func:`check_body` validates
a body (compiled by ``jsonschema-rs`` for the common valid body; the ``jsonschema`` library
judges and words the rest) before the family's parser (such as
:mod:`engine.http.completions.protocol`) turns it into engine parameters, and
:mod:`engine.http.openapi` builds the OpenAPI 3.1 document from the same dictionaries. Checks that
need the model (token ids below the vocabulary size, ``top_k`` up to it, lengths within
the context) happen at admission and are described here in words. ``null`` means
"absent" for every optional field, as OpenAI's clients send it. Unknown fields are allowed
(logged and ignored).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import jsonschema_rs

from engine import params as P
from engine.http.errors import APIError

_INT64 = (-(2**63), 2**63 - 1)
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": P._MAX_TOKEN_ID,
             "description": "a token id, below the model's vocabulary size"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _number(lo: float, hi: float, description: str, *, lo_open: bool = False) -> dict[str, Any]:
    bound = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    return _nullable({"type": "number", **bound, "maximum": hi, "description": description})


def _integer(lo: int | None, hi: int | None, description: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "description": description}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return _nullable(schema)


_BOOL = _nullable({"type": "boolean"})


def _spelled(word: str) -> str:
    """``word`` as a regex of any letter case (no inline flags: OpenAPI's regexes are
    ECMA-262's)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in word)


# The completions, chat and tokenize routes read a boolean as vLLM's pydantic models do
# (engine.chat.request.lax_bool): the words below in any case, 0 and 1.
_LAX_BOOL = _nullable({"anyOf": [
    {"type": "boolean"}, {"enum": [0, 1]},
    {"type": "string", "pattern": "^(" + "|".join(
        _spelled(w) for w in ("true", "false", "yes", "no", "on", "off", "t", "f", "y", "n",
                              "1", "0")) + ")$"},
], "description": "a boolean; also \"true\"/\"false\", \"yes\"/\"no\", \"on\"/\"off\", "
                  "\"t\"/\"f\", \"y\"/\"n\" in any case, and 0/1 (as vLLM reads it)"})
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": P.MAX_STOP_STRING_CHARS}

COMMON: dict[str, Any] = {
    "model": _nullable({"type": "string", "description": "the served model name"}),
    "max_tokens": _integer(1, None, "tokens to generate at most; prompt + max_tokens must "
                           "fit the context (completions default 16, chat: the context)"),
    "min_tokens": _integer(0, None, "tokens before EOS, stop tokens or stop strings may end "
                           "the output; at most max_tokens"),
    "temperature": _number(0.0, 100.0, "0 is greedy"),
    "top_p": _number(0.0, 1.0, "nucleus mass; 1 is off", lo_open=True),
    "top_k": _integer(-1, P._MAX_TOKEN_ID, "-1 or 0: off; at most the vocabulary size"),
    "min_p": _number(0.0, 1.0, "0 is off"),
    "n": _integer(1, 128, "samples per prompt"),
    "seed": _integer(*_INT64, "a signed 64-bit seed: the same seed, the same tokens"),
    "stop": _nullable({"anyOf": [
        _STOP_STRING,
        {"type": "array", "items": _STOP_STRING, "maxItems": P.MAX_STOP_STRINGS},
    ]}),
    "stop_token_ids": _nullable({"type": "array", "items": _TOKEN_ID}),
    "presence_penalty": _number(-2.0, 2.0, "OpenAI's presence penalty"),
    "frequency_penalty": _number(-2.0, 2.0, "OpenAI's frequency penalty"),
    "repetition_penalty": _number(*P.REPETITION_PENALTY_RANGE, "1 is off; > 1 discourages"),
    "logit_bias": _nullable({
        "type": "object", "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id (a decimal string) to a bias added to its logit",
    }),
    "ignore_eos": _LAX_BOOL,
    "stream": _LAX_BOOL,
    "stream_options": _nullable({"type": "object", "properties": {
        "include_usage": _LAX_BOOL, "continuous_usage_stats": _LAX_BOOL},
        "description": "only with stream: true; continuous_usage_stats (with include_usage) "
                       "puts usage on every chunk"}),
    "user": _nullable({"type": "string"}),
    "include_stop_str_in_output": _LAX_BOOL,
    "skip_special_tokens": _LAX_BOOL,
    "priority": _integer(*_INT64, "smaller is served first under --scheduling-policy "
                         "priority"),
    # vLLM's answer-shape extras.
    "prompt_logprobs": _integer(-1, None, "the logprobs of every prompt token and this many "
                                "alternatives (-1: all; at most --max-logprobs); not with "
                                "stream"),
    "return_token_ids": _nullable({"type": "boolean", "description": "add prompt_token_ids "
                                   "and token_ids to the answer"}),
    "return_tokens_as_token_ids": _nullable({"type": "boolean", "description": "logprob "
                                             "tokens as 'token_id:N'"}),
    "cache_salt": _nullable({"type": "string", "minLength": 1,
                             "description": "prefix-cache entries are shared only "
                                            "between requests with the same salt"}),
    "request_id": _nullable({"type": "string", "minLength": 1, "maxLength": 256,
                             "description": "vLLM's: the engine's id for the request (the "
                                            "answer's id is cmpl- or chatcmpl- and it); an "
                                            "X-Request-Id header wins"}),
    # Structured output (engine.structured.openai checks the insides and names the field).
    "response_format": _nullable({
        "type": "object", "required": ["type"],
        "description": 'type "text", "json_object", or "json_schema" with json_schema: '
                       "{name, schema, strict}; other types are refused"}),
    "structured_outputs": _nullable({
        "type": "object", "description": "vLLM's: one of json (a JSON schema), regex, "
        "choice (strings), grammar (EBNF), json_object (true); other keys are refused"}),
    "guided_json": _nullable({"anyOf": [{"type": "object"}, {"type": "string"}],
                              "description": "a JSON schema (vLLM's older name)"}),
    "guided_regex": _nullable({"type": "string"}),
    "guided_choice": _nullable({"type": "array", "items": {"type": "string"}}),
    "guided_grammar": _nullable({"type": "string"}),
    # vLLM's sampling extras (docs/serving.md, "Sampling extras").
    "allowed_token_ids": _nullable({"type": "array", "items": _TOKEN_ID, "minItems": 1,
                                    "description": "only these tokens are sampled"}),
    "bad_words": _nullable({"type": "array", "maxItems": P.MAX_BAD_WORDS, "items": {
        "type": "string", "minLength": 1, "maxLength": P.MAX_BAD_WORD_CHARS},
        "description": "words never written (as vLLM reads them)"}),
    "truncate_prompt_tokens": _nullable({
        "type": "integer", "minimum": -1, "not": {"const": 0},
        "description": "keep the last N prompt tokens (-1: the context)"}),
    "truncation_side": _nullable({"enum": ["left", "right"],
                                  "description": "which end truncate_prompt_tokens cuts: "
                                  "left (default) keeps the last tokens, right the first"}),
    "spaces_between_special_tokens": _LAX_BOOL,
    "vllm_xargs": _nullable({"type": "object", "description": "arguments of the server's "
                             "logits processors (--logits-processors)"}),
}

_TOKEN_IDS = {"type": "array", "items": _TOKEN_ID, "minItems": 1}
COMPLETION: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **COMMON,
        "prompt": {"description": "a string, a list of strings, a list of token ids or a "
                                  "list of token-id lists (not empty)", "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
        ]},
        # 0 with echo: the prompt scored, nothing generated (the parser refuses 0 alone).
        "max_tokens": _integer(0, None, "tokens to generate at most (default 16); prompt + "
                               "max_tokens must fit the context; 0 with echo: the prompt "
                               "and its logprobs only"),
        "echo": _LAX_BOOL,
        "best_of": _integer(1, 128, "samples drawn per prompt, the n of highest cumulative "
                            "logprob returned; at least n; not with stream"),
        "suffix": _nullable({"type": "string", "description": "fill-in-the-middle: the text "
                             "after the gap (models with FIM tokens)"}),
        "logprobs": _integer(-1, None, "top alternatives per token beside the chosen one "
                             "(and per prompt token with echo); -1: all; at most "
                             "--max-logprobs"),
        # vLLM's: in place of prompt (which may then be null), with --enable-prompt-embeds.
        "prompt_embeds": {"description": "base64 of torch.save'd [tokens, hidden] tensors, "
                          "one per prompt, in place of prompt (needs --enable-prompt-embeds)",
                          "anyOf": [{"type": "string"},
                                    {"type": "array", "items": {"type": "string"}, "minItems": 1}]},
    },
}

# A content part; the chat normalizer (engine.chat.template) checks what each type must
# hold. An image (vision models) or an audio_url (audio models) is a data: URL, or http(s)
# from --allowed-media-domains; OpenAI's input_audio is base64 with its format.
_CONTENT_PART = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "image_url", "input_audio", "audio_url", "refusal"],
             "description": "text, image_url (vision models), input_audio and audio_url "
                            "(audio models), refusal (an assistant turn's, read as its text)"},
    "text": {"type": "string"}, "refusal": {"type": "string"},
    "image_url": {"anyOf": [{"type": "string"}, {"type": "object", "required": ["url"],
                  "properties": {"url": {"type": "string"},
                                 "detail": {"enum": ["auto", "low", "high"]}}}]},
    "audio_url": {"anyOf": [{"type": "string"}, {"type": "object", "required": ["url"],
                  "properties": {"url": {"type": "string"}}}]},
    "input_audio": {"type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string"},
                                   "format": {"enum": ["wav", "mp3", "flac", "ogg"]}}}}}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "minLength": 1,
                 "description": "system, developer, user, assistant, tool, or a custom role "
                                "the chat template reads (vLLM passes those on too)"},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"},
                              {"type": "array", "items": _CONTENT_PART}]},
    },
}
_MESSAGES = {"type": "array", "items": _MESSAGE, "minItems": 1}
CHAT: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **COMMON,
        "messages": _MESSAGES,
        "max_completion_tokens": _integer(1, None, "OpenAI's newer name for max_tokens"),
        "logprobs": _LAX_BOOL,
        "top_logprobs": _integer(-1, None, "alternatives per token, the chosen one first; "
                                 "-1: all; at most --max-logprobs; needs logprobs: true"),
        "echo": _LAX_BOOL,
        # Tool calling and templates (engine/chat checks their insides).
        "tools": _nullable({"type": "array", "items": {"type": "object"}}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]},
                                            {"type": "object"}]}),
        "parallel_tool_calls": _LAX_BOOL,
        "chat_template": _nullable({"type": "string"}),
        "chat_template_kwargs": _nullable({"type": "object"}),
        "add_generation_prompt": _LAX_BOOL,
        "continue_final_message": _LAX_BOOL,
        "documents": _nullable({"type": "array", "items": {"type": "object"},
                                "description": "sources for a retrieval-augmented chat "
                                               "template (its documents variable)"}),
        # false drops the reasoning --reasoning-parser splits off.
        "include_reasoning": _LAX_BOOL,
    },
}
_OBJECT = _nullable({"type": "object"})
RESPONSES: dict[str, Any] = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": COMMON["model"],
        "input": {"description": "a string (one user message) or a list of input items: "
                                 "messages (input_text parts; assistant output_text), "
                                 "function_call, function_call_output, reasoning", "anyOf": [
            {"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": _nullable({"type": "string", "description": "a system message "
                                   "first (not carried over by previous_response_id)"}),
        "previous_response_id": _nullable({"type": "string", "description": "continue a "
                                           "stored response's conversation"}),
        "store": _BOOL,
        "stream": _BOOL,
        "stream_options": _OBJECT,
        "max_output_tokens": _integer(1, None, "tokens to generate at most (default: up to "
                                      "the context)"),
        "temperature": COMMON["temperature"],
        "top_p": COMMON["top_p"],
        "tools": _nullable({"type": "array", "items": {
            "type": "object", "required": ["type"],
            "description": 'function tools: {"type": "function", "name", "description", '
                           '"parameters", "strict"}; built-in tools are refused'}}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]},
                                            {"type": "object", "required": ["type"]}]}),
        "parallel_tool_calls": _BOOL,
        "text": _nullable({"type": "object", "properties": {"format": _nullable({
            "type": "object", "required": ["type"],
            "description": 'type "text", "json_object", or "json_schema" with name, schema, '
                           "strict"})}}),
        "reasoning": _OBJECT,
        "metadata": _nullable({"type": "object", "additionalProperties": {"type": "string"}}),
        "user": _nullable({"type": "string"}),
        "include": _nullable({"type": "array", "items": {"type": "string"},
                              "description": "refused unless empty"}),
        "background": _BOOL,
        "truncation": _nullable({"enum": ["auto", "disabled"],
                                 "description": '"auto" is refused'}),
        # vLLM's sampling extras, as on the chat route.
        **{k: COMMON[k] for k in ("top_k", "min_p", "seed", "stop", "stop_token_ids",
                                  "presence_penalty", "frequency_penalty",
                                  "repetition_penalty", "logit_bias", "priority",
                                  "cache_salt")},
        "min_tokens": COMMON["min_tokens"],
        "chat_template_kwargs": _nullable({"type": "object"}),
    },
}
TOKENIZE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": COMMON["model"],
        "prompt": {"type": "string"},
        "messages": _MESSAGES,
        "add_special_tokens": _LAX_BOOL,
        "add_generation_prompt": _LAX_BOOL,
        "return_token_strs": _LAX_BOOL,
    },
    "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
}
DETOKENIZE: dict[str, Any] = {
    "type": "object",
    "required": ["tokens"],
    "properties": {"model": COMMON["model"], "tokens": {"type": "array", "items": _TOKEN_ID}},
}

_TRUNCATE = _nullable({"type": "integer", "minimum": -1, "not": {"const": 0},
                       "description": "keep only the last k tokens of each input (-1: the "
                       "model's maximum input length)"})
_STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 1}
EMBEDDINGS: dict[str, Any] = {
    # `input`, or vLLM's chat-style `messages` (rendered by the chat template; one of the
    # two is required, checked by the route, which names the one missing).
    "type": "object",
    "properties": {
        "model": COMMON["model"],
        "input": {"anyOf": [{"type": "string"}, _TOKEN_IDS, _STRINGS,
                            {"type": "array", "items": _TOKEN_IDS, "minItems": 1}],
                  "description": "a string, token ids, or a list of strings or of token-id lists"},
        "encoding_format": _nullable({"enum": ["float", "base64", "bytes", "bytes_only"],
                                      "description": "bytes, bytes_only (vLLM's): the values "
                                      "as the body (application/octet-stream), with a "
                                      "metadata header for bytes"}),
        "embed_dtype": _nullable({"enum": ["float32", "float16", "bfloat16", "fp8_e4m3",
                                           "fp8_e5m2"],
                                  "description": "base64: each value as this type (vLLM's; "
                                  "default float32)"}),
        "endianness": _nullable({"enum": ["native", "big", "little"],
                                 "description": "base64: the values' byte order (vLLM's; "
                                 "default native, this server's)"}),
        "dimensions": _integer(1, None, "keep the first N dimensions (Matryoshka models only)"),
        "normalize": _nullable({"type": "boolean", "description": "L2-normalise each "
                                "embedding (default: as the model's pipeline does)"}),
        "user": _nullable({"type": "string"}),
        "truncate_prompt_tokens": _TRUNCATE,
        "add_special_tokens": _nullable({"type": "boolean", "description": "tokenize text "
                                         "with the tokenizer's special tokens (default true)"}),
        "priority": COMMON["priority"],
        "messages": {"type": "array", "items": {"type": "object"}, "minItems": 1,
                     "description": "chat messages in place of input, rendered by the chat "
                                    "template and embedded as one text (vLLM's)"},
        "add_generation_prompt": _nullable({"type": "boolean", "description": "with messages: "
                                            "end with the assistant's header (default false)"}),
        "continue_final_message": _nullable({"type": "boolean"}),
        "chat_template": _nullable({"type": "string"}),
        "chat_template_kwargs": _nullable({"type": "object"}),
    },
}
_CHAT_EMBEDDING_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                          "chat_template", "chat_template_kwargs")
# vLLM's /classify: the embeddings body's inputs, a classifier's probabilities (or logits).
CLASSIFY: dict[str, Any] = {
    "type": "object",
    "required": ["input"],
    "properties": {
        **{k: v for k, v in EMBEDDINGS["properties"].items()
           if k not in ("encoding_format", "embed_dtype", "endianness", "dimensions", "normalize",
                        *_CHAT_EMBEDDING_FIELDS)},
        "use_activation": _nullable({"type": "boolean", "description": "probabilities "
                                     "(default true), or with false the logits"}),
    },
}
# vLLM's /pooling: the embeddings body with a task (and a classifier's use_activation).
POOLING: dict[str, Any] = {
    "type": "object",
    "properties": {
        **EMBEDDINGS["properties"],
        "task": _nullable({"enum": ["embed", "classify", "token_embed", "token_classify",
                                    "score", "plugin"],
                           "description": "embed, classify, token_embed or token_classify "
                           "(default: the model's per-token task); score and plugin are "
                           "refused"}),
        "use_activation": CLASSIFY["properties"]["use_activation"],
    },
}
_TEXTS = {"anyOf": [{"type": "string"}, _STRINGS]}
SCORE: dict[str, Any] = {
    "type": "object",
    "required": ["text_1", "text_2"],
    "properties": {
        "model": COMMON["model"],
        "text_1": _TEXTS,
        "text_2": _TEXTS,
        "truncate_prompt_tokens": _TRUNCATE,
        "priority": COMMON["priority"],
    },
}
RERANK: dict[str, Any] = {
    "type": "object",
    "required": ["query", "documents"],
    "properties": {
        "model": COMMON["model"],
        "query": {"type": "string"},
        "documents": {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "string"},
            {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
        ]}},
        "top_n": _integer(1, None, "return the best N documents (default: all)"),
        "return_documents": _BOOL,
        "truncate_prompt_tokens": _TRUNCATE,
        "priority": COMMON["priority"],
    },
}


def _schema(name: str) -> dict[str, Any]:
    return {"completion": COMPLETION, "chat": CHAT, "tokenize": TOKENIZE,
            "detokenize": DETOKENIZE, "embeddings": EMBEDDINGS, "score": SCORE,
            "rerank": RERANK, "classify": CLASSIFY, "pooling": POOLING,
            "responses": RESPONSES}[name]


@functools.cache
def _validator(name: str) -> Any:
    return jsonschema.Draft202012Validator(_schema(name))


@functools.cache
def _fast_validator(name: str) -> Any:
    return jsonschema_rs.Draft202012Validator(_schema(name))


def _passes(body: dict[str, Any], name: str) -> bool:
    """Whether the compiled validator finds ``body`` valid. ``jsonschema`` is the judge:
    a body this passes is one it passes too (``tests/test_http_schema.py`` holds the two
    to that), and anything else, or anything the compiled one cannot read, goes to it."""
    try:
        return bool(_fast_validator(name).is_valid(body))
    except (ValueError, TypeError, OverflowError):
        return False


def check_body(body: Any, name: str) -> None:
    """Raise a 400 :class:`APIError` naming the field if ``body`` breaks schema ``name``
    (``completion``, ``chat``, ``responses``, ``tokenize``, ``detokenize``, ``embeddings``,
    ``score``, ``rerank``, ``classify`` or ``pooling``)."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    body = _token_lists_checked(body, name)
    if _passes(body, name):
        # The common case, in a microsecond: jsonschema took 20-65 us a body (embeddings
        # to chat), about 2% of a one-sentence embeddings request's event-loop time.
        return
    error = jsonschema.exceptions.best_match(_validator(name).iter_errors(body))
    if error is None:
        return
    if error.validator == "anyOf" and error.context:
        # A value of the right type that breaks a rule inside its branch (a logit_bias
        # key that is no token id): name that rule, not "must be object or null".
        inner = [e for e in error.context if e.validator != "type"]
        if inner:
            error = jsonschema.exceptions.best_match(inner)
    path = list(error.absolute_path)
    if error.validator == "required" and not path:
        missing = error.message.split("'")[1] if "'" in error.message else None
        raise APIError(400, f"{missing or 'a field'} is required", param=missing,
                       code="missing_required_parameter")
    # A logit_bias key is a token id, not a field name: name the field.
    param = "logit_bias" if path[:1] == ["logit_bias"] else _param(path)
    value = error.instance
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    code = "invalid_type" if error.validator in ("type", "anyOf") else "invalid_value"
    raise APIError(400, f"{param or 'the body'} is invalid ({shown}): "
                   f"{_expected(error)}", param=param, code=code)


def _token_lists_checked(body: dict[str, Any], name: str) -> dict[str, Any]:
    """``body`` with its token-id lists (a completion's ``prompt``, detokenize's
    ``tokens``) checked here and left out of the jsonschema pass.

    They may hold a million ids, which jsonschema checks at tens of microseconds each, and
    for a prompt's ``anyOf`` keeps an error per id for each shape that fails (a 1.9 M-id
    prompt took 6 GB and a minute). The check here is the schema's, in one pass.
    """
    if name == "completion" and body.get("prompt") is None and body.get("prompt_embeds") is not None:
        return {**body, "prompt": ""}  # prompt_embeds in its place (the parser checks both)
    if name == "completion" and "prompt" in body:
        if not _valid_prompt(body["prompt"]):
            raise APIError(400, f"prompt is invalid ({_shown(body['prompt'])}): must be "
                           f"{COMPLETION['properties']['prompt']['description']}",
                           param="prompt", code="invalid_type")
        return {**body, "prompt": ""}
    if name == "detokenize" and isinstance(body.get("tokens"), list):
        if not _token_ids(body["tokens"]):
            raise APIError(400, f"tokens is invalid ({_shown(body['tokens'])}): must be a "
                           f"list of token ids in [0, {P._MAX_TOKEN_ID}]", param="tokens",
                           code="invalid_value")
        return {**body, "tokens": []}
    return body


def _is_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= P._MAX_TOKEN_ID


def _token_ids(values: list[Any]) -> bool:
    return all(map(_is_id, values))


def _valid_prompt(prompt: Any) -> bool:
    """COMPLETION's ``prompt`` schema: a string, or a non-empty list of strings, of token
    ids, or of non-empty token-id lists."""
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    if isinstance(first, str):
        return all(isinstance(p, str) for p in prompt)
    if isinstance(first, list):
        return all(isinstance(p, list) and p and _token_ids(p) for p in prompt)
    return _token_ids(prompt)


def _shown(value: Any) -> str:
    if isinstance(value, list) and len(value) > 8:
        value = [*value[:8], "..."]
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _param(path: list[Any]) -> str | None:
    if not path:
        return None
    out = str(path[0])
    for part in path[1:]:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _kind(schema: dict[str, Any]) -> str:
    """What one branch of an ``anyOf`` takes, for an error: its values when it lists
    them (``"float" or "base64"``), else its type."""
    if "enum" in schema:
        return " or ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    return str(schema.get("type", "a value"))


def _expected(error: Any) -> str:
    schema = error.schema
    if error.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum")
        left = "(" if "exclusiveMinimum" in schema else "["
        return f"must be in {left}{lo}, {'inf' if hi is None else hi}]"
    if error.validator == "anyOf":
        if "description" in schema:
            return f"must be {schema['description']}"
        kinds = [_kind(sub) for sub in schema["anyOf"]]
        inner = [k for sub in schema["anyOf"] for k in
                 ([sub["anyOf"][0].get("type")] if "anyOf" in sub else [])]
        return "must be " + " or ".join(str(k) for k in inner + kinds if k)
    return error.message if len(error.message) <= 200 else error.message[:197] + "..."
