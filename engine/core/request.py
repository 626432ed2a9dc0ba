"""A request as the scheduler sees it: mutable policy state, owned by one scheduler.

Token accounting (``P`` prompt tokens, ``O`` outputs received, ``D`` outputs drawn by
steps whose result has not arrived yet)::

    known tokens:    | prompt (P) | outputs (O) | placeholders (D) |
    computed:        |<-- num_computed_tokens -->|
    still to compute:                            |<-------------->|

A step that samples adds a placeholder at once, so with async scheduling the next step can
compute that position before its token id is known: the model runner holds the real id.
"""

from __future__ import annotations

import enum
from typing import Any

from engine.errors import EngineError
from engine.multimodal import cache_token_ids
from engine.params import SamplingParams


class ProtocolError(EngineError):
    """A caller broke the scheduler's or the allocator's protocol: a bug, not bad input."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from position 0
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed inside the engine (bad logits, a model step that raised)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` (OpenAI's names) or ``"error"``; ``None``
        while unfinished."""
        return self.value if self.is_finished else None


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


class Request:
    """One sample's scheduling state. ``max_tokens`` is already resolved against the
    context (and the KV pool) by whoever builds it; see :meth:`Scheduler.add_request`."""

    __slots__ = (
        "sample_id", "prompt_token_ids", "params", "eos_token_ids", "priority", "arrival",
        "cache_salt", "wait_for", "max_tokens", "output_token_ids", "num_computed_tokens",
        "num_pending_tokens", "status", "stop_reason", "block_ids", "num_cached_blocks",
        "num_released_blocks",
        "num_preemptions", "seen_by_runner", "num_cached_tokens", "prediction",
        "draft_token_ids", "num_model_drafts", "num_draft_tokens", "num_accepted_tokens", "images",
        "cache_prompt_ids", "prediction_pos", "last_chunk_end", "beam", "lora", "pool_tokens",
        "store",
    )  # fmt: skip

    def __init__(
        self,
        sample_id: str,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival: int = 0,
        cache_salt: str | None = None,
        wait_for: str | None = None,
        prediction: tuple[int, ...] = (),
        images: tuple[Any, ...] = (),
        lora: Any = None,
        pool_tokens: bool = False,
    ) -> None:
        self.sample_id = sample_id
        self.lora = lora  # its LoRA adapter (engine.messages.LoraAdapter), None: the base model
        self.pool_tokens = pool_tokens  # pooling: every prompt token's row (NewRequest's)
        self.prompt_token_ids = tuple(prompt_token_ids)
        # Image inputs (engine.messages.ImageInput) travel to the runner with the request;
        # the prefix cache keys the prompt with each image's placeholders replaced by its
        # content hash, so blocks are shared only between equal images.
        self.images = images
        self.cache_prompt_ids = cache_token_ids(self.prompt_token_ids, images)
        # Where its last chunk planned since it was (re)started ended (0: none): an image
        # this lies inside of has its encoder output kept by the runner (the encoder budget).
        self.last_chunk_end = 0
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        self.priority = priority
        self.arrival = arrival  # the scheduler's admission counter: FCFS order, ties in priority
        self.cache_salt = cache_salt
        # n > 1: not scheduled until this request has computed its whole prompt, so that
        # the prompt's blocks are in the prefix cache and shared rather than recomputed.
        self.wait_for = wait_for
        self.max_tokens = max_tokens
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # placeholders: sampled by a step whose result is out
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0  # leading blocks of block_ids already in the prefix cache
        self.num_released_blocks = 0  # leading blocks out of every layer's window, given back
        # Prompt tokens the prefix cache gave its first table (-1: not allocated yet); what
        # usage.prompt_tokens_details.cached_tokens reports, as vLLM's num_cached_tokens.
        self.num_cached_tokens = -1
        self.num_preemptions = 0  # also the epoch of block_ids: chunks of older epochs are void
        self.seen_by_runner = False
        # Speculative decoding: a Predicted Outputs request's prediction (its proposal
        # source); the proposal of the step in flight (the request is not planned again
        # until its result is in); drafted and accepted tokens so far.
        self.prediction = tuple(prediction)
        self.prediction_pos = 0  # where in the prediction the last proposal started
        self.draft_token_ids: tuple[int, ...] = ()
        self.num_model_drafts = 0  # the same, when the runner's draft model proposes
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Beam search: the group's state (engine.core.beam.BeamGroup) on the request the
        # queue holds; its beams are requests of their own, outside the queue.
        self.beam: Any = None
        # The KV store's state of it (engine.core.kv_tier.StoreState), None: not concerned.
        self.store: Any = None

    def __repr__(self) -> str:
        return (
            f"Request({self.sample_id!r}, {self.status.name}, computed="
            f"{self.num_computed_tokens}/{self.num_known_tokens}, out={len(self.output_token_ids)}"
            f"+{self.num_pending_tokens}/{self.max_tokens})"
        )

    @property
    def num_seats(self) -> int:
        """The batch rows it may take in one step (``max_num_seqs`` counts rows): a beam
        group's width, else one."""
        return self.beam.search.width if self.beam is not None else 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_sampled(self) -> int:
        """Outputs received plus those drawn by steps still in flight."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_sampled

    @property
    def can_sample(self) -> bool:
        """False once enough tokens are drawn for ``max_tokens`` (scheduling more is waste),
        and while a speculative step of it is in flight (how many tokens it keeps is not
        known until its result arrives)."""
        return (self.num_sampled < self.max_tokens and not self.draft_token_ids
                and not self.num_model_drafts)

    def known_token_ids(self) -> tuple[int, ...]:
        """Prompt and received outputs: every token whose id the scheduler knows, as the
        prefix cache keys them (image placeholders stand as their image's hash)."""
        return self.cache_prompt_ids + tuple(self.output_token_ids)

    def append_output(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; return the finished status it causes, if any.

        EOS (unless ``ignore_eos``) and ``stop_token_ids`` end the request only from output
        index ``min_tokens`` on, matching the sampler, which masks them before that.
        """
        self.output_token_ids.append(token_id)
        index = len(self.output_token_ids) - 1
        params = self.params
        if index >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
