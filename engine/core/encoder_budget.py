"""A step's budget of image encoder work: which images a chunk may reach.

A vision model's chunk that reaches an image's placeholder tokens needs that image's
encoder output. The runner keeps an output while some running request's last chunk ended
inside the image; otherwise the image is encoded in the step, whole. One step may encode
at most ``SchedulerConfig.encoder_budget`` placeholder tokens' worth of images, so a
chunk is cut before the first image that does not fit. With ``whole_images`` (Gemma 3,
whose image tokens attend to each other both ways) a chunk never ends inside an image's
placeholders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from engine.core.request import Request


def held_images(running: Iterable[Request]) -> frozenset[int]:
    """The images whose encoder output the runner keeps into the next step: those a
    running request's last chunk ended inside of (the runner drops an output once no
    request has placeholders of it left to prefill; see ModelRunner._image_embeds)."""
    return frozenset(
        image.key
        for req in running if req.images
        for image in req.images
        if image.offset < req.last_chunk_end < image.offset + image.length
    )


@dataclasses.dataclass(slots=True)
class EncoderBudget:
    """What is left of one step's encoder budget (``total`` at the start), the images the
    runner holds an encoder output of when the step starts, and those this step's chunks
    encode (by key)."""

    total: int
    left: int
    held: frozenset[int] = frozenset()
    encoding: set[int] = dataclasses.field(default_factory=set)
    # SchedulerConfig.whole_images: no chunk ends inside an image's placeholders.
    whole: bool = False

    @classmethod
    def for_step(cls, total: int, running: Iterable[Request], *, whole: bool = False) -> EncoderBudget:
        return cls(total, total, held_images(running), whole=whole)

    def cut(self, req: Request, start: int, count: int, *, commit: bool = False) -> int:
        """How many of the ``count`` tokens from ``start`` of ``req`` fit the budget: every
        image whose placeholders the chunk reaches must have its encoder output held by
        the runner, be encoded by this step already, or be encoded in this step whole; the
        chunk stops before the first image that cannot. An image larger than the whole
        budget runs alone in a step (else it never would). ``commit``: the chunk is taken,
        spend the budget."""
        budget = self.left
        encoding: set[int] = set()  # images this chunk encodes
        end = start + count
        for image in req.images:
            if image.offset >= end:
                break  # in prompt order: the rest lie past the chunk
            if (image.offset + image.length <= start or image.key in self.held
                    or image.key in self.encoding or image.key in encoding):
                continue
            alone = budget == self.total and not self.encoding and not encoding
            if image.length > budget and not alone:
                end = max(start, image.offset)
                break
            budget -= min(image.length, budget)
            encoding.add(image.key)
        if self.whole:
            end = _whole_images(req, start, end)
        if commit:
            self.left = budget
            self.encoding |= encoding
        return end - start


def _whole_images(req: Request, start: int, end: int) -> int:
    """``end`` moved back to the start of an image the chunk ``[start, end)`` would end
    inside of, or to ``start`` (no chunk this step) when the chunk begins inside that
    image: it waits for a step whose budget holds the rest of the image."""
    for image in req.images:
        if image.offset < end < image.offset + image.length:
            return image.offset if image.offset > start else start
    return end
