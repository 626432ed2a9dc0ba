"""Errors raised by the engine, split the way callers need to handle them.

Two families matter to a caller:

* :class:`RequestError` and its subclasses: this one request is bad (invalid sampling
  parameters, a prompt longer than the context, an unknown model name). The engine keeps
  serving every other request. They subclass :class:`ValueError` so ``except ValueError``
  catches validation failures the usual Python way.
* :class:`RequestFailedError`: one admitted request failed inside the engine (its logits
  held NaN or masked every token, or the model step it was in raised). Only that request
  (or only that step's requests) fails; the engine goes on serving (HTTP 500).
* :class:`EngineDeadError`: an actor crashed. Every in-flight request fails with it; the
  engine restarts its actors (see ``max_engine_restarts``) or, past its restart limit,
  stays dead and later calls fail with it too.

:class:`ConfigError` (a bad engine option) and :class:`ModelLoadError` and its subclasses
(loading weights and tokenizers) come before any request exists.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class RequestError(EngineError, ValueError):
    """A single request was rejected or failed; the engine goes on serving others.

    ``param`` names the offending field where there is one (OpenAI's error body carries it).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidParamError(RequestError):
    """A sampling or request parameter is out of range or of the wrong type."""


class BatchPromptError(RequestError):
    """One prompt of an offline batch (:class:`engine.LLM`) was refused before any prompt
    of the batch ran. ``index`` is its place in the list the caller gave, ``error`` (also
    ``__cause__``) the refusal itself (an :class:`InvalidParamError`, a
    :class:`PromptTooLongError`, ...); ``param`` is the refusal's."""

    def __init__(self, index: int, error: RequestError) -> None:
        super().__init__(f"prompt {index}: {error.message}", param=error.param)
        self.index = index
        self.error = error


class ConfigError(EngineError, ValueError):
    """An engine option (an :class:`engine.config.EngineConfig` field, a server flag) is out
    of range, of the wrong type or unknown. ``field`` names it where there is one."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLongError(RequestError):
    """The prompt plus the requested output does not fit the model's context."""

    def __init__(self, *, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="messages_or_prompt",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class InputTooLongError(PromptTooLongError):
    """A pooling model's input (embed, score, rerank) is longer than it takes."""

    def __init__(self, *, prompt_tokens: int, max_model_len: int, param: str = "input") -> None:
        RequestError.__init__(
            self,
            f"This model's maximum input length is {max_model_len} tokens. However, an input "
            f"has {prompt_tokens} tokens. Please shorten it, or set truncate_prompt_tokens.",
            param=param,
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = 0
        self.max_model_len = max_model_len


class PromptTextTooLongError(PromptTooLongError):
    """The prompt's text is too long for any tokenization of it to fit the context:
    refused before it is tokenized (tokenizing megabytes takes seconds)."""

    def __init__(self, *, chars: int, max_chars: int, max_model_len: int) -> None:
        RequestError.__init__(
            self,
            f"This model's maximum context length is {max_model_len} tokens. However, the "
            f"prompt is {chars} characters, more than any {max_model_len} tokens can stand "
            f"for (at most {max_chars} characters). Please reduce the prompt.",
            param="messages_or_prompt",
        )
        self.prompt_tokens = None
        self.max_tokens = None
        self.max_model_len = max_model_len


class QueueFullError(EngineError):
    """Admission control: the waiting queue is at its limit. Try again later (HTTP 429)."""


class RequestFailedError(EngineError):
    """An admitted request failed inside the engine; others go on. The message says why
    in the engine's own words (never an internal exception's text)."""


class PauseConflictError(EngineError):
    """A pause or sleep of the engine met another one under way (vLLM answers such a
    ``/sleep`` or ``/wake_up`` with 409): nothing changed; retry once that one is done."""


class EngineDeadError(EngineError):
    """An actor of the engine crashed; no request can be served any more."""


class ModelLoadError(EngineError):
    """A model could not be loaded. The message names the file and the problem."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist or lacks a required file."""


class ModelAccessError(ModelLoadError, PermissionError):
    """The Hugging Face Hub refused access to a gated or private repo (no token, or one
    without access)."""


class CorruptModelError(ModelLoadError):
    """A weight, config or tokenizer file exists but cannot be parsed."""


class UnsupportedModelError(ModelLoadError):
    """The architecture, quantization type or configuration is not implemented."""


class LoraAdapterError(RequestError):
    """A LoRA adapter that cannot be served (loaded or used): the message names it and the
    problem (HTTP 400)."""

    def __init__(self, name: str, message: str, *, param: str | None = "lora_path") -> None:
        super().__init__(f"LoRA adapter {name!r}: {message}", param=param)
        self.name = name


class UnknownLoraAdapterError(LoraAdapterError):
    """No adapter of that name is served (HTTP 404)."""
