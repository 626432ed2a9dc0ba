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
