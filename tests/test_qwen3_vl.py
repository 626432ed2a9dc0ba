"""Qwen3-VL (a vision transformer with a learned, resampled position grid and DeepStack
features fed to the first decoder layers, before a Qwen3 decoder with interleaved M-RoPE)
through the engine, against transformers' ``Qwen3VLForConditionalGeneration`` (and
``Qwen3VLMoeForConditionalGeneration``) on the output of its own ``Qwen3VLProcessor``.

The engine gets chat messages with image parts; transformers gets the same conversation
through the processor's ``apply_chat_template`` and the processor. Checked: the expanded
prompt ids, the log-softmax of the logits at every prompt position and the greedy tokens
with their full distributions, for one image, two images of different grids (one shrunk
by ``max_pixels``), an image split across chunked-prefill chunks, and two requests batched
in one step; the MoE model; the OpenAI client on the served model.
"""

from __future__ import annotations

import pytest
import torch

import engine
from engine.models.testing_qwen3_vl import DEEPSTACK, write_tiny_qwen3_vl
from tests.engine_helpers import greedy, token_ids, wait_idle
from tests.template_data import QWEN2_VL, checkpoint_template
from tests.test_qwen_vl import IMAGES, QUESTION, _image, hf_text, messages
from tests.vlm_checks import (
    assert_matches_transformers,
    assert_served_like_transformers,
    hf_forward_and_generate,
    image_only,
    tokens_with_adapter,
    write_vlm_adapter,
)

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl",
                               chat_template=checkpoint_template(QWEN2_VL))


def hf_model(folder):
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoTokenizer,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
        Qwen3VLProcessor,
    )

    ImageOnlyProcessor = image_only(Qwen3VLProcessor)  # noqa: N806
    moe = AutoConfig.from_pretrained(folder).model_type == "qwen3_vl_moe"
    cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = ImageOnlyProcessor(image_processor=AutoImageProcessor.from_pretrained(folder),
                                   tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    return model, processor


@pytest.fixture(scope="module")
def hf(qwen3_vl):
    return hf_model(qwen3_vl)


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
async def test_logits_and_greedy_tokens_match_transformers(qwen3_vl, hf, num_images, batched) -> None:
    images = IMAGES[:num_images]
    ids, hf_logprobs, hf_new, hf_steps = hf_run(hf, images)
    pad = hf[0].config.image_token_id
    async with _open(qwen3_vl, max_num_batched_tokens=batched) as eng:
        stream = await eng.submit(messages(images), greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        if batched < len(ids):  # the chunks really cut the image's placeholders
            first = ids.index(pad)
            assert first < batched < first + ids.count(pad)
        assert_matches_transformers(outs, hf_logprobs, hf_new, hf_steps)
        await wait_idle(eng)


async def test_deepstack_features_reach_the_decoder(qwen3_vl, hf) -> None:
    """The DeepStack mergers change the answer: with their output projections zeroed in
    both models, transformers' logits move, and the engine follows them there."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = qwen3_vl.parent / "no-deepstack"
    shutil.copytree(qwen3_vl, folder, dirs_exist_ok=True)
    weights = load_file(str(qwen3_vl / "model.safetensors"))
    for j in range(len(DEEPSTACK)):
        for part in ("weight", "bias"):
            weights[f"model.visual.deepstack_merger_list.{j}.linear_fc2.{part}"].zero_()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with_ds = hf_run(hf, IMAGES[:1], new_tokens=2)[1]
    flat = hf_model(folder)
    ids, without, hf_new, hf_steps = hf_run(flat, IMAGES[:1])
    after = ids.index(hf[0].config.image_token_id)
    assert (with_ds[after:] - without[after:]).abs().max() > 0.05
    async with _open(folder, max_num_batched_tokens=2048) as eng:
        stream = await eng.submit(messages(IMAGES[:1]), greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        assert_matches_transformers(outs, without, hf_new, hf_steps)
        await wait_idle(eng)


async def test_requests_batched_together_each_get_their_own_images(qwen3_vl, hf) -> None:
    """Two requests with different images prefilled in one step: each image's DeepStack
    rows land on its own request's placeholders."""
    import trio

    a, b = [_image(7)], [_image(8, size=(56, 24))]
    expect = [hf_run(hf, im)[2] for im in (a, b)]
    got: dict[int, list[int]] = {}
    async with _open(qwen3_vl, max_num_batched_tokens=2048) as eng:
        async def run(i: int, images: list) -> None:
            stream = await eng.submit(messages(images), greedy(NEW_TOKENS))
            async with stream:
                got[i] = token_ids([o async for o in stream])

        async with trio.open_nursery() as nursery:
            for i, images in enumerate((a, b)):
                nursery.start_soon(run, i, images)
        await wait_idle(eng)
    assert [got[0], got[1]] == expect


@pytest.mark.parametrize("hub_layout", [True, False], ids=["hub-layout", "transformers-5-layout"])
async def test_qwen3_vl_moe_matches_transformers(tmp_path, hub_layout) -> None:
    """Qwen3-VL-MoE's stacked experts, read in the hub's layout and in the one
    transformers 5 saves, against transformers loading either."""
    folder = write_tiny_qwen3_vl(tmp_path / "moe", "qwen3_vl_moe", hub_layout=hub_layout,
                                 chat_template=checkpoint_template(QWEN2_VL))
    hf = hf_model(folder)
    ids, hf_logprobs, hf_new, hf_steps = hf_run(hf, IMAGES[:1])
    async with _open(folder, max_num_batched_tokens=2048) as eng:
        stream = await eng.submit(messages(IMAGES[:1]), greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        assert_matches_transformers(outs, hf_logprobs, hf_new, hf_steps)
        await wait_idle(eng)


async def test_a_lora_adapter_on_the_language_model_answers_images_as_peft(qwen3_vl, tmp_path) -> None:
    """An adapter peft wrote over the Qwen3 language model gives peft's greedy tokens on
    an image prompt (DeepStack rows and interleaved M-RoPE under the adapter)."""
    hf = hf_model(qwen3_vl)  # a copy of its own: peft wraps it in place
    images = [_image(0)]
    base = hf_run(hf, images)[2]
    want = hf_run((write_vlm_adapter(hf[0], tmp_path / "lm"), hf[1]), images)[2]
    assert want != base
    got = await tokens_with_adapter(_open(qwen3_vl, enable_lora=True, lora_modules=[f"lm={tmp_path / 'lm'}"]),
                                    messages(images), NEW_TOKENS)
    assert got == {None: base, "lm": want}


def test_the_openai_client_behind_an_engine_core_process(qwen3_vl, hf) -> None:
    """An image_url part through the official client to a server whose engine core runs
    in its own process: transformers' greedy answer and the prompt's token count."""
    ids, _, new, _ = hf_run(hf, IMAGES[:2])
    assert_served_like_transformers(qwen3_vl, messages(IMAGES[:2]),
                                    hf[1].tokenizer.decode(new, skip_special_tokens=True), len(ids), NEW_TOKENS)
