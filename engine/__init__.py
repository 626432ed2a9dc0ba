"""engine: an LLM inference server on trio structured concurrency."""

from engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidParamError,
    ModelLoadError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
)
from engine.params import SamplingParams

__all__ = [
    "EngineDeadError",
    "EngineError",
    "InvalidParamError",
    "ModelLoadError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestError",
    "SamplingParams",
]
