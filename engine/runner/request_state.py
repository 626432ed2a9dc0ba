"""What the model runner keeps of each request between steps, and the error of a plan it
cannot execute.

The runner owns each request's tokens (prompt plus the outputs it sampled): a chunk of a
plan names only ``(request, start, num_tokens, block table, sample)`` and the runner's
modules (batch building, sampling and verification, pooling, prompt logprobs) read and
update a :class:`RequestState`.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.errors import EngineError
from engine.messages import ImageInput, LoraAdapter
from engine.params import SamplingParams
from engine.structured import Matcher


class StepPlanError(EngineError):
    """A plan the runner cannot execute (unknown request, tokens it does not have, over
    budget). It means the scheduler and the runner disagree: a bug, not a bad request."""


@dataclasses.dataclass(slots=True)
class RequestState:
    """One request as the runner holds it: its tokens, its parameters, and where each of
    its per-request features (prompt logprobs, grammar, pooling, images, M-RoPE, a draft
    model) stands."""

    prompt: tuple[int, ...]
    outputs: list[int]
    tokens: list[int]  # prompt + outputs, kept in step so chunks slice one list
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    # The next prompt token whose logprob is owed (prompt_logprobs requests); a chunk
    # recomputed after preemption does not report its tokens twice.
    prompt_logprobs_next: int = 1
    # Structured output: the sample's place in its grammar, having accepted every token of
    # ``outputs`` (built at its first sampling step; see Verifier._matcher).
    matcher: Matcher | None = None
    # Pooling: what the chunks so far add up to (fp32: a sum, a max or a chosen row; with
    # ``pool_tokens``, every row so far).
    pool: torch.Tensor | None = None
    pool_tokens: bool = False
    # A vision model's images (ImageInput, prompt order) and how far its prompt has been
    # run (the end of its last chunk): an image whose placeholders all lie below it no
    # longer needs its encoder output.
    images: tuple[ImageInput, ...] = ()
    prefilled: int = 0
    # M-RoPE (Qwen-VL): the prompt's [3, len(prompt)] positions (int64, host), and the
    # offset of every later token's position from its index (the same on all streams).
    mrope: torch.Tensor | None = None
    mrope_delta: int = 0
    # A draft model's progress (engine/runner/draft.py): where the target's verified
    # positions end after the last chunk, and where the draft's do (it may lag: the
    # positions between are run by the draft at the start of the next chunk).
    target_end: int = 0
    draft_end: int = 0
    # The LoRA adapter the request runs with (engine.messages.LoraAdapter); None: the base.
    lora: LoraAdapter | None = None
