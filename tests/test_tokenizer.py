"""engine.models.tokenizer.Tokenizer encodes and decodes, and engine.chat.template renders its
chats, like transformers.

The oracle is ``transformers.AutoTokenizer`` loaded from the same folder: the tiny test
model's byte-level BPE and the real SmolLM2 tokenizer converted from its GGUF.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from text_fixtures import TEXTS, smollm2_folder, tiny_folder

from engine.chat.template import apply_chat_template
from engine.errors import (
    CorruptModelError,
    InvalidParamError,
    ModelNotFoundError,
    RequestError,
)
from engine.models.tokenizer import Tokenizer


@functools.cache
def _ours(folder: Path) -> Tokenizer:
    # Loading SmolLM2's tokenizer.json takes a few hundred ms; share one per folder.
    return Tokenizer.from_folder(folder)


@functools.cache
def _hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_folder(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_folder(tmp_path_factory.getbasetemp())


@pytest.fixture(params=["tiny", "smollm2"])
def folder(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("tiny_dir" if request.param == "tiny" else "smol_dir")


@pytest.fixture
def pair(folder: Path) -> tuple[Tokenizer, Any]:
    """(ours, transformers') for the same folder."""
    return _ours(folder), _hf_tokenizer(folder)


def _variant(src: Path, dst: Path, *, config: dict[str, Any] | None = None) -> Path:
    """A copy of the tokenizer files of ``src`` with tokenizer_config.json keys changed."""
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    if config is not None:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        cfg.update(config)
        cfg = {k: v for k, v in cfg.items() if v is not None}
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Now in words, with emoji 🎉 and 日本語."},
    ],
    [{"role": "user", "content": "  spaces\n\nand\ttabs  "}],
    [{"role": "user", "content": ""}],
]


# -- encode / decode --------------------------------------------------------------------


def test_encode_equals_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(
                text, add_special_tokens=add
            ), (text, add)


def test_decode_equals_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    rng = random.Random(0)
    sequences = [hf.encode(text) for text in TEXTS]
    # Random ids split multi-byte characters and mix in special tokens.
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 30))] for _ in range(50)]
    sequences.append(sorted(ours.skipped_special_ids) + hf.encode("after specials"))
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)


def test_decode_round_trips_text(pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = pair
    for text in TEXTS:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_convert_ids_to_tokens_equals_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    ids = [i for text in TEXTS for i in hf.encode(text)] + list(ours.all_special_ids)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_special_ids_equal_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert list(ours.all_special_ids) == hf.all_special_ids
    assert ours.vocab_size == len(hf)
    assert hf.eos_token_id in ours.eos_token_ids


def test_decode_rejects_negative_id(pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = pair
    with pytest.raises(InvalidParamError):
        ours.decode([-1])


def test_encode_rejects_non_string(tiny_dir: Path) -> None:
    with pytest.raises(InvalidParamError) as info:
        Tokenizer.from_folder(tiny_dir).encode([1, 2])  # type: ignore[arg-type]
    assert info.value.param == "prompt"


# -- special tokens and BOS ------------------------------------------------------------


def test_eos_token_ids_add_generation_config_ids(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _variant(tiny_dir, tmp_path / "t")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_ids == frozenset({2, 7})
    assert tok.eos_token_id == 2


def test_eos_token_ids_without_generation_config(smol_dir: Path) -> None:
    # transformers' save_pretrained writes no generation_config.json for a tokenizer.
    assert not (smol_dir / "generation_config.json").exists()
    assert _ours(smol_dir).eos_token_ids == frozenset({2})  # <|im_end|>


def test_missing_named_special_token_is_added_like_transformers(
    tiny_dir: Path, tmp_path: Path
) -> None:
    folder = _variant(tiny_dir, tmp_path / "t", config={"pad_token": "<pad>"})
    ours, hf = Tokenizer.from_folder(folder), _hf_tokenizer(folder)
    assert ours.pad_token_id == hf.pad_token_id == ours.vocab_size - 1
    assert ours.encode("a<pad>b") == hf.encode("a<pad>b")
    assert ours.decode(ours.encode("a<pad>b")) == "ab"


def test_bos_added_when_tokenizer_json_post_processor_adds_it(
    tiny_dir: Path, tmp_path: Path
) -> None:
    folder = _variant(tiny_dir, tmp_path / "t", config={"add_bos_token": None})
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
        },
    }
    (folder / "tokenizer.json").write_text(json.dumps(data))
    ours, hf = Tokenizer.from_folder(folder), _hf_tokenizer(folder)
    assert ours.encode("Hello") == hf.encode("Hello")
    assert ours.encode("Hello")[0] == ours.bos_token_id == 0
    assert ours.encode("Hello", add_special_tokens=False) == hf.encode(
        "Hello", add_special_tokens=False
    )


def test_add_bos_token_flag_in_config_adds_bos(tiny_dir: Path, tmp_path: Path) -> None:
    # Deliberately unlike transformers v5 (which ignores the flag next to a tokenizer.json):
    # the engine's GGUF conversion states BOS only through this flag.
    folder = _variant(tiny_dir, tmp_path / "t", config={"add_bos_token": True})
    tok = Tokenizer.from_folder(folder)
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == [tok.bos_token_id, *plain]


# -- chat template ----------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    pair: tuple[Tokenizer, Any], add_generation_prompt: bool
) -> None:
    ours, hf = pair
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert apply_chat_template(ours, messages, add_generation_prompt) == expected


def test_smollm2_template_comes_from_chat_template_jinja(smol_dir: Path) -> None:
    assert (smol_dir / "chat_template.jinja").exists()
    prompt = apply_chat_template(Tokenizer.from_folder(smol_dir),
        [{"role": "user", "content": "hi"}]
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_text_parts_are_joined_with_newlines(tiny_dir: Path) -> None:
    tok = Tokenizer.from_folder(tiny_dir)
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert apply_chat_template(tok, [{"role": "user", "content": parts}]) == (
        apply_chat_template(tok, [{"role": "user", "content": "first\nsecond"}])
    )


# A template that uses every environment feature real templates rely on: trim/lstrip of
# blocks, loop controls, namespace(), a tojson that leaves <>& alone, strftime_now,
# raise_exception, the {% generation %} block and the special-token variables.
FEATURE_TEMPLATE = """
{%- set ns = namespace(count=0) -%}
{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'tool' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if message.role == 'assistant' %}
        {% generation %}{{ message.content | tojson }}{% endgeneration %}
    {% else %}
        [{{ message.role }}] {{ message.content }}
    {% endif %}
    {% if loop.index >= 4 %}{% break %}{% endif %}
{% endfor %}
count={{ ns.count }} year={{ strftime_now('%Y') | length }} tools={{ tools | tojson }}
{% if add_generation_prompt %}{{ eos_token }}{% endif %}
{% if messages[0].role == 'assistant' %}{{ raise_exception('must not start with assistant') }}{% endif %}
"""


def test_template_environment_renders_like_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _variant(tiny_dir, tmp_path / "t", config={"chat_template": FEATURE_TEMPLATE})
    ours, hf = Tokenizer.from_folder(folder), _hf_tokenizer(folder)
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": 'a <b> & "c" é'},
        {"role": "tool", "tool_call_id": "call_1", "content": "skipped"},
        {"role": "assistant", "content": "<tag> & 😀"},
        {"role": "user", "content": "u2"},
        {"role": "user", "content": "never reached"},
    ]
    tools = [{"type": "function", "function": {"name": "f<x>"}}]
    expected = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert apply_chat_template(ours, messages, tools=tools) == expected
    assert '"<tag> & 😀"' in expected and "never reached" not in expected


def test_template_raise_exception_is_invalid_param(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _variant(tiny_dir, tmp_path / "t", config={"chat_template": FEATURE_TEMPLATE})
    with pytest.raises(InvalidParamError, match="must not start with assistant") as info:
        apply_chat_template(Tokenizer.from_folder(folder), [{"role": "assistant", "content": "x"}])
    assert info.value.param == "messages"


def test_a_template_that_fails_on_the_messages_is_their_invalid_param(tiny_dir: Path, tmp_path: Path) -> None:
    # A template bug hit by some input (here: adding a number to the content string)
    # raises TypeError inside jinja; it must be this request's error, not the engine's.
    template = "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    folder = _variant(tiny_dir, tmp_path / "t", config={"chat_template": template})
    with pytest.raises(InvalidParamError, match="TypeError") as info:
        apply_chat_template(Tokenizer.from_folder(folder), [{"role": "user", "content": "x"}])
    assert info.value.param == "messages"


def test_named_chat_templates_use_default_like_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": "{% for m in messages %}D:{{ m.content }}{% endfor %}"},
        {"name": "rag", "template": "R"},
    ]
    folder = _variant(tiny_dir, tmp_path / "t", config={"chat_template": named})
    messages = [{"role": "user", "content": "x"}]
    expected = _hf_tokenizer(folder).apply_chat_template(messages, tokenize=False)
    assert apply_chat_template(Tokenizer.from_folder(folder), messages) == expected == "D:x"


def test_folder_without_chat_template_raises_request_error(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _variant(tiny_dir, tmp_path / "t", config={"chat_template": None})
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template is None
    with pytest.raises(RequestError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hello", "messages"),
        (None, "messages"),
        (["hello"], "messages[0]"),
        ([{"content": "no role"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": 3, "content": "x"}], "messages[1].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 42}], "messages[0].content"),
        ([{"role": "user", "content": {"type": "text", "text": "x"}}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content"),
        ([{"role": "user", "content": ["bare string part"]}], "messages[0].content"),
    ],
)
def test_bad_messages_raise_invalid_param_naming_the_field(
    tiny_dir: Path, messages: Any, param: str
) -> None:
    with pytest.raises(InvalidParamError) as info:
        apply_chat_template(Tokenizer.from_folder(tiny_dir), messages)
    assert info.value.param == param


def test_developer_is_the_system_role(tiny_dir: Path) -> None:
    tok = Tokenizer.from_folder(tiny_dir)
    developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert apply_chat_template(tok, developer) == apply_chat_template(tok, system)


def test_assistant_message_may_carry_only_tool_calls(tiny_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m.role }}:{{ m.content | default('-') }};{% endfor %}"
    folder = _variant(tiny_dir, tmp_path / "t", config={"chat_template": template})
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    expected = _hf_tokenizer(folder).apply_chat_template(messages, tokenize=False)
    assert (
        apply_chat_template(Tokenizer.from_folder(folder), messages)
        == expected
        == "user:x;assistant:-;"
    )


# -- load errors ------------------------------------------------------------------------


def test_missing_folder_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Tokenizer.from_folder(tmp_path / "nope")


def test_missing_tokenizer_json_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _variant(tiny_dir, tmp_path / "t")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(folder)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("tokenizer.json", "{not json"),
        ("tokenizer.json", '{"model": {"type": "Nonsense"}}'),
        ("tokenizer_config.json", "{broken"),
        ("tokenizer_config.json", "[1, 2]"),
        ("generation_config.json", "{broken"),
        ("generation_config.json", '{"eos_token_id": "two"}'),
        ("chat_template.jinja", "{% for %}"),
    ],
)
def test_corrupt_file_raises_corrupt_model_naming_it(
    tiny_dir: Path, tmp_path: Path, name: str, content: str
) -> None:
    folder = _variant(tiny_dir, tmp_path / "t")
    (folder / name).write_text(content)
    with pytest.raises(
        CorruptModelError,
        match=name.replace(".", r"\.") if "jinja" not in name else "chat template",
    ):
        Tokenizer.from_folder(folder)


# -- chat-template controls and tools (transformers renders the same template) -------------

from chat_fixtures import ROUND_TRIP, THINK_TEMPLATE, TOOL_TEMPLATE, TOOLS  # noqa: E402


def _decoded_args(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as transformers' callers pass it: arguments as dicts, no None keys."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


def test_tool_template_with_tools_and_history_equals_transformers(
    tiny_dir: Path, tmp_path: Path
) -> None:
    folder = _variant(tiny_dir, tmp_path / "t", config={"chat_template": TOOL_TEMPLATE})
    ours, hf = Tokenizer.from_folder(folder), _hf_tokenizer(folder)
    expected = hf.apply_chat_template(_decoded_args(ROUND_TRIP), tools=TOOLS, tokenize=False,
                                      add_generation_prompt=True)
    got = apply_chat_template(ours, ROUND_TRIP, tools=TOOLS)
    assert got == expected
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in got  # decoded, not a string


def test_request_template_kwargs_and_prefill_equal_transformers(tiny_dir: Path) -> None:
    ours, hf = Tokenizer.from_folder(tiny_dir), _hf_tokenizer(tiny_dir)
    chat = [{"role": "user", "content": "2+2?"}]
    for kwargs in ({}, {"enable_thinking": False}):
        assert apply_chat_template(ours, chat, chat_template=THINK_TEMPLATE, **kwargs) == \
            hf.apply_chat_template(chat, chat_template=THINK_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True, **kwargs)
    prefill = [*chat, {"role": "assistant", "content": "The answer is "}]
    got = apply_chat_template(ours, prefill, add_generation_prompt=False,
                                   continue_final_message=True)
    assert got == hf.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert got.endswith("<|im_start|>assistant\nThe answer is ")


def test_template_without_tools_gets_the_fallback_prompt(tiny_dir: Path) -> None:
    from engine.chat.tools import fallback_messages, parse_tools

    ours, hf = Tokenizer.from_folder(tiny_dir), _hf_tokenizer(tiny_dir)
    got = apply_chat_template(ours, ROUND_TRIP, tools=TOOLS)
    rewritten = fallback_messages(_decoded_args(ROUND_TRIP), parse_tools(TOOLS),
                                  describe_tools=True)
    assert got == hf.apply_chat_template(rewritten, tokenize=False, add_generation_prompt=True)
    assert "You can call functions" in got and "<tool_response>\n9 degrees, rain" in got


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"chat_template": "{% if %}"}, "chat_template"),
    ({"messages_extra": None, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ({"tools": [{"type": "function", "function": {"name": "x y"}}]}, "tools[0].function.name"),
])
def test_bad_template_controls_name_the_field(
    tiny_dir: Path, kwargs: dict[str, Any], param: str
) -> None:
    kwargs = {k: v for k, v in kwargs.items() if k != "messages_extra"}
    with pytest.raises(InvalidParamError) as info:
        apply_chat_template(Tokenizer.from_folder(tiny_dir),
            [{"role": "user", "content": "hi"}], **kwargs)
    assert info.value.param == param


def test_reserved_template_kwargs_are_refused(tiny_dir: Path) -> None:
    with pytest.raises(InvalidParamError) as info:
        apply_chat_template(Tokenizer.from_folder(tiny_dir),
            [{"role": "user", "content": "hi"}], chat_template_kwargs={"messages": []})
    assert info.value.param == "chat_template_kwargs"


def test_tool_message_without_call_id_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(InvalidParamError) as info:
        apply_chat_template(Tokenizer.from_folder(tiny_dir),
            [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}])
    assert info.value.param == "messages[1].tool_call_id"


# -- the slow byte-level BPE format (vocab.json + merges.txt, no tokenizer.json) ----------

_SLOW_CONFIGS = {
    # OPT's shape: BOS added on encode, BOS and EOS the same kind of marker, a pad token.
    "opt": {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|im_start|>",
            "unk_token": "<|endoftext|>", "add_bos_token": True, "add_prefix_space": False,
            "errors": "replace", "tokenizer_class": "GPT2Tokenizer"},
    # GPT-2's: nothing added on encode; the special tokens come from special_tokens_map.json.
    "gpt2": {"add_prefix_space": False, "tokenizer_class": "GPT2Tokenizer",
             "model_max_length": 1024},
}


@pytest.mark.parametrize("shape", sorted(_SLOW_CONFIGS))
def test_vocab_and_merges_alone_tokenize_as_transformers(tmp_path: Path, shape: str) -> None:
    import transformers

    fast = json.loads((tiny_folder(tmp_path / "src") / "tokenizer.json").read_text())
    tmp_path = tmp_path / "slow"
    tmp_path.mkdir()
    (tmp_path / "vocab.json").write_text(json.dumps(fast["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in fast["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(_SLOW_CONFIGS[shape]))
    if shape == "gpt2":
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
             "unk_token": "<|endoftext|>"}))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.vocab_size == len(ref)
    assert tok.eos_token_id == ref.eos_token_id and tok.bos_token_id == ref.bos_token_id
    assert sorted(tok.all_special_ids) == sorted(ref.all_special_ids)
    for text in [*TEXTS, "a <|im_end|> inside", ""]:
        ids = ref(text)["input_ids"]
        assert tok.encode(text) == ids, text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), text
