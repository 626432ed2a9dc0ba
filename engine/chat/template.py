"""Chat messages into a model's prompt: the chat template rendered for a request.

* :func:`normalize_messages` is the one chat-message normalizer (the HTTP server, the
  embedded API and ``/tokenize`` all go through it).
* :func:`resolve_content_format` tells how a template reads a message's content (vLLM's
  ``--chat-template-content-format``): ``"openai"`` when it iterates over it (it gets the
  parts), ``"string"`` otherwise (it gets the text parts joined with a newline).
* :func:`apply_chat_template` renders messages with a model's template
  (:attr:`engine.models.tokenizer.Tokenizer.compiled_chat_template`) or a request's, with
  its tools (or the fallback tool prompt, :func:`engine.chat.tools.fallback_messages`, for
  a template that never reads ``tools``), ``continue_final_message`` and
  ``chat_template_kwargs``, as transformers' ``apply_chat_template`` does.
* :func:`chat_prompt_ids` gives the rendered prompt's token ids with the request's text
  kept from becoming control tokens; :class:`ChatTokenizer` is a tokenizer with it, what
  :func:`engine.core.admission.prompt_token_ids` takes.

The render runs in the bounded sandbox (:mod:`engine.models.chat_sandbox`).
"""

from __future__ import annotations

import functools
import re
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2

from engine.chat.tools import (
    check_tool_fields,
    fallback_messages,
    parse_tools,
    template_reads_tools,
)
from engine.config import CHAT_TEMPLATE_CONTENT_FORMATS
from engine.errors import InvalidParamError, RequestError
from engine.models import chat_sandbox
from engine.models.chat_template import compile_template, template_iterates_content
from engine.models.tokenizer import Tokenizer

# The roles every template knows; others ("ipython", "function", a custom "wizard") are
# passed to the template, which accepts or rejects them.
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# "developer" is OpenAI's newer name for the system role; templates only know "system".
_ROLE_ALIASES = {"developer": "system"}

# A template that reads content as a string gets a content list's text parts joined with a
# newline (vLLM's rule, kept so prompts match across servers); so does every tool result,
# which templates write as a string (vLLM flattens those whatever the format).
_CONTENT_PART_SEPARATOR = "\n"

# --chat-template-content-format: "auto" reads the template (resolve_content_format);
# "string" and "openai" force one way.
CONTENT_FORMATS = CHAT_TEMPLATE_CONTENT_FORMATS

# Template variables a request's chat_template_kwargs may not replace: the engine sets
# them from the request's own fields.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

# Older names under which a message's reasoning arrives; templates read reasoning_content
# (most) or thinking (gpt-oss). transformers copies the first one present to both.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Request-supplied templates kept compiled (a client reusing one template pays once), and
# whether each template source reads tools; filled from the worker threads that render
# prompts.
_TEMPLATE_CACHE_SIZE = 16
_request_templates: dict[str, jinja2.Template] = {}
_reads_tools: dict[str, bool] = {}
_content_formats: dict[str, str] = {}
_cache_lock = threading.Lock()


# -- messages ---------------------------------------------------------------------------


def normalize_messages(messages: Any, *, images: bool = False) -> list[dict[str, Any]]:
    """Check chat ``messages`` and return plain copies that a template may read.

    The one chat-message normalizer: the HTTP server, the embedded API and ``/tokenize``
    all go through it. Errors are :class:`InvalidParamError` naming the field
    (``messages[1].content``). Idempotent. A content list stays a list of parts
    (``{"type": "text", "text": ...}`` copies; how it reaches the template is the
    template's content format, :func:`resolve_content_format`), but a tool result's, which
    becomes its texts joined with newlines (templates write tool results as strings; vLLM
    joins them so too). ``images``: image parts (``image_url``, ``image``) are kept, for
    the engine to take the images out (:func:`engine.multimodal.split_images`) before the
    template renders; otherwise an image part is refused."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidParamError("messages must be a non-empty list of messages", param="messages")
    return [_normalize_message(i, m, images) for i, m in enumerate(messages)]


def _normalize_message(index: int, message: Any, images: bool = False) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidParamError(f"{where} must be an object with role and content", param=where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidParamError(
            f"{where}.role must be a non-empty string ({', '.join(sorted(CHAT_ROLES | set(_ROLE_ALIASES)))}, "
            f"or a custom role the chat template reads), got {role!r}",
            param=f"{where}.role",
        )
    # A custom role reaches the template as given, as vLLM passes it: the template decides
    # (one that rejects it raises, and the request gets a 400 with the template's message).
    role = _ROLE_ALIASES.get(role, role)
    out = {k: v for k, v in message.items() if v is not None}
    out["role"] = role
    if role != "assistant" and "content" in message and message["content"] is None:
        out["content"] = ""  # OpenAI clients send null content; only assistants may omit it
    out.update(check_tool_fields({**message, "role": role}, where))
    if role == "assistant":
        _assistant_fields(where, out)
    if "content" in out:
        out["content"] = _content(where, out["content"], images and role != "tool", role)
        if role == "tool" and isinstance(out["content"], list):
            out["content"] = _CONTENT_PART_SEPARATOR.join(p["text"] for p in out["content"])
    elif role != "assistant":  # an assistant turn may carry only tool_calls (no content)
        raise InvalidParamError(f"{where} has no content", param=f"{where}.content")
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _assistant_fields(where: str, out: dict[str, Any]) -> None:
    """An assistant turn as OpenAI's client replays it (``messages.append(message)``). Its
    ``refusal`` (content null) is what it said, read as its content, as a refusal part is;
    a turn without content, refusal or tool calls has empty content (vLLM's reading: every
    template gets a content). Audio and the deprecated ``function_call`` would be history
    this server cannot render: refused, naming the field."""
    for field, why in (("audio", "this server does not read audio turns; send the "
                                 "turn's transcript as its content"),
                       ("function_call", "the deprecated function calls are not supported "
                                         "by this server; send them as tool_calls")):
        if field in out:
            raise InvalidParamError(f"{where}.{field}: {why}", param=f"{where}.{field}")
    if "content" in out:
        return
    refusal = out.get("refusal")
    if refusal is not None and not isinstance(refusal, str):
        raise InvalidParamError(f"{where}.refusal must be a string", param=f"{where}.refusal")
    if refusal is not None or "tool_calls" not in out:
        out["content"] = refusal or ""


_IMAGE_PARTS = ("image_url", "image", "input_audio", "audio_url", "audio")  # media parts


def _content(where: str, content: Any, images: bool = False,
             role: str = "user") -> str | list[dict[str, Any]]:
    """A message's content checked: a string, or a list of text parts (copies holding
    ``type`` and ``text`` only) and, with ``images``, image parts (copied whole: the engine
    reads their data later). An assistant turn's refusal part (OpenAI's shape for what it
    declined) becomes a text part of its refusal, as vLLM reads it; in any other turn it
    is refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise InvalidParamError(
            f"{where}.content must be a string or a list of content parts",
            param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if images and kind in _IMAGE_PARTS:
            parts.append(dict(part))  # checked when the engine takes the image out
            continue
        if kind == "refusal" and role == "assistant":
            if not isinstance(part.get("refusal"), str):
                raise InvalidParamError(f"{where}.content[{j}].refusal must be a string",
                                        param=f"{where}.content")
            parts.append({"type": "text", "text": part["refusal"]})
            continue
        if kind != "text":
            what = "a text, image or audio part" if images else "a text part"
            if kind == "refusal":
                what += " (a refusal part belongs to an assistant turn)"
            raise InvalidParamError(f"{where}.content[{j}] must be {what}, got {kind!r}",
                                    param=f"{where}.content")
        if not isinstance(part.get("text"), str):
            raise InvalidParamError(f"{where}.content[{j}].text must be a string",
                                    param=f"{where}.content")
        parts.append({"type": "text", "text": part["text"]})
    return parts


# -- content format ---------------------------------------------------------------------


def resolve_content_format(source: str | None, option: str = "auto") -> str:
    """How the template ``source`` reads a message's content: ``"openai"`` (it iterates
    over it, or indexes it as a list: it gets the parts) or ``"string"``. ``option`` is
    ``--chat-template-content-format``: ``"auto"`` reads the template (cached per
    source; a source that does not parse is ``"string"``), the others force one way."""
    if option not in CONTENT_FORMATS:
        raise InvalidParamError(f"chat template content format must be one of "
                                f"{', '.join(CONTENT_FORMATS)}, got {option!r}",
                                param="chat_template_content_format")
    if option != "auto":
        return option
    found = _content_formats.get(source or "")
    if found is None:
        found = "openai" if source and template_iterates_content(source) else "string"
        with _cache_lock:
            if len(_content_formats) >= 2 * _TEMPLATE_CACHE_SIZE:
                _content_formats.pop(next(iter(_content_formats)))
            _content_formats[source or ""] = found
    return found


def _shape_content(chat: list[dict[str, Any]], fmt: str,
                   image_text: str | None) -> list[dict[str, Any]]:
    """The messages as a template of content format ``fmt`` takes them (vLLM's rule).

    ``openai``: every content is a list of parts in the order given, text parts as
    ``{"type": "text", "text"}``, each image as ``{"type": "image"}`` and each audio clip
    as ``{"type": "audio", "audio": None}`` (the template writes the placeholder the
    model's processor expects); a string becomes one text
    part. ``string``: a list becomes its parts joined with a newline, each image as
    ``image_text`` (the model's placeholder). A tool result is a string either way; an
    assistant turn without content keeps none."""
    out = []
    for message in chat:
        content = message.get("content")
        if message.get("role") == "tool" or content is None:
            out.append(message)
            continue
        if fmt == "openai":
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else [
                {"type": "text", "text": p["text"]} if p.get("type") == "text"
                else {"type": "audio", "audio": None} if p.get("type") == "audio"
                else {"type": "image"} for p in content]
            out.append({**message, "content": parts})
        elif isinstance(content, list):
            text = _CONTENT_PART_SEPARATOR.join(
                p["text"] if p.get("type") == "text" else image_text or "" for p in content)
            out.append({**message, "content": text})
        else:
            out.append(message)
    return out


# Appended to the final message for continue_final_message; the rendered text is cut where
# it lands. The trailing space tells whether the template kept the message's trailing
# whitespace (transformers' method, so the prefill tokenizes as transformers makes it).
_CONTINUE_MARK = "\u2063CONTINUE_FINAL_MESSAGE\u2063 "


def _mark_final(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The mark appended to the final message's text (its last part's, for parts)."""
    content = chat[-1].get("content")
    last = content[-1] if isinstance(content, list) and content else None
    if isinstance(content, str) and content.strip():
        marked: Any = content + _CONTINUE_MARK
    elif last is not None and last.get("type") == "text" and last["text"].strip():
        marked = [*content[:-1], {**last, "text": last["text"] + _CONTINUE_MARK}]
    else:
        raise InvalidParamError(
            "continue_final_message needs a final message that ends with text",
            param="continue_final_message",
        )
    return [*chat[:-1], {**chat[-1], "content": marked}]


def _cut_at_mark(rendered: str) -> str:
    """``rendered`` cut where the final message ended, so the model continues it."""
    mark = _CONTINUE_MARK.strip()
    at = rendered.rfind(mark)
    if at == -1:
        raise InvalidParamError(
            "continue_final_message: the chat template does not write out the final "
            "message's content", param="continue_final_message",
        )
    if rendered.startswith(_CONTINUE_MARK, at):
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message: so do we


# -- rendering --------------------------------------------------------------------------


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    content_format: str = "auto",
    image_text: str | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` with ``tokenizer``'s chat template into one prompt string.

    Each message is a dict with ``role`` (system, user, assistant, tool or a custom
    role the template reads) and ``content``: a string, or a list of
    ``{"type": "text", "text": ...}`` parts. ``content_format`` (``auto``, ``string``,
    ``openai``: :func:`resolve_content_format`) says how the parts reach the template: as parts,
    a string becoming one text part, for a template that iterates over content; joined
    with newlines for one that reads a string. ``image_text`` is given when the engine
    took a request's images out (:func:`engine.multimodal.split_images`): the
    ``{"type": "image"}`` parts left in their place then render as the template writes an
    image, or as ``image_text`` (the model's placeholder) in a string template; without
    it an image part is refused. Other keys (``name``, ``tool_calls``, ...) reach the template as
    given; keys whose value is None are dropped, as transformers does. Bad messages and
    errors the template raises (``raise_exception``) give :class:`InvalidParamError`
    with ``param="messages"``; a model without a template gives :class:`RequestError`.

    ``tools`` are OpenAI tool definitions. A template that never reads ``tools`` gets
    them through the fallback tool prompt instead, and its history's tool calls and
    results as text (:func:`engine.chat.tools.fallback_messages`).
    ``chat_template`` replaces the model's template (jinja source) for this call.
    The render is bounded (:mod:`engine.models.chat_sandbox`): past its budget (time,
    under :func:`~engine.models.chat_sandbox.render_budget`, or size) it raises
    :class:`InvalidParamError` naming ``chat_template`` for a request's template,
    ``messages`` for the model's.
    ``continue_final_message`` leaves the last message open, so the model continues
    it (an assistant prefill): the text is cut right after that message's content, as
    transformers does. ``chat_template_kwargs`` (a request's) and ``template_kwargs``
    become template variables (``enable_thinking=False``, ...). ``documents`` (a
    retrieval-augmented template's sources, ``[{"title", "text"}]``) is the template's
    ``documents`` variable, as transformers passes it.
    """
    template = _template(tokenizer, chat_template)
    if continue_final_message and add_generation_prompt:
        raise InvalidParamError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise InvalidParamError("chat_template_kwargs must be an object",
                                param="chat_template_kwargs")
    template_kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
    reserved = sorted(set(template_kwargs) & _RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise InvalidParamError(
            f"chat_template_kwargs may not set {', '.join(reserved)}",
            param="chat_template_kwargs",
        )
    source = chat_template or tokenizer.chat_template
    chat = normalize_messages(messages, images=image_text is not None)
    chat, tools = _fit_tools(chat, tools, source)
    chat = _shape_content(chat, resolve_content_format(source, content_format), image_text)
    if continue_final_message:
        chat = _mark_final(chat)
    variables = {**tokenizer.special_tokens, **template_kwargs}
    try:
        rendered = chat_sandbox.render(
            template,
            messages=chat,
            tools=list(tools) if tools is not None else None,
            documents=list(documents) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except chat_sandbox.TemplateBudgetError as exc:
        raise InvalidParamError(
            f"{exc} ({'the request' if chat_template is not None else 'the model'}'s "
            "template)", param="chat_template" if chat_template is not None else "messages",
        ) from None
    except jinja2.TemplateError as exc:
        raise InvalidParamError(
            f"chat template rejected the messages: {exc}", param="messages"
        ) from exc
    except Exception as exc:
        # The template is the model author's code run on the client's messages: any
        # failure in it (a TypeError on an unexpected content type, say) is this
        # request's error, never the engine's.
        raise InvalidParamError(
            f"chat template failed on the messages: {type(exc).__name__}: {exc}",
            param="messages",
        ) from exc
    if continue_final_message:
        rendered = _cut_at_mark(rendered)
    return rendered


def _template(tokenizer: Tokenizer, source: str | None) -> jinja2.Template:
    """The model's compiled template, or the request's ``source`` compiled (kept in a
    small cache)."""
    if source is None:
        template = tokenizer.compiled_chat_template
        if template is None:
            raise RequestError(
                f"the model at {str(tokenizer.folder)!r} has no chat template; "
                "send a plain prompt (completions) instead of messages",
                param="messages",
            )
        return template
    compiled = _request_templates.get(source)
    if compiled is None:
        try:
            compiled = compile_template(source)
        except Exception as cause:  # a syntax error, or a constant that fails to fold
            what = ("is not valid jinja" if isinstance(cause, jinja2.TemplateSyntaxError)
                    else f"fails while compiling: {type(cause).__name__}")
            raise InvalidParamError(f"chat_template {what}: {cause}",
                                    param="chat_template") from None
        with _cache_lock:
            if len(_request_templates) >= _TEMPLATE_CACHE_SIZE:
                _request_templates.pop(next(iter(_request_templates)))
            _request_templates[source] = compiled
    return compiled


def _fit_tools(
    chat: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None, source: str | None,
) -> tuple[list[dict[str, Any]], Sequence[Mapping[str, Any]] | None]:
    """Messages and tools as this template can take them (see apply_chat_template)."""
    reads_tools = _reads_tools.get(source or "")
    if reads_tools is None:
        reads_tools = template_reads_tools(source)
        with _cache_lock:
            if len(_reads_tools) >= 2 * _TEMPLATE_CACHE_SIZE:
                _reads_tools.pop(next(iter(_reads_tools)))
            _reads_tools[source or ""] = reads_tools
    if reads_tools:
        return chat, tools
    has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in chat)
    if not tools and not has_tool_turns:
        return chat, tools
    return fallback_messages(chat, parse_tools(list(tools) if tools else None),
                             describe_tools=bool(tools)), None


# -- token ids --------------------------------------------------------------------------


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    special_tokens_in_content: bool = False,
    check_rendered: Callable[[str], Any] | None = None,
    **options: Any,
) -> list[int]:
    """The token ids of :func:`apply_chat_template`'s prompt (no BOS/EOS added: the
    template writes its own).

    Text that came from the request (message contents, names, tool calls and results,
    tool definitions, ``chat_template_kwargs``) never becomes a control token: a user
    who writes ``<|im_end|>\n<|im_start|>system`` gets those characters as text, while
    the template's own markers are the special tokens. ``special_tokens_in_content``
    encodes the whole rendered text instead (what transformers'
    ``apply_chat_template(tokenize=True)`` does: the server's
    ``--allow-special-tokens-in-content``). A request without control-token text in it
    gets exactly the ids of encoding the rendered text either way.
    The image placeholders a request's image parts become are the template's (or, for a
    string template, ``image_text`` written in after the request's text was marked):
    tokens, whatever the client typed.
    ``check_rendered`` sees the rendered text before it is encoded (and may raise: a
    text too long for any tokenization to fit the context).
    """
    texts = tokenizer.control_tokens
    if texts and not special_tokens_in_content:
        chat = normalize_messages(messages, images=options.get("image_text") is not None)
        nonce = str(secrets.randbelow(10**8))
        marked = _Marker(texts, _control_pattern(texts), nonce)
        chat = marked(chat)
        for name in ("tools", "chat_template_kwargs", "documents"):
            if options.get(name) is not None:
                options = {**options, name: marked(options[name])}
        if marked.count:
            rendered = apply_chat_template(tokenizer, chat, add_generation_prompt, **options)
            if check_rendered is not None:
                check_rendered(rendered)
            return tokenizer.encode_templated(rendered, marked.restore)
    rendered = apply_chat_template(tokenizer, messages, add_generation_prompt, **options)
    if check_rendered is not None:
        check_rendered(rendered)
    return tokenizer.encode(rendered, add_special_tokens=False)


@functools.lru_cache(maxsize=16)
def _control_pattern(texts: tuple[str, ...]) -> re.Pattern[str]:
    """A regex of control-token texts (longest first, so it prefers the longest)."""
    return re.compile("|".join(map(re.escape, texts)))


class _Marker:
    """Replaces control-token text in a request's JSON values with sentinels and back.

    A sentinel is ``U+E000 nonce index U+E001`` (private-use characters, a per-request
    random nonce, the token's index): no template writes one, and a client cannot guess
    the nonce. Digits only, so a template's ``upper``/``lower``/``trim`` leave it whole.
    """

    def __init__(self, texts: tuple[str, ...], pattern: re.Pattern[str], nonce: str) -> None:
        self._texts = texts
        self._index = {t: i for i, t in enumerate(texts)}
        self._pattern = pattern
        self._nonce = nonce
        self._sentinel = re.compile(f"\ue000{nonce}(\\d+)\ue001")
        self.count = 0

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            if not any(t in value for t in self._texts):  # C-speed check before the regex
                return value
            return self._pattern.sub(self._replace, value)
        if isinstance(value, Mapping):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self(v) for v in value]
        return value

    def _replace(self, match: re.Match[str]) -> str:
        self.count += 1
        return f"\ue000{self._nonce}{self._index[match.group()]}\ue001"

    def restore(self, text: str) -> str:
        return self._sentinel.sub(lambda m: self._texts[int(m.group(1))], text)


class ChatTokenizer:
    """A tokenizer and its chat template, as :func:`engine.core.admission.prompt_token_ids`
    takes one (its ``PromptTokenizer``): ``tokenizer``'s ``encode`` and
    ``max_token_chars``, and :func:`chat_prompt_ids` for chat messages, rendered with the
    server's ``content_format`` (and ``image_text``: see :func:`apply_chat_template`). The
    embedded API and the HTTP server hand it to admission, which knows nothing of chat."""

    def __init__(self, tokenizer: Tokenizer, *, content_format: str = "auto",
                 image_text: str | None = None) -> None:
        self.tokenizer = tokenizer
        # --chat-template-content-format, and the image placeholder of a request whose
        # images the engine took out (see apply_chat_template).
        self.content_format = content_format
        self.image_text = image_text

    @property
    def max_token_chars(self) -> int:
        return self.tokenizer.max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True, **options: Any) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, add_generation_prompt,
                               content_format=self.content_format, image_text=self.image_text,
                               **options)
