"""Qwen2-VL and Qwen2.5-VL (a 2-D RoPE vision transformer, windowed for Qwen2.5, and a
patch merger before a Qwen2 decoder with M-RoPE) through the engine, against
transformers' ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
on the output of its own ``Qwen2VLProcessor``.

The tiny models carry Qwen2-VL's own chat template. The engine gets chat messages with
image parts; transformers gets the same conversation through the processor's
``apply_chat_template`` and the processor, which resizes each image within the pixel
budget and widens ``<|image_pad|>`` to the image's grid. Checked: the expanded
prompt ids, the log-softmax of the logits at every prompt position and 24 greedy tokens
with their full distributions (positions after the image continue from M-RoPE's largest
position), for one image, two images of different sizes in one message (one of them
shrunk by ``max_pixels``), and an image split across chunked-prefill chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from engine.models.testing import TINY_QWEN_VL_MAX_PIXELS, write_tiny_qwen_vl
from tests.engine_helpers import greedy, token_ids, wait_idle
from tests.template_data import QWEN2_VL, checkpoint_template
from tests.test_llava import data_url
from tests.vlm_checks import (
    assert_matches_transformers,
    hf_forward_and_generate,
    image_only,
    tokens_with_adapter,
    write_vlm_adapter,
)

NEW_TOKENS = 24
QUESTION = "What is in the picture? Describe it."
# What Qwen-VL's template writes for an image part (bench/vision_qwen.py's prompt).
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(seed: int, size: tuple[int, int] = (40, 32)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


# Two images per kind of case: the second is larger than the processor's max_pixels, so
# it reaches the model shrunk (and on a grid of another shape than the first).
IMAGES = [_image(0), _image(1, size=(120, 72))]


def messages(images: list, question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def hf_text(processor, num_images: int, question: str = QUESTION) -> str:
    """The prompt the processor's own apply_chat_template writes for the conversation
    :func:`messages` sends the engine (image parts first, then the question)."""
    parts = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": parts}],
                                         add_generation_prompt=True, tokenize=False)


def write_folder(path, kind: str):
    """A tiny Qwen-VL of ``kind`` with Qwen2-VL's own chat template (Qwen2.5-VL's is the
    same)."""
    return write_tiny_qwen_vl(path, kind, chat_template=checkpoint_template(QWEN2_VL))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_vl(tmp_path_factory, request):
    return write_folder(tmp_path_factory.mktemp(request.param), request.param)


def hf_model(folder):
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
    )

    ImageOnlyProcessor = image_only(Qwen2VLProcessor)  # noqa: N806
    kind = AutoConfig.from_pretrained(folder).model_type
    cls = Qwen2VLForConditionalGeneration if kind == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # The folder's chat template is the processor's too, as Qwen's checkpoints ship it.
    processor = ImageOnlyProcessor(image_processor=AutoImageProcessor.from_pretrained(folder),
                                   tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    return model, processor


@pytest.fixture(scope="module")
def hf(qwen_vl):
    return hf_model(qwen_vl)


def hf_run(hf, images: list, question: str = QUESTION, new_tokens: int = NEW_TOKENS):
    model, processor = hf
    inputs = processor(text=hf_text(processor, len(images), question), images=images,
                       return_tensors="pt")
    return hf_forward_and_generate(model, inputs, new_tokens)


def _open(folder, **options):
    defaults = dict(dtype="float32", max_logprobs=-1, block_size=4, kv_cache_memory=8 * 2**20,
                    max_num_seqs=4)
    return engine.open_engine(folder, **(defaults | options))


@pytest.mark.parametrize(("num_images", "batched"), [(1, 2048), (2, 2048), (1, 40)],
                         ids=["one-image", "two-images", "image-across-chunks"])
async def test_logits_and_greedy_tokens_match_transformers(qwen_vl, hf, num_images, batched) -> None:
    images = IMAGES[:num_images]
    ids, hf_logprobs, hf_new, hf_steps = hf_run(hf, images)
    pad = hf[0].config.image_token_id
    if num_images == 2:  # dynamic resolution: the grids differ, the large one was shrunk
        counts = [len(run) for run in "".join("x" if t == pad else " " for t in ids).split()]
        assert counts[0] != counts[1] and counts[1] * 4 * 4 * 4 <= TINY_QWEN_VL_MAX_PIXELS
    async with _open(qwen_vl, max_num_batched_tokens=batched) as eng:
        stream = await eng.submit(messages(images), greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        if batched < len(ids):  # the chunks really cut the image's placeholders
            first = ids.index(pad)
            assert first < batched < first + ids.count(pad)
        assert_matches_transformers(outs, hf_logprobs, hf_new, hf_steps)
        # Each image ran through the encoder exactly once, chunk boundary or not.
        assert eng._parts.runner.encoder_runs == num_images
        # The decode steps ran fused (each with its M-RoPE rows), checked by transformers too.
        assert eng._parts.runner.model.fused_step.steps >= NEW_TOKENS - 1
        # A still image's patches travel as one frame (3 x 4 x 4 values), not two.
        from engine.multimodal import RawImage

        _, shape = eng._parts.images.pixels(RawImage("messages[0].content[0]", images[0]))
        assert shape == (80, 48)  # 40 x 32 pixels: 8 x 10 patches
        await wait_idle(eng)


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
async def test_prefix_cache_hits_keep_mrope_positions(qwen_vl, hf) -> None:
    """A prompt run from a prefix-cache hit inside the text after its image still gets
    M-RoPE's positions (sliced from the whole prompt's); another image with the same text
    shares only the blocks before the image and gets its own answer."""
    from PIL import Image

    # Two images this random model answers differently about (noise images of one size
    # look alike to it behind Qwen2-VL's default system prompt: it reads mostly the text).
    a, b = IMAGES[0], Image.new("RGB", (24, 48), (255, 255, 255))
    ids, _, a_new, _ = hf_run(hf, [a])
    b_new = hf_run(hf, [b])[2]
    assert a_new != b_new
    offset = ids.index(hf[0].config.image_token_id)
    async with _open(qwen_vl, max_num_batched_tokens=2048) as eng:
        outs = []
        for image in (a, b, a):
            stream = await eng.submit(messages([image]), greedy(NEW_TOKENS))
            async with stream:
                outs.append([o async for o in stream])
        runs = eng._parts.runner.encoder_runs
        await wait_idle(eng)
    cached = [o[-1].usage.cached_tokens for o in outs]
    assert [token_ids(o) for o in outs] == [a_new, b_new, a_new]
    assert cached[0] == 0 and cached[1] == offset // 4 * 4
    assert cached[2] == (len(ids) - 1) // 4 * 4 > offset + ids.count(hf[0].config.image_token_id)
    assert runs == 2  # the hit skipped the encoder


@pytest.mark.parametrize("qwen_vl", ["qwen2_5_vl"], indirect=True)
async def test_an_image_the_processor_refuses_is_a_400_and_the_engine_serves_on(qwen_vl) -> None:
    from engine.errors import InvalidParamError

    async with _open(qwen_vl) as eng:
        # Qwen2VLImageProcessor refuses aspect ratios over 200.
        with pytest.raises(InvalidParamError, match="image processor refused") as info:
            await eng.submit(messages([_image(2, size=(402, 2))]), greedy(2))
        assert info.value.param == "messages[0].content[0]"
        # The embedded API's PIL image part, and an image smaller than one merged patch
        # (the processor scales it up to min_pixels).
        for image in (_image(3), _image(4, size=(3, 5))):
            parts = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
            stream = await eng.submit([{"role": "user", "content": parts}], greedy(3))
            async with stream:
                assert len(token_ids([o async for o in stream])) == 3
        await wait_idle(eng)


async def test_the_hubs_older_layout_loads_the_same_model(qwen_vl, hf, tmp_path) -> None:
    """The checkpoints on the hub predate transformers 5: a flat config.json with
    ``rope_scaling {"type": "mrope"}`` and ``in_chans``, tensors under ``model.*`` and
    ``visual.*``. Rewritten so, the tiny model answers as transformers does."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    old = tmp_path / "old-layout"
    shutil.copytree(qwen_vl, old)
    raw = json.loads((qwen_vl / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    vision = raw["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    vision.pop("rope_parameters", None)
    flat = {**text, **raw, "rope_theta": rope["rope_theta"], "model_type": raw["model_type"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (old / "config.json").write_text(json.dumps(flat))
    weights = load_file(str(qwen_vl / "model.safetensors"))
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in weights.items()}
    assert renamed.keys() != weights.keys()
    save_file(renamed, str(old / "model.safetensors"), metadata={"format": "pt"})
    ids, _, new, _ = hf_run(hf, IMAGES[:1], new_tokens=8)
    async with _open(old, max_num_batched_tokens=2048) as eng:
        stream = await eng.submit(messages(IMAGES[:1]), greedy(8))
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        assert token_ids(outs) == new
        await wait_idle(eng)


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
async def test_mm_processor_kwargs_sets_the_pixel_budget(qwen_vl, tmp_path) -> None:
    from transformers import AutoImageProcessor

    from engine.errors import ConfigError
    from engine.models.testing import write_tiny_llava

    budget = {"min_pixels": 64, "max_pixels": 16 * 16}
    processor = AutoImageProcessor.from_pretrained(qwen_vl, **budget)
    grid = processor(images=[IMAGES[0]], return_tensors="np")["image_grid_thw"][0]
    expected = int(grid.prod()) // 4
    async with _open(qwen_vl, mm_processor_kwargs=budget) as eng:
        pad = eng.tokenizer.token_to_id("<|image_pad|>")
        stream = await eng.submit(messages(IMAGES[:1]), greedy(2))
        async with stream:
            assert stream.prompt_token_ids.count(pad) == expected < 20  # 20 without it
            assert len(token_ids([o async for o in stream])) == 2
        await wait_idle(eng)
    for bad, match in (({"size": 3}, "unknown key"), ({"max_pixels": 0}, "positive integer"),
                       ({"min_pixels": 512, "max_pixels": 256}, "over max_pixels"),
                       ("{", "not JSON")):
        with pytest.raises(ConfigError, match=match) as info:
            async with _open(qwen_vl, mm_processor_kwargs=bad):
                pass
        assert info.value.field == "mm_processor_kwargs"
    llava = write_tiny_llava(tmp_path / "llava")
    with pytest.raises(ConfigError, match="only Qwen-VL"):
        async with _open(llava, mm_processor_kwargs=budget):
            pass


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
async def test_a_requests_mm_processor_kwargs_set_its_own_pixel_budget(qwen_vl, hf, tmp_path) -> None:
    """vLLM's per-request mm_processor_kwargs: transformers' processor built with the same
    budget gives the prompt and the tokens; the server's own budget stays the others'."""
    from transformers import AutoImageProcessor

    from engine.errors import InvalidParamError
    from engine.models.testing import write_tiny_llava

    model, processor = hf
    budget = {"min_pixels": 64, "max_pixels": 16 * 16}
    small = type(processor)(image_processor=AutoImageProcessor.from_pretrained(qwen_vl, **budget),
                            tokenizer=processor.tokenizer, chat_template=processor.chat_template)
    ids, _, new, _ = hf_run((model, small), IMAGES[:1], new_tokens=8)
    full_ids, _, _, _ = hf_run(hf, IMAGES[:1], new_tokens=1)
    assert len(ids) < len(full_ids)
    async with _open(qwen_vl, max_num_batched_tokens=2048) as eng:
        stream = await eng.submit(messages(IMAGES[:1]), greedy(8), mm_processor_kwargs=budget)
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        assert token_ids(outs) == new
        # The next request, without them: the server's budget (the same image is another
        # input at another size: its own key, no cache hit across the two).
        assert tuple(await eng.tokenize_chat(messages(IMAGES[:1]))) == tuple(full_ids)
        assert tuple(await eng.tokenize_chat(messages(IMAGES[:1]),
                                             mm_processor_kwargs=budget)) == tuple(ids)
        for bad in ({"size": 3}, {"max_pixels": 0}, {"min_pixels": 4096, "max_pixels": 256},
                    {"max_pixels": "256"}):
            with pytest.raises(InvalidParamError) as info:
                await eng.submit(messages(IMAGES[:1]), greedy(1), mm_processor_kwargs=bad)
            assert info.value.param == "mm_processor_kwargs"
        await wait_idle(eng)
    # LLaVA's processor resizes every image to one size: it takes no budget.
    llava = write_tiny_llava(tmp_path / "llava")
    async with _open(llava) as eng:
        with pytest.raises(InvalidParamError, match="no pixel budget") as info:
            await eng.submit(messages(IMAGES[:1]), greedy(1), mm_processor_kwargs=budget)
        assert info.value.param == "mm_processor_kwargs"


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
def test_llm_chat_and_prompt_dicts_take_mm_processor_kwargs(qwen_vl, hf) -> None:
    from transformers import AutoImageProcessor

    model, processor = hf
    budget = {"min_pixels": 64, "max_pixels": 16 * 16}
    small = type(processor)(image_processor=AutoImageProcessor.from_pretrained(qwen_vl, **budget),
                            tokenizer=processor.tokenizer, chat_template=processor.chat_template)
    ids, _, new, _ = hf_run((model, small), IMAGES[:1], new_tokens=4)
    with engine.LLM(qwen_vl, dtype="float32", kv_cache_memory=8 * 2**20) as llm:
        chat = llm.chat(messages(IMAGES[:1]), greedy(4), mm_processor_kwargs=budget,
                        use_tqdm=False)
        prompt = {"prompt": hf_text(processor, 1), "multi_modal_data": {"image": IMAGES[0]},
                  "mm_processor_kwargs": budget}
        generated = llm.generate(prompt, greedy(4), use_tqdm=False)
    for out in (chat[0], generated[0]):
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == new


@pytest.mark.parametrize("qwen_vl", ["qwen2_5_vl"], indirect=True)
async def test_requests_batched_together_each_get_their_own_positions(qwen_vl, hf) -> None:
    """Three requests (two images, one image, text only) prefill and decode in the same
    steps; each one's M-RoPE positions and delta are its own."""
    import trio

    cases = [(IMAGES, QUESTION), ([_image(5, size=(16, 40))], "Hello world!"), ([], "The quick brown fox")]
    expected = [hf_run(hf, images, question, new_tokens=12)[2] if images else None
                for images, question in cases]
    got: dict[int, list[int]] = {}
    async with _open(qwen_vl, max_num_batched_tokens=64) as eng:
        async def run(i: int, images: list, question: str) -> None:
            prompt = messages(images, question) if images else [{"role": "user", "content": question}]
            stream = await eng.submit(prompt, greedy(12))
            async with stream:
                got[i] = token_ids([o async for o in stream])

        async with trio.open_nursery() as nursery:
            for i, (images, question) in enumerate(cases):
                nursery.start_soon(run, i, images, question)
        # Text only on a Qwen-VL model: the positions of a plain decoder (all three equal).
        alone = await eng.submit([{"role": "user", "content": cases[2][1]}], greedy(12))
        async with alone:
            assert token_ids([o async for o in alone]) == got[2]
        await wait_idle(eng)
    assert [got[0], got[1]] == expected[:2]
    model, processor = hf
    inputs = processor.tokenizer(hf_text(processor, 0, cases[2][1]), return_tensors="pt")
    with torch.no_grad():
        text_only = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert got[2] == text_only[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
async def test_vision_tokens_typed_beside_an_image_stay_text(qwen_vl) -> None:
    """The vision tokens of an image are the ones the chat template writes for its part;
    the same tokens typed by the client beside the image stay text (as without an image),
    so the prompt holds exactly one of each per image."""
    async with _open(qwen_vl) as eng:
        ids = {t: eng.tokenizer.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>")}
        for typed in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"):
            stream = await eng.submit(messages(IMAGES[:1], f"{typed} {QUESTION}"), greedy(2))
            async with stream:
                assert [stream.prompt_token_ids.count(i) for i in ids.values()] == [1, 1]
                assert len(token_ids([o async for o in stream])) == 2
        # Without an image the same text is text.
        stream = await eng.submit([{"role": "user", "content": "<|vision_start|> hi"}], greedy(2))
        async with stream:
            assert ids["<|vision_start|>"] not in stream.prompt_token_ids
        await wait_idle(eng)


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
async def test_interleaved_image_and_text_parts_are_the_templates_own_rendering(
        qwen_vl, hf) -> None:
    """Image and text parts interleaved in one message reach Qwen2-VL's template in the
    order given, nothing between them: the prompt is the processor's own."""
    question = [{"type": "text", "text": "Compare "}, {"type": "text", "text": "these two."}]
    hf_messages = [{"role": "user", "content": [{"type": "image"}, question[0], {"type": "image"},
                                                question[1]]}]
    text = hf[1].apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    ids = hf[1](text=text, images=IMAGES, return_tensors="pt")["input_ids"][0].tolist()
    parts = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}, question[0],
             {"type": "image_url", "image_url": {"url": data_url(IMAGES[1])}}, question[1]]
    async with _open(qwen_vl) as eng:
        stream = await eng.submit([{"role": "user", "content": parts}], greedy(1))
        async with stream:
            assert stream.prompt_token_ids == tuple(ids)
        await wait_idle(eng)


async def test_a_lora_adapter_on_the_language_model_answers_images_as_peft(qwen_vl, tmp_path) -> None:
    """An adapter peft wrote over the Qwen2 language model (M-RoPE positions and all)
    gives peft's greedy tokens on an image prompt."""
    hf = hf_model(qwen_vl)  # a copy of its own: peft wraps it in place
    images = [_image(0)]
    base = hf_run(hf, images)[2]
    want = hf_run((write_vlm_adapter(hf[0], tmp_path / "lm"), hf[1]), images)[2]
    assert want != base
    got = await tokens_with_adapter(_open(qwen_vl, enable_lora=True, lora_modules=[f"lm={tmp_path / 'lm'}"]),
                                    messages(images), NEW_TOKENS)
    assert got == {None: base, "lm": want}
