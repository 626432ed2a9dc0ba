"""The tokenizer and chat template of a Hugging Face model folder, without transformers.

:class:`Tokenizer` reads ``tokenizer.json`` with the fast ``tokenizers`` library and renders
the chat template with jinja2, set up the way transformers (v5) sets them up, so encode,
decode and the rendered prompt equal ``transformers.AutoTokenizer`` on the same folder while
loading in a fraction of the time (importing transformers alone takes seconds).

The rules copied from transformers, because a model was trained with them:

* BOS/EOS on encode: when ``tokenizer_config.json`` sets ``add_bos_token`` or
  ``add_eos_token``, the post-processor is rebuilt to add exactly those (what transformers
  v4 and transformers' GGUF loader do); otherwise ``tokenizer.json``'s post-processor
  decides. One deliberate difference: transformers v5 loading a folder ignores those two
  keys when a ``tokenizer.json`` exists. They differ only where the two files disagree;
  the engine's own GGUF conversion writes the flag and not the post-processor, so the
  config has to win.
* Named special tokens of the config (``bos_token``, ``pad_token``, ...) that the vocabulary
  lacks are added as special tokens, as transformers does on load.
* The chat template comes from ``chat_template.jinja`` if present, else from
  ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates of
  which ``default`` is used), else from ``chat_template.json``.
* The jinja environment is a sandbox with ``trim_blocks``, ``lstrip_blocks``,
  ``loopcontrols``, a ``tojson`` that does not escape HTML, ``raise_exception``,
  ``strftime_now`` and a no-op ``{% generation %}`` block; the template sees the named
  special tokens (``bos_token``, ``eos_token``, ...) as variables. The sandbox bounds what
  one render may cost (:mod:`engine.models.chat_sandbox`): values, output, and time under
  a :func:`~engine.models.chat_sandbox.render_budget`.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _BackendTokenizer

from engine.errors import (
    CorruptModelError,
    InvalidParamError,
    ModelNotFoundError,
    RequestError,
)
from engine.models import chat_sandbox

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"

# The named special tokens, in transformers' order (it fixes the order of all_special_ids).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

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

# Request-supplied templates kept compiled; a client reusing one template pays once.
_TEMPLATE_CACHE_SIZE = 16

# Texts longer than this are encoded through the backend's batch call, which releases the
# GIL while it works: a plain encode holds it throughout (measured: 17 s for 3.7 MB of
# text, during which no other thread, the event loop's included, ran at all). Shorter
# texts take under a millisecond either way.
_RELEASE_GIL_CHARS = 4096

# Older names under which a message's reasoning arrives; templates read reasoning_content
# (most) or thinking (gpt-oss). transformers copies the first one present to both.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """Encode, decode and chat-format text for one model; build it with :meth:`from_folder`.

    Instances are immutable after construction and safe to share between threads for
    ``encode`` / ``decode`` (the ``tokenizers`` backend is only read).
    """

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        config: Mapping[str, Any],
        generation_config: Mapping[str, Any],
        chat_template: str | None,
        source: Path,
    ) -> None:
        self._backend = backend
        self._source = source
        self.tokenizer_config: Mapping[str, Any] = dict(config)
        """``tokenizer_config.json`` as read (for ``GET /tokenizer_info``)."""
        self._special_tokens = _named_special_tokens(config)
        self._add_missing_special_tokens()
        self._apply_bos_eos_flags(config)
        self._chat_template_source = chat_template
        self.generation_config: Mapping[str, Any] = dict(generation_config)
        """``generation_config.json`` as read (``{}`` without one)."""
        self._chat_template = _compile_template(chat_template, source) if chat_template else None
        # Per-request templates (--trust-request-chat-template), compiled once each.
        self._request_templates: dict[str, jinja2.Template] = {}
        self._reads_tools: dict[str, bool] = {}
        # The two caches above are filled from the worker threads that render prompts.
        self._cache_lock = threading.Lock()

        eos = self._token_id(self._special_tokens.get("eos_token"))
        extra_eos = _int_ids(generation_config.get("eos_token_id"), source / GENERATION_CONFIG_FILE)
        self.eos_token_id: int | None = eos
        """The tokenizer config's ``eos_token`` as an id (None if it has none)."""
        self.eos_token_ids: frozenset[int] = frozenset(
            ([eos] if eos is not None else []) + list(extra_eos)
        )
        """Every id that ends generation: the tokenizer's EOS plus generation_config's."""
        self.bos_token_id: int | None = self._token_id(self._special_tokens.get("bos_token"))
        self.pad_token_id: int | None = self._token_id(self._special_tokens.get("pad_token"))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        """Number of token ids, added tokens included (transformers' ``len(tokenizer)``)."""
        self.all_special_ids: tuple[int, ...] = self._all_special_ids(config)
        """Ids of the config's named and extra special tokens, in transformers' order."""
        self.skipped_special_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        """Ids that ``decode(..., skip_special_tokens=True)`` drops: every special added token."""
        # The control tokens a message's text must never become (every special added token,
        # <|im_start|>, <|eot_id|>, [INST]...), longest first so a regex prefers the longest.
        # None when the config splits special tokens anyway (text can never form one).
        control = {tok.content: i for i, tok in backend.get_added_tokens_decoder().items()
                   if tok.special and tok.content}
        self._control_ids: dict[int, str] = {i: text for text, i in control.items()}
        self._control_texts: tuple[str, ...] = tuple(sorted(control, key=len, reverse=True))
        self._control_pattern: re.Pattern[str] | None = (
            re.compile("|".join(map(re.escape, self._control_texts)))
            if self._control_texts and not backend.encode_special_tokens else None)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the Hugging Face model folder ``path``.

        Needs ``tokenizer.json``; ``tokenizer_config.json``, ``generation_config.json`` and
        the chat template files are optional. Raises :class:`ModelNotFoundError` when the
        folder or ``tokenizer.json`` is missing and :class:`CorruptModelError` naming the
        file when one cannot be parsed.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ModelNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ModelNotFoundError(
                f"{str(tokenizer_file)!r} is missing: a fast tokenizer (tokenizer.json) is required"
            )
        try:
            backend = _BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON or schema
            raise CorruptModelError(f"cannot parse {str(tokenizer_file)!r}: {exc}") from exc
        # A tokenizer.json may carry truncation and padding settings (sentence-transformers
        # folders pad to a fixed 128): transformers drops them at load, and so does this;
        # lengths are the engine's to check, not the tokenizer's to cut.
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(folder / TOKENIZER_CONFIG_FILE)
        if config.get("split_special_tokens"):
            backend.encode_special_tokens = True
        return cls(
            backend,
            config=config,
            generation_config=_read_json(folder / GENERATION_CONFIG_FILE),
            chat_template=_find_chat_template(folder, config),
            source=folder,
        )

    def _add_missing_special_tokens(self) -> None:
        # transformers adds named special tokens the vocabulary lacks, with fresh ids.
        missing = [
            AddedToken(tok, special=True, normalized=False)
            for tok in self._special_tokens.values()
            if self._backend.token_to_id(tok) is None
        ]
        if missing:
            self._backend.add_special_tokens(missing)

    def _apply_bos_eos_flags(self, config: Mapping[str, Any]) -> None:
        if "add_bos_token" not in config and "add_eos_token" not in config:
            return
        # A flag naming a token the config does not define adds nothing, as in transformers.
        bos = self._special_tokens.get("bos_token") if config.get("add_bos_token") else None
        eos = self._special_tokens.get("eos_token") if config.get("add_eos_token") else None
        marks = [(t, self._backend.token_to_id(t)) for t in (bos, eos) if t is not None]
        single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
        pair = " ".join(
            [single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])]
        )
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=marks
        )

    def _all_special_ids(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        tokens = list(
            dict.fromkeys([*self._special_tokens.values(), *_extra_special_tokens(config)])
        )
        ids = (self._backend.token_to_id(t) for t in tokens)
        return tuple(i for i in ids if i is not None)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # -- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor may add BOS/EOS."""
        if not isinstance(text, str):
            raise InvalidParamError(
                f"prompt must be a string, got {type(text).__name__}", param="prompt"
            )
        return _encode(self._backend, text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary entry's
        length, which for byte-level vocabularies (one character per byte) and
        SentencePiece ones (one per character) is at least that. A text longer than
        ``n * max_token_chars`` (before normalization) cannot be ``n`` tokens or fewer,
        but for a normalizer that shortens the text."""
        return max(len(token) for token in self._backend.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Bytes that do not form UTF-8 become U+FFFD.

        Raises :class:`InvalidParamError` for an id outside the vocabulary.
        """
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise InvalidParamError(f"cannot decode token ids: {exc}", param="token_ids") from exc

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """The vocabulary entry of each id (byte-level tokens look like ``Ġhello``)."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry ``token``, or None."""
        return self._backend.token_to_id(token)

    @property
    def backend_tokenizer(self) -> _BackendTokenizer:
        """The ``tokenizers.Tokenizer`` underneath (transformers' name), for libraries that
        read a vocabulary's encoding, such as the grammar backends. Do not mutate it."""
        return self._backend

    # -- chat ---------------------------------------------------------------------------

    def chat_prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        special_tokens_in_content: bool = False,
        content_tokens: Sequence[str] = (),
        check_rendered: Callable[[str], Any] | None = None,
        **options: Any,
    ) -> list[int]:
        """The token ids of :meth:`apply_chat_template`'s prompt (no BOS/EOS added: the
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
        texts, pattern = self._control_texts, self._control_pattern
        if content_tokens and pattern is not None:
            texts = tuple(t for t in texts if t not in content_tokens)
            pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        if special_tokens_in_content:
            pattern = None
        if pattern is not None:
            chat = normalize_messages(messages)
            nonce = str(secrets.randbelow(10**8))
            marked = _Marker(texts, pattern, nonce)
            chat = marked(chat)
            for name in ("tools", "chat_template_kwargs"):
                if options.get(name) is not None:
                    options = {**options, name: marked(options[name])}
            if marked.count:
                rendered = self.apply_chat_template(chat, add_generation_prompt, **options)
                if check_rendered is not None:
                    check_rendered(rendered)
                return self._encode_marked(rendered, marked)
        rendered = self.apply_chat_template(messages, add_generation_prompt, **options)
        if check_rendered is not None:
            check_rendered(rendered)
        return self.encode(rendered, add_special_tokens=False)

    def _encode_marked(self, rendered: str, marker: _Marker) -> list[int]:
        """Encode a prompt whose request text had its control-token text replaced by
        :class:`_Marker` sentinels: the control tokens left in ``rendered`` are the
        template's. The text between two of them is encoded on its own with special tokens
        split (the backend also encodes the text between added tokens piece by piece), after
        the sentinels in it turn back into their text."""
        encoding = _encode(self._backend, rendered, add_special_tokens=False)
        ids: list[int] = []
        at = 0
        for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            # A control token written by the template (an <unk> for a character the
            # vocabulary lacks is special too, but its text is not its own).
            if token in self._control_ids and self._control_ids[token] in rendered[start:end]:
                ids += self._text_ids(marker.restore(rendered[at:start]), first=at == 0)
                ids.append(token)
                at = end  # past any whitespace the token strips (AddedToken lstrip/rstrip)
        ids += self._text_ids(marker.restore(rendered[at:]), first=at == 0)
        return ids

    def _text_ids(self, text: str, *, first: bool) -> list[int]:
        if not text:
            return []
        first_backend, later_backend = self._text_backends
        backend = first_backend if first else later_backend
        return _encode(backend, text, add_special_tokens=False).ids

    @functools.cached_property
    def _text_backends(self) -> tuple[_BackendTokenizer, _BackendTokenizer]:
        """Copies of the backend that read special-token text as text: one for the text at
        the start of a prompt, one for text after a control token. They differ where a
        Metaspace pre-tokenizer prepends its "▁" to the first piece of the input only
        (``prepend_scheme: "first"``): text after a control token gets none in a whole
        encode, so the second copy prepends never. Built on the first request that needs
        them (a race builds them twice, harmlessly)."""
        source = json.loads(self._backend.to_str())
        first = _BackendTokenizer.from_str(json.dumps(source))
        first.encode_special_tokens = True
        if not _never_prepend(source.get("pre_tokenizer")):
            return first, first
        later = _BackendTokenizer.from_str(json.dumps(source))
        later.encode_special_tokens = True
        return first, later

    @property
    def chat_template(self) -> str | None:
        """The chat template's jinja source, or None when the folder has none."""
        return self._chat_template_source

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template into one prompt string.

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
        template = self._template(chat_template)
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
        chat, tools = self._fit_tools(chat, tools, chat_template or self._chat_template_source)
        variables = {**self._special_tokens, **template_kwargs}
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

    def _template(self, source: str | None) -> jinja2.Template:
        if source is None:
            if self._chat_template is None:
                raise RequestError(
                    f"the model at {str(self._source)!r} has no chat template; "
                    "send a plain prompt (completions) instead of messages",
                    param="messages",
                )
            return self._chat_template
        compiled = self._request_templates.get(source)
        if compiled is None:
            try:
                compiled = _compile_template(source, self._source)
            except CorruptModelError as exc:
                cause = exc.__cause__
                what = ("is not valid jinja" if isinstance(cause, jinja2.TemplateSyntaxError)
                        else f"fails while compiling: {type(cause).__name__}")
                raise InvalidParamError(f"chat_template {what}: {cause}",
                                        param="chat_template") from None
            with self._cache_lock:
                if len(self._request_templates) >= _TEMPLATE_CACHE_SIZE:
                    self._request_templates.pop(next(iter(self._request_templates)))
                self._request_templates[source] = compiled
        return compiled

    def _fit_tools(
        self, chat: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
        source: str | None,
    ) -> tuple[list[dict[str, Any]], Sequence[Mapping[str, Any]] | None]:
        """Messages and tools as this template can take them (see apply_chat_template)."""
        from engine.chat.tools import fallback_messages, parse_tools, template_reads_tools

        reads_tools = self._reads_tools.get(source or "")
        if reads_tools is None:
            reads_tools = template_reads_tools(source)
            with self._cache_lock:
                if len(self._reads_tools) >= 2 * _TEMPLATE_CACHE_SIZE:
                    self._reads_tools.pop(next(iter(self._reads_tools)))
                self._reads_tools[source or ""] = reads_tools
        if reads_tools:
            return chat, tools
        has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in chat)
        if not tools and not has_tool_turns:
            return chat, tools
        return fallback_messages(chat, parse_tools(list(tools) if tools else None),
                                 describe_tools=bool(tools)), None


def _never_prepend(node: Any) -> bool:
    """Turn every Metaspace ``prepend_scheme: "first"`` in a pre-tokenizer's JSON into
    ``"never"``; true if there was one."""
    found = False
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
            found = True
        for value in node.values():
            found = _never_prepend(value) or found
    elif isinstance(node, list):
        for value in node:
            found = _never_prepend(value) or found
    return found


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


def _encode(backend: _BackendTokenizer, text: str, *, add_special_tokens: bool) -> Any:
    """``backend.encode(text)``; a long text through the batch call, which releases the GIL
    while it works (see _RELEASE_GIL_CHARS)."""
    if len(text) > _RELEASE_GIL_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return backend.encode(text, add_special_tokens=add_special_tokens)


# -- reading the folder -----------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, ``{}`` if the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"cannot parse {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise CorruptModelError(f"{str(path)!r} must hold a JSON object, not {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    # A special token is written as a plain string or as a serialized AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    named = {name: _token_content(config.get(name)) for name in _NAMED_SPECIAL_TOKENS}
    return {name: tok for name, tok in named.items() if tok is not None}


def _extra_special_tokens(config: Mapping[str, Any]) -> list[str]:
    # transformers v5 renamed additional_special_tokens to extra_special_tokens, which may
    # also be a dict of named extras (multimodal models: {"image_token": "<image>"}).
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    values = extra.values() if isinstance(extra, Mapping) else extra
    return [tok for tok in map(_token_content, values) if tok is not None]


def _int_ids(value: Any, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CorruptModelError(f"{str(path)!r}: eos_token_id must be an int or a list of ints")
    return tuple(values)


def _find_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CorruptModelError(f"cannot read {str(jinja_file)!r}: {exc}") from exc
    template = config.get("chat_template")
    if template is None:
        template = _read_json(folder / CHAT_TEMPLATE_JSON_FILE).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CorruptModelError(
            f"{str(folder / TOKENIZER_CONFIG_FILE)!r}: chat_template must be a string"
        )
    return template


# -- the jinja environment --------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks.

    transformers tracks the marked spans; rendering only needs the body, unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace()`` that refuses underscore names, closing a sandbox escape."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja's signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace ({name!r})"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & for HTML, which would change the model's prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def template_reads(source: str | None, variable: str) -> bool:
    """Whether a chat template's jinja source reads ``variable`` (``tools``,
    ``reasoning_effort``). Reading the source runs jinja's constant folding, so it goes
    through the bounded sandbox too; a source that does not parse is searched as text."""
    if not source:
        return False
    env = chat_sandbox.BoundedSandbox(extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    try:
        return variable in jinja2.meta.find_undeclared_variables(env.parse(source))
    except Exception:  # a syntax error, or a constant that fails to fold
        return variable in source


def _compile_template(source: str, folder: Path) -> jinja2.Template:
    env = chat_sandbox.BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CorruptModelError(
            f"the chat template of {str(folder)!r} is not valid jinja: {exc} (line {exc.lineno})"
        ) from exc
    except Exception as exc:
        # jinja folds constant expressions while compiling: ``{{ (10 ** 5000) | string }}``
        # raises (Python's int-to-text digit limit) before any message is rendered.
        raise CorruptModelError(
            f"the chat template of {str(folder)!r} fails while compiling: "
            f"{type(exc).__name__}: {exc}") from exc


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
    from engine.chat.tools import check_tool_fields

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
