"""The HTTP layer's errors: :class:`APIError` (an answer with a status and OpenAI's error
body) and :func:`error_from_exception`, which maps every typed engine error to one.

Every API family raises :class:`APIError` for bad input; the app's error handler says it
in the family's shape (OpenAI's ``{"error": {...}}``, or Anthropic's).
"""

from __future__ import annotations

from typing import Any

from engine.errors import (
    EngineDeadError,
    PauseConflictError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
    RequestFailedError,
    UnknownLoraAdapterError,
)

# Error codes whose cause the engine has already logged (a crash, a failed step).
LOGGED_ELSEWHERE = ("engine_dead", "request_failed")



class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def rename_param(exc: APIError | RequestError, new: str) -> None:
    """Name the request field ``new`` in an error found under another name (a field the
    route rewrote before the chat layer read it): its ``param`` and its message."""
    old = exc.param
    if old is None or old == new:
        return
    exc.param = new
    exc.message = exc.message.replace(old, new)
    exc.args = (exc.message,)


def error_from_exception(exc: BaseException) -> APIError:
    """Map an engine error to its HTTP status and OpenAI error body.

    A request's own failure is a 4xx; the engine being dead is a 503. Anything else is a
    500 whose message hides internals (they go to the log instead).
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnknownLoraAdapterError):
        return APIError(404, exc.message, param=exc.param, code="model_not_found")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, exc.message, param=exc.param, code="context_length_exceeded")
    if isinstance(exc, RequestError):
        return APIError(400, exc.message, param=exc.param, code="invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(
            429, str(exc) or "The server is at capacity; retry later.",
            type="rate_limit_error", code="queue_full",
        )
    if isinstance(exc, PauseConflictError):  # vLLM's 409 for a sleep or wake-up under way
        return APIError(409, f"{exc}; retry once it is done", code="transition_in_progress")
    if isinstance(exc, RequestFailedError):
        # The message is the engine's own reason (e.g. NaN logits), never internal text.
        return APIError(500, f"The request failed inside the engine: {exc}",
                        type="internal_error", code="request_failed")
    if isinstance(exc, EngineDeadError):
        # The cause (an internal exception) goes to the log, not to the client.
        return APIError(
            503, "The engine is not serving right now (it is restarting or has stopped); "
            "retry later.", type="service_unavailable", code="engine_dead",
        )
    return APIError(500, "Internal server error.", type="internal_error", code="internal_error")
