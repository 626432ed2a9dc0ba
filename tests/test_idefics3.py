"""SmolVLM and Idefics3 (a SigLIP tower over each tile of an image, a pixel-shuffle
connector, a Llama decoder) through the engine, against transformers'
``SmolVLMForConditionalGeneration`` / ``Idefics3ForConditionalGeneration`` on the output of
its own ``Idefics3Processor`` (the image processor cuts the tiles, the processor writes
their frame in the prompt).

The engine gets chat messages with image parts; transformers gets the same conversation
through the processor's ``apply_chat_template`` and the processor. Checked: the expanded
prompt ids, the log-softmax at every prompt position and the greedy tokens with their full
distributions, for one image cut into tiles, two images of different tilings in one
message, a small image that is one tile, and an image cut across chunked-prefill chunks;
the OpenAI client behind an engine-core process; refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from engine.errors import InvalidParamError
from engine.models.testing_idefics3 import write_tiny_idefics3
from tests.engine_helpers import greedy, token_ids, wait_idle
from tests.test_llava import data_url
from tests.vlm_checks import (
    assert_matches_transformers,
    assert_served_like_transformers,
    hf_forward_and_generate,
    tokens_with_adapter,
    write_vlm_adapter,
)

NEW_TOKENS = 16
QUESTION = "What is in the picture? Describe it."


def _image(seed: int, size: tuple[int, int]):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


# 2 x 2 tiles and the global one; 1 x 2 tiles and the global one; a 40 x 30 image (its
# longest edge resized to 96: 2 x 2 tiles too).
WIDE, TALL = _image(0, (90, 80)), _image(1, (120, 50))


def messages(images: list, question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


@pytest.fixture(scope="module", params=["smolvlm", "idefics3"])
def folder(tmp_path_factory, request):
    return write_tiny_idefics3(tmp_path_factory.mktemp(request.param), request.param)


def hf_model(folder):
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoTokenizer,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        SmolVLMForConditionalGeneration,
    )

    cfg = AutoConfig.from_pretrained(folder)
    cls = SmolVLMForConditionalGeneration if cfg.model_type == "smolvlm" else Idefics3ForConditionalGeneration
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    side = cfg.vision_config.image_size // cfg.vision_config.patch_size
    processor = Idefics3Processor(image_processor=AutoImageProcessor.from_pretrained(folder),
                                  tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                  image_seq_len=side * side // cfg.scale_factor**2)
    return model, processor


@pytest.fixture(scope="module")
def hf(folder):
    return hf_model(folder)


def hf_run(hf, images: list, question: str = QUESTION, new_tokens: int = NEW_TOKENS):
    model, processor = hf
    conversation = [{"role": "user", "content": [*[{"type": "image"}] * len(images),
                                                 {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[images], return_tensors="pt")
    inputs.pop("mm_token_type_ids", None)
    return hf_forward_and_generate(model, inputs, new_tokens)


def _open(folder, **options):
    defaults = dict(dtype="float32", max_logprobs=-1, block_size=4, kv_cache_memory=8 * 2**20,
                    max_num_seqs=4)
    return engine.open_engine(folder, **(defaults | options))


# Every case on SmolVLM; Idefics3 (the same model under SmolVLM v1's class) on the first.
CASES = [pytest.param("smolvlm", [WIDE], 2048, id="smolvlm-tiles"),
         pytest.param("smolvlm", [WIDE, TALL], 2048, id="smolvlm-two-images"),
         pytest.param("smolvlm", [_image(2, (40, 30))], 2048, id="smolvlm-small-image"),
         pytest.param("smolvlm", [TALL], 12, id="smolvlm-tiles-across-chunks"),
         pytest.param("idefics3", [WIDE, TALL], 2048, id="idefics3-two-images")]


@pytest.mark.parametrize(("folder", "images", "batched"), CASES, indirect=["folder"])
async def test_logits_and_greedy_tokens_match_transformers(folder, hf, images, batched) -> None:
    ids, hf_logprobs, hf_new, hf_steps = hf_run(hf, images)
    pad = hf[0].config.image_token_id
    async with _open(folder, max_num_batched_tokens=batched) as eng:
        stream = await eng.submit(messages(images), greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        if batched < len(ids):  # the chunks really cut a tile's placeholders
            first = ids.index(pad)
            assert first < batched < first + 9
        assert_matches_transformers(outs, hf_logprobs, hf_new, hf_steps)
        await wait_idle(eng)


@pytest.mark.parametrize("folder", ["smolvlm"], indirect=True)
async def test_repeats_hit_the_cache_and_typed_frame_tokens_stay_text(folder, hf) -> None:
    """The same image again is a prefix-cache hit past its tiles (the encoder not run);
    another image shares only the text before it. Frame tokens typed in text stay text."""
    expected = [hf_run(hf, [im])[2] for im in (WIDE, TALL)]
    async with _open(folder, max_num_batched_tokens=2048) as eng:
        outs = []
        for image in (WIDE, TALL, WIDE):
            outs.append(token_ids([o async for o in await eng.submit(messages([image]), greedy(NEW_TOKENS))]))
        runs = eng._parts.runner.encoder_runs
        typed = await eng.submit(messages([], "<fake_token_around_image><global-img><image> hi"), greedy(2))
        async with typed:
            assert len(token_ids([o async for o in typed])) == 2
        assert hf[0].config.image_token_id not in typed.prompt_token_ids
        await wait_idle(eng)
    assert outs == [expected[0], expected[1], expected[0]]
    tiles = [len(hf[1].image_processor(images=[[im]], return_tensors="np")["pixel_values"][0]) for im in (WIDE, TALL)]
    assert runs == sum(tiles)  # each picture's tiles (as its processor cuts them) encoded once


@pytest.mark.parametrize("folder", ["smolvlm"], indirect=True)
async def test_bad_images_are_refused_and_the_engine_serves_on(folder) -> None:
    async with _open(folder) as eng:
        with pytest.raises(InvalidParamError) as info:
            await eng.submit([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "hi"}]}], greedy(2))
        assert info.value.param == "messages[0].content[0]"
        with pytest.raises(InvalidParamError, match="mm_processor_kwargs"):
            await eng.submit(messages([WIDE]), greedy(2), mm_processor_kwargs={"max_pixels": 4096})
        stream = await eng.submit(messages([TALL]), greedy(3))
        async with stream:
            assert len(token_ids([o async for o in stream])) == 3
        await wait_idle(eng)


@pytest.mark.parametrize("folder", ["smolvlm"], indirect=True)
def test_the_openai_client_behind_an_engine_core_process(folder, hf) -> None:
    ids, _, new, _ = hf_run(hf, [WIDE, TALL])
    assert_served_like_transformers(folder, messages([WIDE, TALL]),
                                    hf[1].tokenizer.decode(new, skip_special_tokens=True), len(ids), NEW_TOKENS)


@pytest.mark.parametrize("folder", ["smolvlm"], indirect=True)
async def test_a_lora_adapter_on_the_language_model_answers_images_as_peft(folder, tmp_path) -> None:
    """An adapter peft wrote over SmolVLM's text model (``model.text_model.layers``) gives
    peft's greedy tokens on an image prompt."""
    hf = hf_model(folder)  # a copy of its own: peft wraps it in place
    base = hf_run(hf, [TALL])[2]
    targets = r".*text_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
    want = hf_run((write_vlm_adapter(hf[0], tmp_path / "lm", targets), hf[1]), [TALL])[2]
    assert want != base
    got = await tokens_with_adapter(_open(folder, enable_lora=True, lora_modules=[f"lm={tmp_path / 'lm'}"]),
                                    messages([TALL]), NEW_TOKENS)
    assert got == {None: base, "lm": want}


@pytest.mark.parametrize("folder", ["smolvlm"], indirect=True)
async def test_tiles_travel_as_8_bit_pixels_the_model_normalises_as_the_processor(folder, hf) -> None:
    """Each tile is carried as its 8-bit pixels (a quarter of float32's bytes, so a photo's
    tiles fit a request's pixel budget); the model's pixels are the processor's own."""
    from engine.multimodal import RawImage
    from engine.pixels import unpack

    _, processor = hf
    want = processor.image_processor(images=[[WIDE]], return_tensors="np")["pixel_values"][0]
    async with _open(folder) as eng:
        prep = eng._parts.images
        ids = [*eng.tokenizer.encode("look: ", add_special_tokens=False), prep.image_token_id]
        _, tiles = prep.expand(ids, [RawImage("messages[0].content[0]", WIDE)])
        await wait_idle(eng)
    assert len(tiles) == len(want) == 5
    for tile, expected in zip(tiles, want, strict=True):
        assert len(tile.pixels) < expected.size + 64  # one byte a value, and a header
        torch.testing.assert_close(unpack(tile.pixels, tile.shape), torch.from_numpy(expected),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("folder", ["idefics3"], indirect=True)
def test_llm_takes_vllms_offline_smolvlm_prompt(folder, hf) -> None:
    """vLLM's offline form: the template's text with ``<image>`` and the picture in
    ``multi_modal_data``; and ``LLM.chat``."""
    _, processor = hf
    ids, _, new, _ = hf_run(hf, [TALL], new_tokens=4)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    with engine.LLM(folder, dtype="float32", kv_cache_memory=8 * 2**20) as llm:
        generated = llm.generate({"prompt": text, "multi_modal_data": {"image": TALL}}, greedy(4),
                                 use_tqdm=False)
        chat = llm.chat(messages([TALL]), greedy(4), use_tqdm=False)
    for out in (generated[0], chat[0]):
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == new
