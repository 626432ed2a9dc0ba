"""The tokenizer of a Hugging Face model folder, without transformers.

:class:`Tokenizer` reads ``tokenizer.json`` with the fast ``tokenizers`` library, set up the
way transformers (v5) sets it up, so encode and decode equal ``transformers.AutoTokenizer``
on the same folder while loading in a fraction of the time (importing transformers alone
takes seconds). It also reads and compiles the folder's chat template
(:mod:`engine.models.chat_template`); rendering it for chat messages is the chat layer's
(:mod:`engine.chat.template`), which encodes the rendered prompt through
:meth:`Tokenizer.encode_templated`.

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
  which ``default`` is used), else from ``chat_template.json``. The template sees the named
  special tokens (``bos_token``, ``eos_token``, ...) as variables (:attr:`Tokenizer.special_tokens`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _BackendTokenizer

from engine.errors import CorruptModelError, InvalidParamError, ModelNotFoundError
from engine.models.chat_template import compile_model_template

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The slow GPT-2/RoBERTa format some repositories still ship alone (facebook/opt-*).
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
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

# Fill-in-the-middle markers (prefix, suffix, middle), one family per convention: Qwen2.5-
# Coder's; StarCoder's and SmolLM's; SantaCoder's. A model trained on one of them reads
# ``<prefix>{before}<suffix>{after}<middle>`` and writes what goes between.
FIM_TOKEN_FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
)

# Texts longer than this are encoded through the backend's batch call, which releases the
# GIL while it works: a plain encode holds it throughout (measured: 17 s for 3.7 MB of
# text, during which no other thread, the event loop's included, ran at all). Shorter
# texts take under a millisecond either way.
_RELEASE_GIL_CHARS = 4096


class Tokenizer:
    """Encode and decode text for one model, and hold its chat template; build it with
    :meth:`from_folder`.

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
        self._chat_template = (compile_model_template(chat_template, source)
                               if chat_template else None)

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
        self.added_token_ids: frozenset[int] = frozenset(backend.get_added_tokens_decoder())
        """Ids of every added token, special or not (``<|im_start|>``, ``<think>``...)."""
        # The control tokens a message's text must never become (every special added token,
        # <|im_start|>, <|eot_id|>, [INST]...).
        control = {tok.content: i for i, tok in backend.get_added_tokens_decoder().items()
                   if tok.special and tok.content}
        self._control_ids: dict[int, str] = {i: text for text, i in control.items()}
        self.control_tokens: tuple[str, ...] = (
            tuple(sorted(control, key=len, reverse=True))
            if not backend.encode_special_tokens else ())
        """The texts a prompt's text could form control tokens from: every special added
        token (``<|im_start|>``, ``<|eot_id|>``, ``[INST]``...), longest first (so a regex
        of them prefers the longest); empty when the config splits special tokens anyway
        (text can never form one)."""

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path, *,
                    generation_folder: str | Path | None = None) -> Tokenizer:
        """Load the tokenizer of the Hugging Face model folder ``path``.

        Needs ``tokenizer.json`` (or a byte-level BPE's ``vocab.json`` and ``merges.txt``,
        GPT-2's and OPT's slow format); ``tokenizer_config.json``, ``generation_config.json`` and
        the chat template files are optional. ``generation_folder`` (default ``path``) is
        where ``generation_config.json`` is read: the model's folder when the tokenizer
        comes from another (``--tokenizer``), whose sampling defaults are not the model's.
        Raises :class:`ModelNotFoundError` when the
        folder or ``tokenizer.json`` is missing and :class:`CorruptModelError` naming the
        file when one cannot be parsed.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ModelNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
        tokenizer_file = folder / TOKENIZER_FILE
        config = _read_json(folder / TOKENIZER_CONFIG_FILE)
        if tokenizer_file.is_file():
            try:
                backend = _BackendTokenizer.from_file(str(tokenizer_file))
            except Exception as exc:  # tokenizers raises a bare Exception on bad JSON or schema
                raise CorruptModelError(f"cannot parse {str(tokenizer_file)!r}: {exc}") from exc
        elif (folder / VOCAB_FILE).is_file() and (folder / MERGES_FILE).is_file():
            config = {**_read_json(folder / SPECIAL_TOKENS_MAP_FILE), **config}
            backend = _byte_level_bpe(folder, config)
        else:
            raise ModelNotFoundError(
                f"{str(tokenizer_file)!r} is missing: a fast tokenizer (tokenizer.json), or a "
                f"byte-level BPE's {VOCAB_FILE} and {MERGES_FILE}, is required"
            )
        # A tokenizer.json may carry truncation and padding settings (sentence-transformers
        # folders pad to a fixed 128): transformers drops them at load, and so does this;
        # lengths are the engine's to check, not the tokenizer's to cut.
        backend.no_truncation()
        backend.no_padding()
        if config.get("split_special_tokens"):
            backend.encode_special_tokens = True
        return cls(
            backend,
            config=config,
            generation_config=_read_json(
                Path(generation_folder if generation_folder is not None else folder)
                / GENERATION_CONFIG_FILE),
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

    @functools.cached_property
    def fim_token_ids(self) -> tuple[int, int, int] | None:
        """The ids of the fill-in-the-middle tokens (prefix, suffix, middle) of the first
        family the vocabulary holds all three of (:data:`FIM_TOKEN_FAMILIES`), or None."""
        for family in FIM_TOKEN_FAMILIES:
            ids = [self._backend.token_to_id(token) for token in family]
            if None not in ids:
                return ids[0], ids[1], ids[2]  # type: ignore[return-value]
        return None

    @property
    def backend_tokenizer(self) -> _BackendTokenizer:
        """The ``tokenizers.Tokenizer`` underneath (transformers' name), for libraries that
        read a vocabulary's encoding, such as the grammar backends. Do not mutate it."""
        return self._backend

    # -- the chat template --------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The chat template's jinja source, or None when the folder has none."""
        return self._chat_template_source

    @property
    def compiled_chat_template(self) -> jinja2.Template | None:
        """The chat template compiled in the bounded sandbox
        (:mod:`engine.models.chat_template`), or None when the folder has none."""
        return self._chat_template

    @property
    def special_tokens(self) -> dict[str, str]:
        """The config's named special tokens (``{"bos_token": "<s>", ...}``), which a chat
        template reads as variables."""
        return dict(self._special_tokens)

    @property
    def folder(self) -> Path:
        """The model folder this tokenizer was read from."""
        return self._source

    def encode_templated(self, rendered: str, restore: Callable[[str], str]) -> list[int]:
        """Token ids of a rendered chat prompt whose request text had its control-token
        text replaced by sentinels before rendering (:mod:`engine.chat.template`): the
        control tokens left in ``rendered`` are the template's. The text between two of
        them is encoded on its own with special tokens split (the backend also encodes the
        text between added tokens piece by piece), after ``restore`` turns the sentinels in
        it back into their text. No BOS/EOS is added: the template writes its own."""
        encoding = _encode(self._backend, rendered, add_special_tokens=False)
        ids: list[int] = []
        at = 0
        for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            # A control token written by the template (an <unk> for a character the
            # vocabulary lacks is special too, but its text is not its own).
            if token in self._control_ids and self._control_ids[token] in rendered[start:end]:
                ids += self._text_ids(restore(rendered[at:start]), first=at == 0)
                ids.append(token)
                at = end  # past any whitespace the token strips (AddedToken lstrip/rstrip)
        ids += self._text_ids(restore(rendered[at:]), first=at == 0)
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


def _encode(backend: _BackendTokenizer, text: str, *, add_special_tokens: bool) -> Any:
    """``backend.encode(text)``; a long text through the batch call, which releases the GIL
    while it works (see _RELEASE_GIL_CHARS)."""
    if len(text) > _RELEASE_GIL_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return backend.encode(text, add_special_tokens=add_special_tokens)


# -- reading the folder -----------------------------------------------------------------


def _byte_level_bpe(folder: Path, config: Mapping[str, Any]) -> _BackendTokenizer:
    """The fast tokenizer transformers builds from a byte-level BPE's ``vocab.json`` and
    ``merges.txt`` (GPT-2's and OPT's slow format): the same model, pre-tokenizer, decoder
    and post-processor, the config's added tokens and every named special token registered
    as special (so decoding with ``skip_special_tokens`` drops them even where the
    vocabulary has them)."""
    try:
        model = models.BPE.from_file(str(folder / VOCAB_FILE), str(folder / MERGES_FILE),
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False)
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise CorruptModelError(
            f"cannot read {str(folder / VOCAB_FILE)!r} and {MERGES_FILE}: {exc}") from exc
    backend = _BackendTokenizer(model)
    prefix_space = bool(config.get("add_prefix_space", False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    added = config.get("added_tokens_decoder") or {}
    for _, entry in sorted(added.items(), key=lambda item: int(item[0])):
        if isinstance(entry, Mapping) and isinstance(entry.get("content"), str):
            token = AddedToken(entry["content"], special=bool(entry.get("special")),
                               normalized=bool(entry.get("normalized", False)),
                               lstrip=bool(entry.get("lstrip")), rstrip=bool(entry.get("rstrip")),
                               single_word=bool(entry.get("single_word")))
            if token.special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])
    named = [t for t in _named_special_tokens(config).values() if t]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named])
    return backend


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
