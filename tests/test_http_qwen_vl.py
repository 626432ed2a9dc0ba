"""A tiny Qwen2-VL through the HTTP server: the official ``openai`` client sends base64
images (one, then two of different sizes) and the answer, streamed and not, is
transformers' greedy continuation on its own processor's output; an image the model's
processor refuses is a 400 naming the part, and the server serves on."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.http_server import ServerThread
from tests.test_llava import data_url
from tests.test_qwen_vl import IMAGES, QUESTION, _image, hf_model, hf_run, write_folder

MODEL = "tiny-qwen2-vl"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("tiny-qwen2-vl"), "qwen2_vl")


@pytest.fixture(scope="module")
def server(folder):
    import engine.api

    def open_engine():
        return engine.api.open_engine(str(folder), served_model_name=MODEL, dtype="float32",
                                      kv_cache_memory=16 * 2**20, block_size=4)

    with ServerThread(open_engine) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _messages(images: list) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.mark.parametrize("num_images", [1, 2])
def test_openai_client_sends_base64_images_streamed_and_not(folder, client, num_images) -> None:
    hf = hf_model(folder)
    images = IMAGES[:num_images]
    ids, _, new, _ = hf_run(hf, images, new_tokens=MAX_TOKENS)
    expected = hf[1].tokenizer.decode(new, skip_special_tokens=True)
    args = dict(model=MODEL, messages=_messages(images), temperature=0, max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**args)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids)
    chunks = client.chat.completions.create(**args, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_an_image_the_processor_refuses_is_a_400_and_the_server_serves_on(server, client) -> None:
    with pytest.raises(openai.BadRequestError) as info:  # aspect ratio over 200
        client.chat.completions.create(model=MODEL, messages=_messages([_image(2, size=(402, 2))]),
                                       max_tokens=2)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "messages[0].content[0]"
    ok = client.chat.completions.create(model=MODEL, messages=_messages([IMAGES[0]]), max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_tokenize_and_responses_take_qwen_images(folder, server, client) -> None:
    """/tokenize widens each image to its own grid's placeholders, as the processor does;
    /v1/responses answers an input_image as transformers."""
    hf = hf_model(folder)
    ids, _, new, _ = hf_run(hf, IMAGES, new_tokens=MAX_TOKENS)
    reply = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "messages": _messages(IMAGES)})
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == ids
    ids, _, new, _ = hf_run(hf, IMAGES[:1], new_tokens=MAX_TOKENS)
    content = [{"type": "input_image", "image_url": data_url(IMAGES[0])},
               {"type": "input_text", "text": QUESTION}]
    answer = client.responses.create(model=MODEL, input=[{"role": "user", "content": content}],
                                     temperature=0, max_output_tokens=MAX_TOKENS, store=False,
                                     extra_body={"ignore_eos": True})
    assert answer.output_text == hf[1].tokenizer.decode(new, skip_special_tokens=True)
    assert answer.usage.input_tokens == len(ids)


def test_a_requests_mm_processor_kwargs_reach_the_image_processor(folder, server, client) -> None:
    """vLLM's per-request mm_processor_kwargs over HTTP: the answer and the count are
    transformers' with a processor built with the same pixel budget."""
    from transformers import AutoImageProcessor

    model, processor = hf_model(folder)
    budget = {"min_pixels": 64, "max_pixels": 16 * 16}
    small = type(processor)(image_processor=AutoImageProcessor.from_pretrained(folder, **budget),
                            tokenizer=processor.tokenizer, chat_template=processor.chat_template)
    ids, _, new, _ = hf_run((model, small), IMAGES[:1], new_tokens=MAX_TOKENS)
    reply = client.chat.completions.create(
        model=MODEL, messages=_messages(IMAGES[:1]), temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True, "mm_processor_kwargs": budget})
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == processor.tokenizer.decode(new, skip_special_tokens=True)
    counted = httpx.post(server.base_url + "/tokenize", json={
        "model": MODEL, "messages": _messages(IMAGES[:1]), "mm_processor_kwargs": budget}).json()
    assert counted["tokens"] == ids
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_messages(IMAGES[:1]), max_tokens=1,
                                       extra_body={"mm_processor_kwargs": {"size": 3}})
    assert info.value.body["param"] == "mm_processor_kwargs"
