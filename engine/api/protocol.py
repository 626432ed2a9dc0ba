"""What the HTTP layer is typed against: :class:`EngineLike` (the engine's calls a route
makes) and :class:`StreamLike` (a request's output stream), so the HTTP tests can serve a
small fake engine through the real app."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine.actors.system import (
    EngineStatistics,
)
from engine.chat.request import TemplateOptions
from engine.config import EngineConfig
from engine.core.pooling import Pooled
from engine.messages import RequestOutput
from engine.params import SamplingParams
from engine.structured import StructuredStatistics


class StreamLike(Protocol):
    """What the HTTP layer uses of a :class:`RequestStream`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]

    def __aiter__(self) -> StreamLike: ...

    async def __anext__(self) -> RequestOutput: ...

    async def __aenter__(self) -> StreamLike: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


class EngineLike(Protocol):
    """What the HTTP layer uses of an :class:`Engine` (the HTTP tests' fake implements it)."""

    config: EngineConfig
    model_name: str
    tokenizer: Any  # engine.models.tokenizer.Tokenizer
    max_model_len: int
    sampling_defaults: dict[str, Any]
    default_max_tokens: int | None
    max_tokens_cap: int | None
    dead: bool
    dead_reason: BaseException | None
    restarting: bool  # the actors are restarting after a crash (/health answers 503)
    restarts: int  # in-place restarts so far (engine:engine_restarts_total)
    # A pooling model's PoolerConfig (task "embed" or "classify"); None: it generates.
    pooler: Any
    loras: Any  # engine.api.lora.LoraRegistry: the LoRA adapters served by name

    async def submit(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        chat_options: TemplateOptions | None = None,
        lora: str | None = None,
    ) -> StreamLike: ...

    def abort(self, request_id: str) -> None: ...

    async def tokenize_chat(self, messages: Sequence[dict[str, Any]],
                            chat_options: TemplateOptions | None = None,
                            mm_processor_kwargs: dict[str, Any] | None = None) -> tuple[int, ...]: ...

    async def embed(
        self, input: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]], *,
        dimensions: int | None = None, normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None, add_special_tokens: bool = True,
        request_id: str | None = None, priority: int = 0, lora: str | None = None,
    ) -> list[Pooled]: ...

    async def classify(
        self, input: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]], *,
        use_activation: bool = True, truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True, request_id: str | None = None, priority: int = 0,
    ) -> list[tuple[list[float], int]]: ...

    async def score(
        self, first: str | Sequence[str], second: str | Sequence[str], *,
        truncate_prompt_tokens: int | None = None, request_id: str | None = None,
        priority: int = 0, lora: str | None = None,
    ) -> list[tuple[float, int]]: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None: ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def sleep(self, level: int = 1, mode: str = "abort") -> None: ...

    async def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    async def is_sleeping(self) -> bool: ...

    async def reload_weights(self) -> None: ...

    async def collective_rpc(self, method: str, timeout: float | None = None,  # noqa: ASYNC109 - vLLM's
                             args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> list[Any]: ...

    def statistics(self) -> EngineStatistics: ...

    def core_statistics(self) -> list[tuple[int, EngineStatistics]]: ...

    def structured_statistics(self) -> StructuredStatistics | None: ...
