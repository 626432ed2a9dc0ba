"""Preprocessed pixels packed as 8-bit values and each channel's constants (engine.pixels):
what the model gets back is the image processor's own float32 output, for the processors
of LLaVA (CLIP's), Qwen-VL (patch rows) and SmolVLM (tiles); values no 8-bit picture gives
travel as float32; and a request whose float32 pixels would pass the request budget only
packed is admitted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from engine.models.testing import write_tiny_llava, write_tiny_qwen_vl
from engine.multimodal import ImagePreprocessor, MediaLimits, RawImage
from engine.pixels import normalisation, pack, unpack
from tests.engine_helpers import greedy, token_ids, wait_idle


def _image(seed: int, size: tuple[int, int]):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_packed_pixels_are_the_processors_own(tmp_path, kind) -> None:
    from transformers import AutoImageProcessor

    if kind == "llava":
        folder = write_tiny_llava(tmp_path / kind)
        prep = ImagePreprocessor(folder, image_token_id=0, image_token="<image>", num_image_tokens=4,
                                 limits=MediaLimits())
    else:
        folder = write_tiny_qwen_vl(tmp_path / kind, kind)
        prep = ImagePreprocessor(folder, image_token_id=0, image_token="<|image_pad|>", num_image_tokens=None,
                                 limits=MediaLimits(), merge_size=2)
    image = _image(3, (60, 44))
    out = AutoImageProcessor.from_pretrained(folder)(images=[image], return_tensors="np")
    want = out["pixel_values"] if kind == "qwen2_vl" else out["pixel_values"][0]
    pixels, shape, _ = prep.preprocess(RawImage("messages[0].content[0]", image))
    got = unpack(pixels, shape)
    if kind == "qwen2_vl":  # a still image travels as one of its two equal frames
        got = got.view(shape[0], 3, 1, -1).expand(-1, -1, 2, -1).reshape(want.shape)
    torch.testing.assert_close(got, torch.from_numpy(want).float(), atol=1e-5, rtol=0)
    assert len(pixels) < np.prod(shape) + 64  # a byte a value, not four


def test_values_no_8_bit_picture_gives_travel_as_float32() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((2, 3, 10)).astype(np.float32)
    norm = (1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    packed = pack(values, norm)
    assert len(packed) == values.nbytes
    assert torch.equal(unpack(packed, values.shape), torch.from_numpy(values))
    eight_bit = ((rng.integers(0, 256, (2, 3, 100)) / 255 - 0.5) / 0.5).astype(np.float32)
    assert len(pack(eight_bit, norm)) < eight_bit.nbytes / 3
    assert len(pack(eight_bit, None)) == eight_bit.nbytes  # no constants: float32


async def test_a_request_over_the_budget_in_float32_but_not_packed_is_admitted(tmp_path, monkeypatch) -> None:
    """The request budget counts the bytes carried: an image whose float32 pixels are over
    it but whose packed ones are not is served, and answers as the same image always does."""
    from transformers import AutoImageProcessor

    from engine.core import admission

    folder = write_tiny_qwen_vl(tmp_path / "qwen", "qwen2_vl")
    image = _image(4, (64, 48))
    floats = AutoImageProcessor.from_pretrained(folder)(images=[image], return_tensors="np")["pixel_values"]
    monkeypatch.setattr(admission, "MAX_IMAGE_BYTES", floats.nbytes // 2 - 1)  # one frame's float32, less
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]
    async with engine.open_engine(folder, dtype="float32", kv_cache_memory=8 * 2**20, block_size=4) as eng:
        first = token_ids([o async for o in await eng.submit([{"role": "user", "content": parts}], greedy(4))])
        again = token_ids([o async for o in await eng.submit([{"role": "user", "content": parts}], greedy(4))])
        assert first == again and len(first) == 4
        assert normalisation(eng._parts.images.processor) is not None
        await wait_idle(eng)
