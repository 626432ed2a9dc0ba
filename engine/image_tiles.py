"""Images cut into tiles, as Idefics3 and SmolVLM take them (models/idefics3.py), and as
InternVL does (:class:`ContextImagePreprocessor`, models/internvl.py).

The model's own image processor (``Idefics3ImageProcessor`` / ``SmolVLMImageProcessor``,
from the folder) resizes an image to its longest-edge budget, cuts it into ``rows x
cols`` tiles of the tower's size and adds the whole image shrunk to one more tile (an
image that fits one tile is that tile alone: rows and columns 0). The chat template
writes ``<image>`` for the image part; as the processor does, the engine widens it to::

    <fake_token_around_image><row_1_col_1><image>*N ... <fake_token_around_image><row_1_col_C><image>*N\\n
    ...
    \\n<fake_token_around_image><global-img><image>*N<fake_token_around_image>

tokenized with the model's tokenizer (the frame is special tokens around newlines, so it
tokenizes the same inside the prompt as alone). Each tile is an
:class:`~engine.messages.ImageInput` of its own (its ``N = num_image_tokens`` placeholders,
its pixels ``(C, S, S)``), encoded, cached and prefix-keyed as one LLaVA image is.

A tile travels packed as its 8-bit pixels (engine.pixels; SmolVLM's 512-pixel tiles: 768
KiB, not 3 MiB of float32, so that a photo's 17 tiles fit a request's pixel budget).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.errors import CorruptModelError, InvalidParamError
from engine.messages import ImageInput
from engine.multimodal import (
    ImagePreprocessor,
    MediaLimits,
    RawImage,
    decode_image,
    media_token_positions,
)
from engine.pixels import normalisation, pack

FAKE = "<fake_token_around_image>"
GLOBAL = "<global-img>"


def tile_prompt(rows: int, cols: int, per_tile: int, image_token: str) -> str:
    """The text Idefics3's processor puts where the template wrote ``<image>``."""
    pads = image_token * per_tile
    if rows == 0 and cols == 0:
        return f"{FAKE}{GLOBAL}{pads}{FAKE}"
    grid = "".join("".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{pads}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{FAKE}{GLOBAL}{pads}{FAKE}"


def _image_positions(prep: ImagePreprocessor, ids: Sequence[int], images: Sequence[RawImage],
                     options: Mapping[str, Any] | None, own: Collection[int], what: str) -> list[int]:
    """Where ``ids`` holds each image's token, after the checks: no mm_processor_kwargs (no
    pixel budget here), none of the model's own frame tokens ``own`` written by anything
    but an image."""
    prep.processor_for(options)
    at = media_token_positions(ids, prep.image_token_id, prep.image_token, {}, len(images), "image")
    if any(t in own for t in ids):
        raise InvalidParamError(f"the prompt holds {what} tokens that are not an image's", param="messages")
    return at


def _image_input(offset: int, length: int, pixels: bytes, shape: Sequence[int]) -> ImageInput:
    """An image input keyed by its packed pixels and their shape (the prefix cache's key)."""
    shape = tuple(int(d) for d in shape)
    digest = hashlib.sha256(repr(shape).encode() + pixels).digest()
    return ImageInput(offset, length, int.from_bytes(digest[:8], "little") >> 1, pixels, shape, ())


class TiledImagePreprocessor(ImagePreprocessor):
    """Idefics3's / SmolVLM's images: one prompt image, several tiles (module docstring)."""

    def __init__(self, folder: str | Path, *, image_token_id: int, image_token: str,
                 num_image_tokens: int, limits: MediaLimits, encode: Callable[[str], list[int]],
                 frame_ids: Sequence[int]) -> None:
        super().__init__(folder, image_token_id=image_token_id, image_token=image_token,
                         num_image_tokens=num_image_tokens, limits=limits)
        self.norm = normalisation(self.processor)
        self.encode = encode
        # The frame's own tokens (<fake_token_around_image>, <global-img>, <row_R_col_C>):
        # only an image's widening writes them.
        self.frame_ids = frozenset(frame_ids)

    def tiles(self, raw: RawImage) -> tuple[Any, int, int]:
        """``(float32 tiles [T, C, S, S], rows, cols)`` of one image."""
        image = decode_image(raw.data, raw.where, self.limits.max_image_pixels)
        try:
            out = self.processor(images=[[image]], return_tensors="np", return_row_col_info=True)
        except ValueError as exc:
            raise InvalidParamError(f"{raw.where}: the model's image processor refused the "
                                    f"image ({exc})", param=raw.where) from None
        tiles = out["pixel_values"][0]
        mask = out.get("pixel_attention_mask")
        if mask is not None and not mask[0].all():  # a padded tile: never for one image's tiles
            raise CorruptModelError("the image processor padded a tile of one image")
        return tiles.astype("<f4", copy=False), int(out["rows"][0][0]), int(out["cols"][0][0])

    def expand(self, ids: Sequence[int], images: Sequence[RawImage],
               options: Mapping[str, Any] | None = None) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        at = _image_positions(self, ids, images, options, self.frame_ids, "image frame")
        per_tile = self.num_image_tokens
        assert per_tile is not None
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for pos, raw in zip(at, images, strict=True):
            out.extend(ids[prev:pos])
            tiles, rows, cols = self.tiles(raw)
            framed = self.encode(tile_prompt(rows, cols, per_tile, self.image_token))
            starts = [i for i, t in enumerate(framed) if t == self.image_token_id
                      and (i == 0 or framed[i - 1] != self.image_token_id)]
            if len(starts) != len(tiles) or framed.count(self.image_token_id) != per_tile * len(tiles):
                raise CorruptModelError(f"the image processor gave {len(tiles)} tiles for {rows} x {cols}; "
                                        f"the prompt frames {len(starts)}")
            for start, tile in zip(starts, tiles, strict=True):
                inputs.append(_image_input(len(out) + start, per_tile,
                                           pack(tile.reshape(1, tile.shape[0], -1), self.norm), tile.shape))
            out.extend(framed)
            prev = pos + 1
        out.extend(ids[prev:])
        return tuple(out), tuple(inputs)


class ContextImagePreprocessor(ImagePreprocessor):
    """InternVL's images: the processor (``GotOcr2ImageProcessor``, ``crop_to_patches`` as
    ``InternVLProcessor`` asks) gives an image's tiles, and the template's ``<IMG_CONTEXT>``
    is widened to ``<img>``, ``num_image_tokens`` placeholders a tile, ``</img>``: one
    :class:`~engine.messages.ImageInput` an image, its pixels ``(T, C, S, S)`` packed."""

    def __init__(self, folder: str | Path, *, image_token_id: int, image_token: str,
                 num_image_tokens: int, limits: MediaLimits, start_id: int, end_id: int) -> None:
        super().__init__(folder, image_token_id=image_token_id, image_token=image_token,
                         num_image_tokens=num_image_tokens, limits=limits)
        self.norm = normalisation(self.processor)
        self.start_id, self.end_id = start_id, end_id

    def expand(self, ids: Sequence[int], images: Sequence[RawImage],
               options: Mapping[str, Any] | None = None) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        at = _image_positions(self, ids, images, options, (self.start_id, self.end_id), "<img> or </img>")
        per_tile = self.num_image_tokens
        assert per_tile is not None
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for pos, raw in zip(at, images, strict=True):
            out.extend(ids[prev:pos])
            image = decode_image(raw.data, raw.where, self.limits.max_image_pixels)
            try:
                tiles = self.processor(images=[image], crop_to_patches=True, return_tensors="np")["pixel_values"]
            except ValueError as exc:
                raise InvalidParamError(f"{raw.where}: the model's image processor refused the "
                                        f"image ({exc})", param=raw.where) from None
            out.append(self.start_id)
            inputs.append(_image_input(len(out), per_tile * len(tiles),
                                       pack(tiles.reshape(len(tiles), tiles.shape[1], -1), self.norm), tiles.shape))
            out.extend([self.image_token_id] * (per_tile * len(tiles)))
            out.append(self.end_id)
            prev = pos + 1
        out.extend(ids[prev:])
        return tuple(out), tuple(inputs)


__all__ = ["ContextImagePreprocessor", "TiledImagePreprocessor", "tile_prompt"]
