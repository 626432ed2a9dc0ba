"""LLaVA (a CLIP vision tower and projector before the tiny Llama) through the engine,
against transformers' LlavaForConditionalGeneration on its own processor's output.

The tiny model carries LLaVA-1.5's own chat template. The engine gets chat messages with
image parts; transformers gets the same conversation through ``LlavaProcessor``'s
``apply_chat_template`` and the processor. Checked: the expanded prompt ids,
the log-softmax of the logits at every prompt position (``prompt_logprobs`` over the whole
vocabulary) and 24 greedy tokens with their full distributions, for one image, two images
in one message, and an image split across chunked-prefill chunks; then the prefix cache
(same text with another image shares no block, the same image is a hit) and the bad-image
refusals, each a 400-class error with the engine still serving.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

import engine
from engine.errors import InvalidParamError
from engine.models.testing import IMAGE_TOKEN, write_tiny_llava
from tests.engine_helpers import collect, greedy, token_ids, wait_idle
from tests.template_data import LLAVA_1_5, checkpoint_template
from tests.vlm_checks import (
    assert_matches_transformers,
    hf_forward_and_generate,
    tokens_with_adapter,
    write_vlm_adapter,
)

NEW_TOKENS = 24
QUESTION = "What is in the picture? Describe it."


def _image(seed: int, size: tuple[int, int] = (40, 32)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _encoded(image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image, fmt: str = "PNG") -> str:
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(_encoded(image, fmt)).decode()


def _messages(images: list, question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def _hf_text(processor, num_images: int, question: str = QUESTION) -> str:
    """The prompt the processor's own apply_chat_template writes for the conversation
    :func:`_messages` sends the engine (image parts first, then the question)."""
    parts = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": parts}],
                                         add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("tiny-llava"),
                            chat_template=checkpoint_template(LLAVA_1_5))


@pytest.fixture(scope="module")
def hf(llava):
    return _hf_model(llava)


@pytest.fixture(scope="module")
def siglip_llava(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("tiny-llava-siglip"), tower="siglip",
                            chat_template=checkpoint_template(LLAVA_1_5))


@pytest.fixture(scope="module")
def hf_siglip(siglip_llava):
    return _hf_model(siglip_llava, strategy="full", cls=0)


def _hf_model(folder, *, strategy: str = "default", cls: int = 1):
    """transformers' LLaVA and its processor (CLIP: one CLS position the default strategy
    drops; SigLIP: no CLS, every position kept)."""
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # The folder's chat template is the processor's too, as llava-hf's checkpoints ship it.
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=tokenizer,
        patch_size=14, vision_feature_select_strategy=strategy,
        num_additional_image_tokens=cls, image_token=IMAGE_TOKEN,
        chat_template=tokenizer.chat_template)
    return model, processor


def _hf_run(hf, images: list, question: str = QUESTION):
    model, processor = hf
    inputs = processor(text=_hf_text(processor, len(images), question), images=images,
                       return_tensors="pt")
    return hf_forward_and_generate(model, inputs, NEW_TOKENS)


def _open(llava, **options):
    defaults = dict(dtype="float32", max_logprobs=-1, block_size=4, kv_cache_memory=8 * 2**20,
                    max_num_seqs=4)
    return engine.open_engine(llava, **(defaults | options))


_CASES = {"one-image": (1, 2048, None), "two-images": (2, 2048, None),
          "image-across-chunks": (1, 7, None), "two-images-one-encoder-run-a-step": (2, 2048, 4)}


@pytest.mark.parametrize(("tower", "num_images", "batched", "encoder"), [
    pytest.param(tower, *case, id=f"{tower}-{name}")
    for tower in ("clip", "siglip") for name, case in _CASES.items()
    # The encoder budget is the scheduler's, the same for either tower.
    if tower == "clip" or case[2] is None])
async def test_logits_and_greedy_tokens_match_transformers(request, tower, num_images, batched,
                                                          encoder) -> None:
    llava, hf = (request.getfixturevalue(n) for n in (
        ("llava", "hf") if tower == "clip" else ("siglip_llava", "hf_siglip")))
    images = [_image(i) for i in range(num_images)]
    ids, hf_logprobs, hf_new, hf_steps = _hf_run(hf, images)
    async with _open(llava, max_num_batched_tokens=batched,
                     max_num_encoder_input_tokens=encoder) as eng:
        model = eng._parts.runner.model
        batches: list[int] = []  # images per encoder run

        def encode(pixels, _encode=model.encode_images):
            batches.append(pixels.shape[0])
            return _encode(pixels)

        model.encode_images = encode
        stream = await eng.submit(_messages(images), greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        if batched < len(ids):  # the chunks really cut an image's placeholders
            first = ids.index(eng.tokenizer.token_to_id(IMAGE_TOKEN))
            assert first < batched < first + 4
        assert_matches_transformers(outs, hf_logprobs, hf_new, hf_steps)
        # Each image ran through the encoder exactly once, chunk boundary or not.
        assert eng._parts.runner.encoder_runs == num_images
        # The decode steps ran fused (ops/cpu/fused.c), so transformers checks that path too.
        assert eng._parts.runner.model.fused_step.steps >= NEW_TOKENS - 1
        # An encoder budget of one image's 4 placeholder tokens: one image a step.
        assert batches == ([1] * num_images if encoder == 4 else [num_images])
        await wait_idle(eng)


async def test_prefix_cache_keys_blocks_by_image(llava, hf) -> None:
    from PIL import Image

    # Two images this random model answers differently about (most noise images look
    # alike to it: it reads mostly the text).
    a, b = _image(1), Image.new("RGB", (30, 20), (255, 255, 255))
    async with _open(llava, max_num_batched_tokens=2048) as eng:
        first = await collect(eng, _messages([a]), greedy(NEW_TOKENS))
        other = await collect(eng, _messages([b]), greedy(NEW_TOKENS))
        again = await collect(eng, _messages([a]), greedy(NEW_TOKENS))
        runs = eng._parts.runner.encoder_runs
        await wait_idle(eng)
    ids = _hf_run(hf, [a])[0]
    offset = ids.index(hf[0].config.image_token_id)
    usage = [outs[-1].usage for outs in (first, other, again)]
    assert usage[0].cached_tokens == 0
    # Same text, another image: only the blocks wholly before the image are shared, and
    # the answer is b's own (transformers says what it is).
    assert usage[1].cached_tokens == offset // 4 * 4
    assert token_ids(other) == _hf_run(hf, [b])[2] != token_ids(first)
    # The same image again: every full block of the prompt is a hit, the image's included,
    # so its encoder output is not even computed a second time.
    assert usage[2].cached_tokens == (len(ids) - 1) // 4 * 4 > offset + 4
    assert token_ids(again) == token_ids(first)
    assert runs == 2


async def test_images_through_an_engine_core_process_give_transformers_tokens(llava, hf) -> None:
    from PIL import Image

    # The core process gets each image's pixels in the request's frame and encodes them
    # there: the answers are still transformers', and differ by image (the two images
    # test_prefix_cache_keys_blocks_by_image found this random model tells apart).
    a, b = _image(1), Image.new("RGB", (30, 20), (255, 255, 255))
    async with _open(llava, engine_core="process") as eng:
        got = [token_ids(await collect(eng, _messages(images), greedy(NEW_TOKENS)))
               for images in ([a], [b], [a, b])]
    want = [_hf_run(hf, images)[2] for images in ([a], [b], [a, b])]
    assert got == want
    assert got[0] != got[1]


async def test_bad_images_are_refused_and_the_engine_keeps_serving(llava) -> None:
    from PIL import Image

    good = _image(3)
    bomb = io.BytesIO()
    Image.new("1", (6000, 6000)).save(bomb, format="PNG")  # 36M pixels in a few KB
    cases = {
        "corrupt": "data:image/png;base64," + base64.b64encode(_encoded(good)[:60]).decode(),
        "bomb": "data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode(),
        "format": "data:image/gif;base64," + base64.b64encode(_encoded(good, "GIF")).decode(),
        "not-base64": "data:image/png;base64,@@@@",
        "remote": "https://example.com/cat.png",
    }
    async with _open(llava, max_image_pixels=100_000, limit_mm_per_prompt=2) as eng:
        for name, url in cases.items():
            messages = [{"role": "user", "content": [
                {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}]
            with pytest.raises(InvalidParamError) as info:
                await eng.submit(messages, greedy(4))
            assert info.value.param == "messages[0].content[1]", name
        with pytest.raises(InvalidParamError, match="limit-mm-per-prompt"):
            await eng.submit(_messages([good, good, good]), greedy(4))
        with pytest.raises(InvalidParamError, match="over the 100000-pixel budget"):
            await eng.submit(_messages([_image(4, size=(400, 300))]), greedy(4))
        # The embedded API also takes bytes and PIL images as parts.
        for data in (_encoded(good, "JPEG"), _encoded(good, "WEBP"), good):
            parts = [{"type": "image", "image": data}, {"type": "text", "text": QUESTION}]
            outs = await collect(eng, [{"role": "user", "content": parts}], greedy(4))
            assert len(token_ids(outs)) == 4
        await wait_idle(eng)


async def test_a_text_only_model_refuses_images(tmp_path) -> None:
    from engine.models.testing import write_tiny_model

    folder = write_tiny_model(tmp_path / "text", "llama")
    async with engine.open_engine(folder, dtype="float32", kv_cache_memory=4 * 2**20) as eng:
        with pytest.raises(InvalidParamError, match="takes text only") as info:
            await eng.submit(_messages([_image(0)]), greedy(4))
        assert info.value.param == "messages[0].content[0]"
        assert len(token_ids(await collect(eng, "Hello", greedy(3)))) == 3


async def test_the_image_token_is_the_engines_own_and_a_clients_stays_text(llava) -> None:
    """Image parts become the model's image token, which stays a token though message text
    never becomes a control token (issue 28): one image gives its placeholder run. The
    same token written as text by the client, with no image, stays text."""
    async with _open(llava) as eng:
        image_id = eng.tokenizer.token_to_id(IMAGE_TOKEN)
        stream = await eng.submit(_messages([_image(5)]), greedy(1))
        async with stream:
            assert stream.prompt_token_ids.count(image_id) == 4  # TINY_IMAGE_SIZE's 2 x 2
        text = [{"role": "user", "content": f"{IMAGE_TOKEN} {QUESTION}"}]
        stream = await eng.submit(text, greedy(1))
        async with stream:
            assert image_id not in stream.prompt_token_ids
        await wait_idle(eng)


async def test_a_request_with_more_pixel_bytes_than_a_frame_share_is_refused(llava, monkeypatch) -> None:
    from engine.core import admission

    async with _open(llava) as eng:
        one = len(eng._parts.images.pixels(_raw(_image(0)))[0])
        monkeypatch.setattr(admission, "MAX_IMAGE_BYTES", 2 * one)
        with pytest.raises(InvalidParamError, match="bytes of pixels") as info:
            await eng.submit(_messages([_image(0)]), greedy(2, n=3))
        assert info.value.param == "messages"
        assert len(token_ids(await collect(eng, _messages([_image(0)]), greedy(2, n=2)), 1)) == 2
        await wait_idle(eng)


async def test_a_batch_too_large_for_one_frame_goes_as_several_in_order() -> None:
    import trio.testing

    from engine.messages import ImageInput
    from engine.process import wire as corewire

    left, right = trio.testing.memory_stream_pair()
    sender, receiver = corewire.FrameStream(left, max_frame_bytes=3000), corewire.FrameStream(right)
    batch = tuple(ImageInput(i, 4, i, bytes([i]) * 1000, (1, 1000)) for i in range(5))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send, batch)
        got: list = []
        while len(got) < len(batch):
            got.extend(await receiver.receive())
    assert tuple(got) == batch and receiver.frames_received > 1
    with pytest.raises(corewire.WireError):
        await sender.send((ImageInput(0, 4, 0, b"x" * 4000, (1, 4000)),))


def _raw(image):
    from engine.multimodal import RawImage

    return RawImage("messages[0].content[0]", image)


@pytest.fixture
def image_host():
    """A loopback HTTP server: /cat.png an image, /moved a redirect to it, else 404."""
    import http.server
    import threading
    import time

    png = _encoded(_image(5))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(png)
            elif self.path == "/slow":  # drips the image: each piece in time, not the whole
                self.send_response(200)
                self.end_headers()
                for at in range(0, 120, 40):
                    self.wfile.write(png[at : at + 40])
                    self.wfile.flush()
                    time.sleep(0.3)
            elif self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", png
    server.shutdown()
    server.server_close()
    thread.join()


async def test_an_allowed_hosts_image_url_is_fetched_without_redirects(
        llava, image_host, monkeypatch) -> None:
    from engine import multimodal

    base, png = image_host

    def ask(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": QUESTION}]}]

    async with _open(llava, allowed_media_domains="127.0.0.1") as eng:
        fetched = await collect(eng, ask(base + "/cat.png"), greedy(8))
        inline = await collect(eng, ask("data:image/png;base64," + base64.b64encode(png).decode()),
                               greedy(8))
        assert token_ids(fetched) == token_ids(inline)
        for path, reason in (("/moved", "HTTP 302"), ("/missing.png", "HTTP 404")):
            with pytest.raises(InvalidParamError, match=reason) as info:
                await eng.submit(ask(base + path), greedy(2))
            assert info.value.param == "messages[0].content[0]"
        monkeypatch.setattr(multimodal, "FETCH_TIMEOUT_SECONDS", 0.5)
        with pytest.raises(InvalidParamError, match="took over 0.5 s"):
            await eng.submit(ask(base + "/slow"), greedy(2))
        monkeypatch.setattr(multimodal, "FETCH_MAX_BYTES", len(png) - 1)
        with pytest.raises(InvalidParamError, match=f"over {len(png) - 1} bytes"):
            await eng.submit(ask(base + "/cat.png"), greedy(2))
        with pytest.raises(InvalidParamError, match="not allowed"):
            await eng.submit(ask(base.replace("127.0.0.1", "localhost") + "/cat.png"), greedy(2))
        await wait_idle(eng)


async def test_a_lora_adapter_on_the_language_model_answers_images_as_peft(llava, tmp_path) -> None:
    """An adapter peft wrote over LLaVA's Llama gives peft's greedy tokens on an image
    prompt (the tower and projector are not targets)."""
    hf = _hf_model(llava)  # a copy of its own: peft wraps it in place
    images = [_image(0)]
    base = _hf_run(hf, images)[2]
    want = _hf_run((write_vlm_adapter(hf[0], tmp_path / "lm"), hf[1]), images)[2]
    assert want != base
    got = await tokens_with_adapter(_open(llava, enable_lora=True, lora_modules=[f"lm={tmp_path / 'lm'}"]),
                                    _messages(images), NEW_TOKENS)
    assert got == {None: base, "lm": want}
