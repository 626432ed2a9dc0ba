"""Images through the HTTP server: the official ``openai`` client sends a base64 image to a
tiny LLaVA (engine core in process and in a process of its own), streamed and not, and
the answer is transformers' greedy continuation; each bad image is a 400 naming the part,
with the server answering afterwards."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from tests.http_server import ServerThread
from tests.test_llava import QUESTION, _hf_run, _image, data_url, hf, llava  # noqa: F401

MODEL = "tiny-llava"
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["inprocess", "process"])
def server(llava, request):  # noqa: F811
    import engine.api

    def open_engine():
        return engine.api.open_engine(str(llava), served_model_name=MODEL, dtype="float32",
                                      kv_cache_memory=16 * 2**20, block_size=4,
                                      max_image_pixels=100_000, engine_core=request.param)

    with ServerThread(open_engine) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def test_openai_client_sends_a_base64_image_streamed_and_not(client, hf) -> None:  # noqa: F811
    image = _image(1)
    _, _, new, _ = _hf_run(hf, [image])
    expected = hf[1].tokenizer.decode(new[:MAX_TOKENS], skip_special_tokens=True)
    args = dict(model=MODEL, messages=_messages(data_url(image)), temperature=0,
                max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**args)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(_hf_run(hf, [image])[0])
    chunks = client.chat.completions.create(**args, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


@pytest.mark.parametrize("case", ["corrupt", "bomb", "unsupported", "remote", "too-many-pixels"])
def test_a_bad_image_is_a_400_naming_it_and_the_server_serves_on(server, client, case) -> None:
    good = io.BytesIO()
    _image(2).save(good, format="PNG")
    if case == "corrupt":
        url = "data:image/png;base64," + base64.b64encode(good.getvalue()[:50]).decode()
    elif case == "bomb":
        bomb = io.BytesIO()
        Image.new("1", (8000, 8000)).save(bomb, format="PNG")  # 64M pixels in a few KB
        url = "data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode()
    elif case == "unsupported":
        bmp = io.BytesIO()
        _image(2).save(bmp, format="BMP")
        url = "data:image/bmp;base64," + base64.b64encode(bmp.getvalue()).decode()
    elif case == "remote":
        url = "http://127.0.0.1:9/cat.png"
    else:
        url = data_url(_image(2, size=(400, 400)))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_messages(url), max_tokens=2)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "messages[0].content[0]"
    ok = client.chat.completions.create(model=MODEL, messages=_messages(data_url(_image(2))),
                                        max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    assert httpx.get(server.base_url + "/health").status_code == 200


# -- images on the other chat surfaces ------------------------------------------------------


def _b64(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def test_tokenize_counts_an_images_placeholder_tokens(server, hf) -> None:  # noqa: F811
    image = _image(1)
    reply = httpx.post(server.base_url + "/tokenize", json={
        "model": MODEL, "messages": _messages(data_url(image))})
    assert reply.status_code == 200, reply.text
    ids = _hf_run(hf, [image])[0]  # transformers' processor widens the image the same way
    assert reply.json()["tokens"] == ids and reply.json()["count"] == len(ids)


def test_responses_takes_an_input_image(client, hf) -> None:  # noqa: F811
    image = _image(1)
    ids, _, new, _ = _hf_run(hf, [image])
    expected = hf[1].tokenizer.decode(new[:MAX_TOKENS], skip_special_tokens=True)
    content = [{"type": "input_image", "image_url": data_url(image)},
               {"type": "input_text", "text": QUESTION}]
    args = dict(model=MODEL, input=[{"role": "user", "content": content}], temperature=0,
                max_output_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}, store=False)
    reply = client.responses.create(**args)
    assert reply.output_text == expected
    assert reply.usage.input_tokens == len(ids)
    events = client.responses.create(**args, stream=True)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected


def test_messages_take_a_base64_image_block(server, hf) -> None:  # noqa: F811
    import anthropic

    image = _image(1)
    ids, _, new, _ = _hf_run(hf, [image])
    expected = hf[1].tokenizer.decode(new[:MAX_TOKENS], skip_special_tokens=True)
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": _b64(image)}},
               {"type": "text", "text": QUESTION}]
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as claude:
        args = dict(model=MODEL, max_tokens=MAX_TOKENS,
                    messages=[{"role": "user", "content": content}],
                    extra_body={"temperature": 0})
        reply = claude.messages.create(**args)
        assert reply.content[0].text == expected
        assert reply.usage.input_tokens == len(ids)
        counted = claude.messages.count_tokens(model=MODEL, messages=args["messages"])
        assert counted.input_tokens == reply.usage.input_tokens
        # A system prompt moves the chat messages one on; the error still names the block.
        bad = [{"type": "text", "text": "look"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": _b64(image)[:40]}}]
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model=MODEL, max_tokens=2, system="Be brief.",
                                   messages=[{"role": "user", "content": bad}])
        assert "messages[0].content[1]" in info.value.message
        assert claude.messages.create(**args).content[0].text == expected


def test_responses_name_the_bad_input_image(client) -> None:
    good = data_url(_image(2))
    cases = {"input[0].content[1]": {"type": "input_image",
                                     "image_url": "data:image/png;base64," + _b64(_image(2))[:40]},
             "input[0].content[1].detail": {"type": "input_image", "image_url": good,
                                            "detail": "high"},
             "input[0].content[1].file_id": {"type": "input_image", "file_id": "file-1"}}
    for param, part in cases.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, max_output_tokens=2, store=False, input=[{
                "role": "user", "content": [{"type": "input_text", "text": "look"}, part]}])
        assert info.value.body["param"] == param, info.value.body


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    import engine.api
    from engine.models.testing import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("text-only"), "llama")

    def open_engine():
        return engine.api.open_engine(str(folder), served_model_name="text", dtype="float32",
                                      kv_cache_memory=4 * 2**20)

    with ServerThread(open_engine) as srv:
        yield srv


def test_an_image_to_a_text_only_model_is_a_400_naming_it_on_every_surface(text_server) -> None:
    url, data = data_url(_image(0)), _b64(_image(0))
    chat = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    calls = {
        "/v1/chat/completions": ({"messages": chat, "max_tokens": 2}, "messages[0].content[1]"),
        "/tokenize": ({"messages": chat}, "messages[0].content[1]"),
        "/v1/responses": ({"max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": url}]}]}, "input[0].content[1]"),
        "/v1/messages": ({"max_tokens": 2, "system": "Be brief.", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, {
                "type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": data}}]}]}, "messages[0].content[1]"),
    }
    for route, (body, param) in calls.items():
        reply = httpx.post(text_server.base_url + route, json={"model": "text", **body})
        assert reply.status_code == 400, (route, reply.text)
        error = reply.json()["error"]
        assert "takes text only" in error["message"] and param in error["message"], route
        if route != "/v1/messages":  # Anthropic's error body has no param
            assert error["param"] == param, route
    ok = httpx.post(text_server.base_url + "/v1/chat/completions", json={
        "model": "text", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200
