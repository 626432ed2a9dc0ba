"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a tiny model written by
transformers (tests/gemma3_written.py), served by the engine, against transformers' own
processor and model on the same images and messages: the prompt's token ids (the image
frame with its newlines merged as the processor's tokenization merges them), every prompt
position's logprobs, the greedy tokens and their logprobs. The image placeholders attend
to each other both ways; the test checks that this changes transformers' answer, so a
causal engine could not pass."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from engine_helpers import collect, greedy, token_ids, wait_idle
from gemma3_written import IMAGE_MARKERS, MM_TOKENS, hf_gemma3_vision, write_tiny_gemma3_vision
from vlm_checks import (
    assert_matches_transformers,
    hf_forward_and_generate,
    tokens_with_adapter,
    write_vlm_adapter,
)

import engine
from engine.core.encoder_budget import EncoderBudget
from engine.errors import ConfigError, InvalidParamError, LoraAdapterError
from engine.messages import ImageInput

NEW_TOKENS = 12
QUESTION = "What is in the picture? Describe it."


def _image(seed: int, size: tuple[int, int] = (50, 40)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(images: list, *, url: bool) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": _url(im)}} if url else {"type": "image"}
             for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision") / "m")


@pytest.fixture(scope="module")
def hf(gemma3):
    return hf_gemma3_vision(gemma3)


def _hf_run(hf, images: list, *, causal: bool = False):
    """transformers' prompt ids, prompt logprobs, greedy tokens and their logprobs;
    ``causal``: without the token types that make image tokens attend both ways."""
    model, processor = hf
    text = processor.apply_chat_template(_messages(images, url=False), add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=text, images=images, return_tensors="pt")
    if causal:
        inputs.pop("token_type_ids")
    return hf_forward_and_generate(model, inputs, NEW_TOKENS)


def _open(folder, **options):
    defaults = dict(dtype="float32", max_logprobs=-1, block_size=4, kv_cache_memory=8 * 2**20,
                    max_num_seqs=4)
    return engine.open_engine(str(folder), **(defaults | options))


@pytest.mark.parametrize(("ops", "num_images", "batched"), [
    ("cpu", 1, 2048), ("torch", 1, 2048), ("cpu", 2, 2048),
    # Chunks of 6 tokens: the scheduler moves each cut that would fall inside an image's
    # placeholders to the image's start.
    ("cpu", 2, 6)])
async def test_logits_and_greedy_tokens_match_transformers(gemma3, hf, ops, num_images, batched) -> None:
    images = [_image(i) for i in range(num_images)]
    ids, hf_logprobs, hf_new, hf_steps = _hf_run(hf, images)
    causal = _hf_run(hf, images, causal=True)
    soft = hf[0].config.image_token_id
    first_image = ids.index(soft)
    # The bidirectional image block changes what transformers computes after the image.
    assert (causal[1][first_image:] - hf_logprobs[first_image:]).abs().max() > 1e-2
    async with _open(gemma3, ops_backend=ops, max_num_batched_tokens=batched) as eng:
        stream = await eng.submit(_messages(images, url=True),
                                  greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        # The processor's frame, newline runs merged where they meet the template's.
        assert stream.prompt_token_ids == tuple(ids)
        assert_matches_transformers(outs, hf_logprobs, hf_new, hf_steps)
        assert eng._parts.runner.encoder_runs == num_images
        await wait_idle(eng)


async def test_the_same_image_again_is_a_prefix_cache_hit_with_the_same_answer(gemma3, hf) -> None:
    from PIL import Image

    # Two images this random model answers differently about (noise images look alike to
    # it: it reads mostly the text).
    a, b = _image(1), Image.new("RGB", (30, 20), (255, 255, 255))
    async with _open(gemma3) as eng:
        first = await collect(eng, _messages([a], url=True), greedy(NEW_TOKENS))
        other = await collect(eng, _messages([b], url=True), greedy(NEW_TOKENS))
        again = await collect(eng, _messages([a], url=True), greedy(NEW_TOKENS))
        runs = eng._parts.runner.encoder_runs
        await wait_idle(eng)
    ids = _hf_run(hf, [a])[0]
    assert token_ids(other) == _hf_run(hf, [b])[2] != token_ids(first)
    assert again[-1].usage.cached_tokens == (len(ids) - 1) // 4 * 4 > ids.index(hf[0].config.image_token_id)
    assert token_ids(again) == token_ids(first) == _hf_run(hf, [a])[2]
    assert runs == 2


async def test_images_through_an_engine_core_process_give_transformers_tokens(gemma3, hf) -> None:
    """The core process builds its scheduler from its own runner's model: whole images
    there too (chunks of 6 would cut the second image's placeholders)."""
    images = [_image(0), _image(1)]
    async with _open(gemma3, engine_core="process", max_num_batched_tokens=6) as eng:
        got = token_ids(await collect(eng, _messages(images, url=True), greedy(NEW_TOKENS)))
    assert got == _hf_run(hf, images)[2]


async def test_a_step_budget_smaller_than_an_image_is_refused(gemma3) -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        async with _open(gemma3, max_num_batched_tokens=MM_TOKENS - 1):
            pass


def test_a_whole_images_budget_never_ends_a_chunk_inside_an_image() -> None:
    class _Req:
        images = (ImageInput(10, 4, 1, b"", (3,)), ImageInput(20, 4, 2, b"", (3,)))

    budget = EncoderBudget.for_step(100, [], whole=True)
    assert budget.cut(_Req(), 0, 12) == 10  # would end inside [10, 14): back to its start
    assert budget.cut(_Req(), 0, 14) == 14
    assert budget.cut(_Req(), 12, 1) == 0  # begins inside one: waits for room for the rest
    assert budget.cut(_Req(), 12, 2) == 2
    assert budget.cut(_Req(), 14, 8) == 6
    assert EncoderBudget.for_step(100, []).cut(_Req(), 0, 12) == 12  # other models: anywhere


async def test_image_tokens_typed_in_text_stay_text(gemma3) -> None:
    """A client's "<image_soft_token>" is text, not a placeholder."""
    async with _open(gemma3) as eng:
        typed = "".join(IMAGE_MARKERS)
        stream = await eng.submit([{"role": "user", "content": typed}], greedy(2))
        async with stream:
            [o async for o in stream]
        ids = stream.prompt_token_ids
        assert not {eng.tokenizer.token_to_id(m) for m in IMAGE_MARKERS} & set(ids)
        await wait_idle(eng)


async def test_two_tensor_parallel_ranks_give_transformers_tokens(gemma3, hf) -> None:
    """Each rank encodes the step's images with the whole tower and attends its share of
    the heads, the image blocks included."""
    images = [_image(0), _image(1)]
    async with _open(gemma3, tensor_parallel_size=2, max_num_batched_tokens=6) as eng:
        got = token_ids(await collect(eng, _messages(images, url=True), greedy(NEW_TOKENS)))
    assert got == _hf_run(hf, images)[2]


async def test_limit_mm_per_prompt_zero_serves_the_language_model_alone(gemma3, hf) -> None:
    """vLLM's text-only mode: no tower is loaded, an image is a 400, and text prompts are
    transformers' (its vision-language class on text alone); pipeline stages are allowed
    then, as for any Gemma 3 text model."""
    model, _ = hf
    prompt = [5, 17, 33, 101, 7, 9, 250]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(prompt):].tolist()
    async with _open(gemma3, limit_mm_per_prompt=0, pipeline_parallel_size=2) as eng:
        assert token_ids(await collect(eng, prompt, greedy(NEW_TOKENS))) == want
        with pytest.raises(InvalidParamError):
            await eng.submit(_messages([_image(0)], url=True), greedy(2))
        await wait_idle(eng)


async def test_a_lora_adapter_on_the_language_model_answers_images_as_peft(gemma3, tmp_path) -> None:
    """vLLM adapts a vision-language model's language model: an adapter peft wrote over
    Gemma 3's language model gives peft's greedy tokens on an image prompt, the base model
    the base's; an adapter that also targets the tower is refused by name."""
    hf = hf_gemma3_vision(gemma3)  # a copy of its own: peft wraps it in place
    images = [_image(0)]
    base_tokens = _hf_run(hf, images)[2]
    peft_model = write_vlm_adapter(hf[0], tmp_path / "lm")
    want = _hf_run((peft_model, hf[1]), images)[2]
    assert want != base_tokens
    got = await tokens_with_adapter(_open(gemma3, enable_lora=True, lora_modules=[f"lm={tmp_path / 'lm'}"]),
                                    _messages(images, url=True), NEW_TOKENS)
    assert got == {None: base_tokens, "lm": want}
    write_vlm_adapter(hf_gemma3_vision(gemma3)[0], tmp_path / "tower",
                      targets=r".*layers\.\d+\.self_attn\.q_proj")
    async with _open(gemma3, enable_lora=True) as eng:
        with pytest.raises(LoraAdapterError, match="unsupported target"):
            await eng.loras.load("tower", str(tmp_path / "tower"))
