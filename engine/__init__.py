"""engine: an LLM inference server on trio structured concurrency.

``engine.open_engine`` opens the embedded trio API (see :mod:`engine.api`);
``engine.LLM`` is the synchronous offline API for scripts and notebooks, shaped like
vLLM's (:mod:`engine.api.offline`). They and the types around them are imported on first
use, so ``import engine`` stays light (no torch).
"""

from typing import TYPE_CHECKING, Any

from engine.errors import (
    BatchPromptError,
    ConfigError,
    EngineDeadError,
    EngineError,
    InvalidParamError,
    ModelLoadError,
    PauseConflictError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
)
from engine.messages import RequestOutput, TokenLogprob, Usage
from engine.params import BeamSearchParams, LoRARequest, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from engine.api import Engine, EngineStatistics, RequestStream, open_engine
    from engine.api.offline import LLM
    from engine.config import EngineConfig

_LAZY = {
    "open_engine": "engine.api",
    "Engine": "engine.api",
    "EngineStatistics": "engine.api",
    "RequestStream": "engine.api",
    "EngineConfig": "engine.config",
    "LLM": "engine.api.offline",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "LLM",
    "BatchPromptError",
    "BeamSearchParams",
    "LoRARequest",
    "PoolingParams",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStatistics",
    "InvalidParamError",
    "ModelLoadError",
    "PauseConflictError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
    "open_engine",
]
