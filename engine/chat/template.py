"""Chat messages into a model's prompt: the chat template rendered for a request.

* :func:`normalize_messages` is the one chat-message normalizer (the HTTP server, the
  embedded API and ``/tokenize`` all go through it).
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
from engine.errors import InvalidParamError, RequestError
from engine.models import chat_sandbox
from engine.models.chat_template import compile_template
from engine.models.tokenizer import Tokenizer

# The roles every template knows; others ("ipython", "function", a custom "wizard") are
# passed to the template, which accepts or rejects them.
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# "developer" is OpenAI's newer name for the system role; templates only know "system".
_ROLE_ALIASES = {"developer": "system"}

# Text parts of a list-valued message content are joined with a newline, as vLLM does for
# OpenAI-style content arrays.
_CONTENT_PART_SEPARATOR = "\n"

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
_cache_lock = threading.Lock()


# -- messages ---------------------------------------------------------------------------


def normalize_messages(messages: Any, *, images: bool = False) -> list[dict[str, Any]]:
    """Check chat ``messages`` and return plain copies that a template may read.

    The one chat-message normalizer: the HTTP server, the embedded API and ``/tokenize``
    all go through it. Errors are :class:`InvalidParamError` naming the field
    (``messages[1].content``). Idempotent. ``images``: a content list holding image parts
    (``image_url``, ``image``) stays a list of parts, for the engine to take the images
    out (:func:`engine.multimodal.split_images`) before the template renders; otherwise
    an image part is refused."""
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
    if "content" in out:
        out["content"] = _content_text(where, out["content"], images)
    elif role != "assistant":  # an assistant turn may carry only tool_calls
        raise InvalidParamError(f"{where} has no content", param=f"{where}.content")
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


# Appended to the final message for continue_final_message; the rendered text is cut where
# it lands. The trailing space tells whether the template kept the message's trailing
# whitespace (transformers' method, so the prefill tokenizes as transformers makes it).
_CONTINUE_MARK = "\u2063CONTINUE_FINAL_MESSAGE\u2063 "


def _mark_final(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    content = chat[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise InvalidParamError(
            "continue_final_message needs a final message with text content",
            param="continue_final_message",
        )
    return [*chat[:-1], {**chat[-1], "content": content + _CONTINUE_MARK}]


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


_IMAGE_PARTS = ("image_url", "image")


def _content_text(where: str, content: Any, images: bool = False) -> str | list[Any]:
    if isinstance(content, str):
        return content
    if images and isinstance(content, (list, tuple)) and any(
            isinstance(p, Mapping) and p.get("type") in _IMAGE_PARTS for p in content):
        for j, part in enumerate(content):  # text parts checked; images are checked later
            if isinstance(part, Mapping) and part.get("type") in _IMAGE_PARTS:
                continue
            if not (isinstance(part, Mapping) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise InvalidParamError(f"{where}.content[{j}] must be a text or image part",
                                        param=f"{where}.content")
        return [dict(p) for p in content]
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise InvalidParamError(
            f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidParamError(
                f"{where}.content[{j}] must be a text part, got {kind!r}", param=f"{where}.content"
            )
        if not isinstance(part.get("text"), str):
            raise InvalidParamError(f"{where}.content[{j}].text must be a string", param=f"{where}.content")
        texts.append(part["text"])
    return _CONTENT_PART_SEPARATOR.join(texts)


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
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` with ``tokenizer``'s chat template into one prompt string.

    Each message is a dict with ``role`` (system, user, assistant, tool or a custom
    role the template reads) and ``content``: a string, or a list of
    ``{"type": "text", "text": ...}`` parts joined with newlines. Other keys (``name``, ``tool_calls``, ...) reach the template as
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
    become template variables (``enable_thinking=False``, ...).
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
    chat = normalize_messages(messages)
    if continue_final_message:
        chat = _mark_final(chat)
    chat, tools = _fit_tools(chat, tools, chat_template or tokenizer.chat_template)
    variables = {**tokenizer.special_tokens, **template_kwargs}
    try:
        rendered = chat_sandbox.render(
            template,
            messages=chat,
            tools=list(tools) if tools is not None else None,
            documents=None,
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
    content_tokens: Sequence[str] = (),
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
    ``content_tokens`` are control tokens the caller itself wrote into the messages
    (the image token a multimodal request's image parts became): those stay tokens.
    ``check_rendered`` sees the rendered text before it is encoded (and may raise: a
    text too long for any tokenization to fit the context).
    """
    texts = tokenizer.control_tokens
    if content_tokens:
        texts = tuple(t for t in texts if t not in content_tokens)
    if texts and not special_tokens_in_content:
        chat = normalize_messages(messages)
        nonce = str(secrets.randbelow(10**8))
        marked = _Marker(texts, _control_pattern(texts), nonce)
        chat = marked(chat)
        for name in ("tools", "chat_template_kwargs"):
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
    ``max_token_chars``, and :func:`chat_prompt_ids` for chat messages. The embedded API
    and the HTTP server hand it to admission, which knows nothing of chat."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def max_token_chars(self) -> int:
        return self.tokenizer.max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True, **options: Any) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, add_generation_prompt, **options)
