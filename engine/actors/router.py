"""The output router: the edge between the engine's actors and the callers' streams.

The processor's admission replies and the detokenizer's outputs arrive here as messages;
each request's caller reads from its own :class:`OutputMailbox`. The mailboxes are the
per-request bounded output channels of the design: a mailbox holds at most one pending
output per sample, and a new output for a sample whose previous one is still unread is
merged into it (text and ids appended). Delivery therefore never blocks, so a caller who
stops reading cannot stall the router, the detokenizer, or any other request; it only
receives larger pieces when it reads again.

Mailboxes are opened and closed by method calls from the embedded API, not by messages:
they are in-process objects on the caller's side of the engine (like the per-request
queues of an HTTP front end) and would stay on this side if the actors moved to another
process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import trio

from engine import errors
from engine.errors import InvalidParamError, PromptTooLongError, RequestError
from engine.messages import (
    OutputBatch,
    RequestAdmitted,
    RequestOutput,
    RequestRejected,
)


def sample_ids(request_id: str, n: int) -> tuple[str, ...]:
    """The engine ids of a request's samples: the id itself, or ``f"{id}-{i}"`` for n > 1."""
    return (request_id,) if n == 1 else tuple(f"{request_id}-{i}" for i in range(n))


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output that says what ``old`` then ``new`` said (same request and sample)."""
    logprobs = None
    if old.logprobs is not None or new.logprobs is not None:
        logprobs = (old.logprobs or ()) + (new.logprobs or ())
    return dataclasses.replace(
        new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids, logprobs=logprobs,
        prompt_logprobs=old.prompt_logprobs if old.prompt_logprobs is not None else new.prompt_logprobs,
    )


def rejection_error(reply: RequestRejected) -> errors.EngineError:
    """Rebuild the exception the processor raised from its reply."""
    if reply.error_type == "PromptTooLongError":
        return PromptTooLongError(
            prompt_tokens=reply.prompt_tokens,
            max_tokens=reply.max_tokens,
            max_model_len=reply.max_model_len,
        )
    cls = getattr(errors, reply.error_type, None)
    if isinstance(cls, type) and issubclass(cls, RequestError):
        return cls(reply.message, param=reply.param)
    if cls is errors.QueueFullError:
        return errors.QueueFullError(reply.message)
    return InvalidParamError(reply.message, param=reply.param)


class OutputMailbox:
    """The outputs of one request that its caller has not read yet.

    Holds at most one output per sample (``n`` of them), in arrival order; see the module
    docstring for why delivery merges instead of blocking.
    """

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.sample_ids = sample_ids(request_id, n)
        self.prompt_token_ids: tuple[int, ...] = ()
        self.abort_requested = False
        self.admitted = False
        self._pending: dict[int, RequestOutput] = {}
        self._unfinished = n  # samples whose finished output has not been delivered
        self._admitted = trio.Event()
        self._rejection: BaseException | None = None
        self._failure: BaseException | None = None
        self._wakeup = trio.Event()
        self.merged = 0  # outputs merged into an unread one, for statistics

    @property
    def done(self) -> bool:
        """Every sample has delivered its finished output (some may still be unread)."""
        return self._unfinished == 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- producer side (the router) ---------------------------------------------------------

    def admit(self, prompt_token_ids: tuple[int, ...]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.admitted = True
        self._admitted.set()

    def reject(self, error: BaseException) -> None:
        self._rejection = error
        self._admitted.set()

    def put(self, output: RequestOutput) -> None:
        old = self._pending.pop(output.index, None)
        if old is not None:
            output = merge_outputs(old, output)
            self.merged += 1
        self._pending[output.index] = output
        if output.finished:
            self._unfinished -= 1
        self._wakeup.set()

    def fail(self, error: BaseException) -> None:
        """The engine died or closed: pending outputs are still read, then ``error``."""
        if self._failure is None:
            self._failure = error
        self._admitted.set()
        self._wakeup.set()

    # -- consumer side (the caller) --------------------------------------------------------

    async def wait_admitted(self) -> tuple[int, ...]:
        """Wait for the processor's verdict: the prompt's ids, or the rejection raised."""
        await self._admitted.wait()
        if self._rejection is not None:
            raise self._rejection
        if not self.admitted and self._failure is not None:
            raise self._failure
        return self.prompt_token_ids

    async def receive(self) -> RequestOutput:
        """The next output; raises ``StopAsyncIteration`` after the last one."""
        while True:
            if self._pending:
                await trio.lowlevel.checkpoint()
                index = next(iter(self._pending))
                output = self._pending.pop(index)
                return output
            if self.done:
                await trio.lowlevel.checkpoint()
                raise StopAsyncIteration
            if self._failure is not None:
                await trio.lowlevel.checkpoint()
                raise self._failure
            self._wakeup = trio.Event()
            await self._wakeup.wait()


@dataclasses.dataclass(frozen=True, slots=True)
class RouterStatistics:
    open_requests: int
    pending_outputs: int  # delivered, not yet read by their callers
    merged_outputs: int  # outputs merged into an unread one because a caller lagged


class OutputRouter:
    """Actor: delivers admission replies and outputs into the callers' mailboxes.

    ``abort`` is called with sample ids for requests whose caller went away before the
    processor admitted them (so the scheduler drops them as soon as they arrive).
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[RequestAdmitted | RequestRejected | OutputBatch],
        *,
        abort: Callable[[tuple[str, ...]], None],
    ) -> None:
        self._inbox = inbox
        self._abort = abort
        self._mailboxes: dict[str, OutputMailbox] = {}
        # Closed before the processor answered: kept until it does, so that the samples it
        # admits anyway can be aborted by id.
        self._closed_unadmitted: dict[str, OutputMailbox] = {}
        self._merged_closed = 0

    def open(self, request_id: str, n: int) -> OutputMailbox:
        """Register a new request's mailbox; the id must not be in use."""
        if request_id in self._mailboxes:
            raise InvalidParamError(f"request id {request_id!r} is already in use", param="request_id")
        mailbox = OutputMailbox(request_id, n)
        self._mailboxes[request_id] = mailbox
        return mailbox

    def close(self, request_id: str) -> OutputMailbox | None:
        """Forget a request's mailbox (its caller left); later outputs for it are dropped."""
        mailbox = self._mailboxes.pop(request_id, None)
        if mailbox is not None:
            self._merged_closed += mailbox.merged
            if not mailbox.admitted:
                mailbox.abort_requested = True
                self._closed_unadmitted[request_id] = mailbox
        return mailbox

    def forget(self, request_id: str) -> None:
        """Drop a mailbox whose request never reached the processor."""
        self._mailboxes.pop(request_id, None)

    def get(self, request_id: str) -> OutputMailbox | None:
        return self._mailboxes.get(request_id)

    def fail_all(self, error: BaseException) -> None:
        """Fail every open request with ``error`` (the engine died or closed)."""
        for mailbox in self._mailboxes.values():
            mailbox.fail(error)
        self._closed_unadmitted.clear()

    def statistics(self) -> RouterStatistics:
        boxes = self._mailboxes.values()
        return RouterStatistics(
            open_requests=len(self._mailboxes),
            pending_outputs=sum(b.pending for b in boxes),
            merged_outputs=self._merged_closed + sum(b.merged for b in boxes),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox:
            task_status.started()
            async for message in self._inbox:
                if isinstance(message, OutputBatch):
                    self._deliver(message.outputs)
                elif isinstance(message, RequestAdmitted):
                    self._admitted(message)
                else:
                    self._closed_unadmitted.pop(message.request_id, None)
                    mailbox = self._mailboxes.pop(message.request_id, None)
                    if mailbox is not None:
                        mailbox.reject(rejection_error(message))

    def _admitted(self, reply: RequestAdmitted) -> None:
        mailbox = self._mailboxes.get(reply.request_id)
        if mailbox is None:
            mailbox = self._closed_unadmitted.pop(reply.request_id, None)
        if mailbox is None:
            return
        if mailbox.abort_requested:
            # The caller left (or aborted) while the processor was admitting: the samples
            # reached the scheduler just before this reply, so this abort follows them.
            self._abort(mailbox.sample_ids)
        mailbox.admit(reply.prompt_token_ids)

    def _deliver(self, outputs: tuple[RequestOutput, ...]) -> None:
        for output in outputs:
            mailbox = self._mailboxes.get(output.request_id)
            if mailbox is None:
                continue  # its caller left; the request was aborted
            mailbox.put(output)
            if mailbox.done:
                self.close(output.request_id)
