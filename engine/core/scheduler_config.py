"""The scheduler's part of the engine configuration: :class:`SchedulerConfig`."""

from __future__ import annotations

import dataclasses

from engine.config import EngineConfig

POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's part of the engine configuration.

    ``num_kv_blocks`` must equal the allocator's pool size: a request is admitted only if
    it fits the pool alone, which is what guarantees that preemption always ends.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    num_kv_blocks: int
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    # A hybrid model's prefix cache keeps its recurrent states at block boundaries (the
    # block pool's state checkpoints): every chunk that crosses one, decode steps included,
    # asks the pool (which reserves a checkpoint) even when its table holds the chunk.
    state_checkpoints: bool = False
    # The window every layer of the model slides (0: some layer attends to everything).
    # Blocks wholly before a request's next window are released to the pool as it grows.
    sliding_window: int = 0
    # A pooling model: a request ends once its prompt is computed (the runner pools it in
    # the step of its last chunk), with no token drawn; its blocks are freed then.
    pooling: bool = False
    # False for a bidirectional encoder: no KV cache at all, so no allocator call, and a
    # prompt runs whole in one step (it cannot be chunked: every token sees every token).
    paged_kv: bool = True
    # Speculative decoding (engine/core/spec.py): tokens proposed per decode step by
    # prompt lookup (0: off), and the lookup's suffix lengths.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Tokens proposed per step from a Predicted Outputs request's prediction (with or
    # without prompt lookup configured).
    num_prediction_tokens: int = 8
    # A vision model's encoder budget: image placeholder tokens whose encoder output a
    # step may compute (0: max_num_batched_tokens). See engine/core/encoder_budget.py.
    max_num_encoder_input_tokens: int = 0
    # Each image's placeholders prefill in one chunk (Gemma 3: they attend to each other
    # both ways, so the first reads the last's keys). See engine/core/encoder_budget.py.
    whole_images: bool = False
    # The most tokens a prefill chunk of one request takes (0: no cap but the budget; see
    # planning.prefill_cap).
    long_prefill_token_threshold: int = 0
    # Each prompt (a preempted request: its prompt and outputs) prefills in one chunk (a
    # bidirectional decoder, EmbeddingGemma; --no-enable-chunked-prefill).
    whole_prompts: bool = False
    # Pipeline parallelism: this many steps in flight, a request in at most one of them
    # (its next chunk needs every stage to hold its last token; see Scheduler._busy), the
    # live requests spread over that many batches (Scheduler._batch_cap).
    pipeline_stages: int = 1
    # draft_model: the runner's draft model proposes num_speculative_tokens tokens for a
    # speculating decode step (the chunk reserves the positions; the runner fills them).
    draft_model: bool = False
    # Suffix decoding (engine.core.suffix): (max tree depth, answers kept, max spec factor,
    # min token probability); None: another method, or none.
    suffix_decoding: tuple[int, int, float, float] | None = None
    # Distinct LoRA adapters among the running requests (the runner's slots); 0: no limit
    # (no adapters are served).
    max_loras: int = 0

    @property
    def one_step_per_request(self) -> bool:
        return self.pipeline_stages > 1

    def __post_init__(self) -> None:
        # A plain ValueError: EngineConfig has checked the user's options and the KV sizing
        # the pool (ConfigError both); a bad value here is a caller's bug, not configuration.
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_encoder_input_tokens < 0:
            raise ValueError("max_num_encoder_input_tokens must be >= 0, got "
                             f"{self.max_num_encoder_input_tokens!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")

    @classmethod
    def from_engine_config(
        cls, config: EngineConfig, *, max_model_len: int, num_kv_blocks: int, sliding_window: int = 0,
        pooling: bool = False, paged_kv: bool = True, whole_images: bool = False,
        whole_prompts: bool = False,
    ) -> SchedulerConfig:
        """Take the scheduling fields of ``config``; the context length, the pool size and
        the window are resolved elsewhere (from the model and the memory budget)."""
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            policy=config.scheduling_policy,
            enable_prefix_caching=config.enable_prefix_caching,
            state_checkpoints=bool(config.enable_prefix_caching and config.state_checkpoints),
            sliding_window=sliding_window,
            pooling=pooling,
            paged_kv=paged_kv,
            max_num_encoder_input_tokens=config.max_num_encoder_input_tokens or 0,
            whole_images=whole_images,
            whole_prompts=whole_prompts,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            pipeline_stages=config.pipeline_parallel_size,
            max_loras=config.max_loras if config.enable_lora else 0,
            **_speculative_fields(config),
        )

    @property
    def encoder_budget(self) -> int:
        """Image placeholder tokens whose encoder output one step may compute."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def max_request_len(self) -> int:
        """Prompt plus outputs of one request: the context, or the whole pool if smaller."""
        if not self.paged_kv:
            return self.max_model_len
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)


def _speculative_fields(config: EngineConfig) -> dict[str, int | bool]:
    spec = config.speculative
    if spec is None:
        return {}
    return {"num_speculative_tokens": spec.num_speculative_tokens,
            "prompt_lookup_max": spec.prompt_lookup_max,
            "prompt_lookup_min": spec.prompt_lookup_min,
            "num_prediction_tokens": spec.num_speculative_tokens,
            "draft_model": spec.method == "draft_model",
            "suffix_decoding": None if spec.method != "suffix" else (
                spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)}
