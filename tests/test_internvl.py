"""InternVL (InternViT over each tile and a thumbnail, pixel shuffle and projector, a Qwen2
or Qwen3 decoder) through the engine, against transformers'
``InternVLForConditionalGeneration`` on the output of its own ``InternVLProcessor``.

Checked: the expanded prompt ids (``<img>``, the tiles' placeholders, ``</img>``), the
log-softmax at every prompt position and the greedy tokens with their full distributions,
for an image cropped into tiles and a thumbnail, two images of different crops, a small
image that is one tile, and an image cut across chunked-prefill chunks; repeats hitting
the prefix cache; the OpenAI client behind an engine-core process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from engine.errors import InvalidParamError
from engine.models.testing_internvl import write_tiny_internvl
from tests.engine_helpers import greedy, token_ids, wait_idle
from tests.test_llava import data_url
from tests.vlm_checks import (
    assert_matches_transformers,
    assert_served_like_transformers,
    hf_forward_and_generate,
    image_only,
)

NEW_TOKENS = 16
QUESTION = "What is in the picture? Describe it."


def _image(seed: int, size: tuple[int, int]):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


# 2 x 1 tiles and the thumbnail; 2 x 2 and the thumbnail; one tile.
WIDE, SQUARE, SMALL = _image(0, (100, 50)), _image(1, (90, 80)), _image(2, (20, 24))


def messages(images: list, question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def folder(tmp_path_factory, request):
    return write_tiny_internvl(tmp_path_factory.mktemp(f"internvl-{request.param}"), text_arch=request.param)


def hf_model(folder, image_seq_length: int = 4):
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        InternVLForConditionalGeneration,
        InternVLProcessor,
    )

    ImageOnlyProcessor = image_only(InternVLProcessor)  # noqa: N806
    model = InternVLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = ImageOnlyProcessor(image_processor=AutoImageProcessor.from_pretrained(folder),
                                   tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                   image_seq_length=image_seq_length)
    return model, processor


@pytest.fixture(scope="module")
def hf(folder):
    return hf_model(folder)


def hf_run(hf, images: list, question: str = QUESTION, new_tokens: int = NEW_TOKENS):
    model, processor = hf
    conversation = [{"role": "user", "content": [*[{"type": "image"}] * len(images),
                                                 {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images, return_tensors="pt")
    inputs.pop("mm_token_type_ids", None)
    return hf_forward_and_generate(model, inputs, new_tokens)


def _open(folder, **options):
    defaults = dict(dtype="float32", max_logprobs=-1, block_size=4, kv_cache_memory=8 * 2**20,
                    max_num_seqs=4)
    return engine.open_engine(folder, **(defaults | options))


# Every case over Qwen2; over Qwen3 (InternVL3.5's decoder) the first.
CASES = [pytest.param("qwen2", [WIDE], 2048, id="qwen2-tiles"),
         pytest.param("qwen2", [WIDE, SQUARE], 2048, id="qwen2-two-images"),
         pytest.param("qwen2", [SMALL], 2048, id="qwen2-one-tile"),
         pytest.param("qwen2", [SQUARE], 12, id="qwen2-tiles-across-chunks"),
         pytest.param("qwen3", [WIDE, SQUARE], 2048, id="qwen3-two-images")]


@pytest.mark.parametrize(("folder", "images", "batched"), CASES, indirect=["folder"])
async def test_logits_and_greedy_tokens_match_transformers(folder, hf, images, batched) -> None:
    ids, hf_logprobs, hf_new, hf_steps = hf_run(hf, images)
    pad = hf[0].config.image_token_id
    async with _open(folder, max_num_batched_tokens=batched) as eng:
        stream = await eng.submit(messages(images), greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        if batched < len(ids):  # the chunks really cut the image's placeholders
            first = ids.index(pad)
            assert first < batched < first + ids.count(pad)
        assert_matches_transformers(outs, hf_logprobs, hf_new, hf_steps)
        await wait_idle(eng)


@pytest.mark.parametrize("folder", ["qwen2"], indirect=True)
async def test_repeats_hit_the_cache_and_bad_images_are_refused(folder, hf) -> None:
    expected = [hf_run(hf, [im])[2] for im in (WIDE, SQUARE)]
    async with _open(folder, max_num_batched_tokens=2048) as eng:
        outs = []
        for image in (WIDE, SQUARE, WIDE):
            outs.append(token_ids([o async for o in await eng.submit(messages([image]), greedy(NEW_TOKENS))]))
        runs = eng._parts.runner.encoder_runs
        with pytest.raises(InvalidParamError) as info:
            await eng.submit([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "hi"}]}], greedy(2))
        assert info.value.param == "messages[0].content[0]"
        typed = await eng.submit(messages([], "<img><IMG_CONTEXT></img> hi"), greedy(2))
        async with typed:
            assert len(token_ids([o async for o in typed])) == 2
        assert hf[0].config.image_token_id not in typed.prompt_token_ids
        await wait_idle(eng)
    assert outs == [expected[0], expected[1], expected[0]]
    assert runs == 2  # each image encoded once, all its tiles together


@pytest.mark.parametrize("folder", ["qwen2"], indirect=True)
def test_the_openai_client_behind_an_engine_core_process(folder, hf) -> None:
    ids, _, new, _ = hf_run(hf, [WIDE, SMALL])
    assert_served_like_transformers(folder, messages([WIDE, SMALL]),
                                    hf[1].tokenizer.decode(new, skip_special_tokens=True), len(ids), NEW_TOKENS)


@pytest.mark.parametrize("folder", ["qwen2"], indirect=True)
async def test_transformers_5_names_and_a_lora_adapter(folder, hf, tmp_path) -> None:
    """The folder as transformers 5 names its tensors (``model.language_model.*``,
    ``model.vision_tower.*``) answers the same; an adapter peft wrote over the language
    model gives peft's tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.vlm_checks import tokens_with_adapter, write_vlm_adapter

    renamed = tmp_path / "renamed"
    shutil.copytree(folder, renamed)
    weights = load_file(str(folder / "model.safetensors"))
    moved = {("model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else
              k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head.")): v
             for k, v in weights.items()}
    assert moved.keys() != weights.keys()
    save_file(moved, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    own = hf_model(folder)  # a copy of its own: peft wraps it in place
    base = hf_run(own, [WIDE])[2]
    want = hf_run((write_vlm_adapter(own[0], tmp_path / "lm"), own[1]), [WIDE])[2]
    assert want != base
    got = await tokens_with_adapter(_open(renamed, enable_lora=True, lora_modules=[f"lm={tmp_path / 'lm'}"]),
                                    messages([WIDE]), NEW_TOKENS)
    assert got == {None: base, "lm": want}
