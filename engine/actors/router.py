"""The output router: the edge between the engine's actors and the callers' streams.

The detokenizer's outputs arrive here as messages; each request's caller reads from its
own :class:`OutputMailbox`. The mailboxes are the per-request bounded output channels of
the design: a mailbox holds at most one pending output per sample, and a new output for a
sample whose previous one is still unread is merged into it (text and ids appended).
Delivery therefore never blocks, so a caller who stops reading cannot stall the router, the
detokenizer, or any other request; it only receives larger pieces when it reads again.

Mailboxes are opened and closed by method calls from the caller's task, not by messages:
they are in-process objects on the caller's side of the engine (like the per-request
queues of an HTTP front end) and would stay on this side if the actors moved to another
process.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import trio

from engine.errors import InvalidParamError, RequestFailedError
from engine.messages import (
    CORE_ANSWERS,
    AdmittedRequest,
    OutputBatch,
    RequestOutput,
)


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output that says what ``old`` then ``new`` said (same request and sample)."""
    logprobs = None
    if old.logprobs is not None or new.logprobs is not None:
        logprobs = (old.logprobs or ()) + (new.logprobs or ())
    return dataclasses.replace(
        new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids, logprobs=logprobs,
        prompt_logprobs=old.prompt_logprobs if old.prompt_logprobs is not None else new.prompt_logprobs,
        scheduled_time=old.scheduled_time if old.scheduled_time is not None else new.scheduled_time,
    )


class MailboxState(enum.Enum):
    OPEN = "open"  # outputs arrive
    FINISHED = "finished"  # every sample delivered its last output (some may be unread)
    FAILED = "failed"  # the engine died or closed: unread outputs, then the error
    CLOSED = "closed"  # the caller left; nothing more is read or delivered


class OutputMailbox:
    """The outputs of one request that its caller has not read yet; one state machine::

        OPEN --every sample finished--> FINISHED --close()--> CLOSED
          |----engine died---------> FAILED ---close()------^
          |----close()-------------------------------------^  (returns what to abort)

    Holds at most one output per sample, in arrival order; see the module docstring for
    why delivery merges instead of blocking.
    """

    def __init__(self, admitted: AdmittedRequest) -> None:
        self.request_id = admitted.request_id
        self.prompt_token_ids: tuple[int, ...] = admitted.samples[0].prompt_token_ids
        self.state = MailboxState.OPEN
        self.merged = 0  # outputs merged into an unread one, for statistics
        self.sample_ids = admitted.sample_ids
        self._unfinished = set(range(len(self.sample_ids)))  # by sample index
        self._abort_sent = False
        self._pending: dict[int, RequestOutput] = {}
        self._failure: BaseException | None = None
        self._wakeup = trio.Event()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- producer side (the router, the engine) ---------------------------------------------

    def put(self, output: RequestOutput) -> None:
        if self.state is not MailboxState.OPEN:
            return
        old = self._pending.pop(output.index, None)
        if old is not None:
            output = merge_outputs(old, output)
            self.merged += 1
        self._pending[output.index] = output
        if output.finished:
            self._unfinished.discard(output.index)
            if not self._unfinished:
                self.state = MailboxState.FINISHED
        self._wakeup.set()

    def fail(self, error: BaseException) -> None:
        """The engine died or closed: pending outputs are still read, then ``error``."""
        if self.state is MailboxState.OPEN:
            self.state = MailboxState.FAILED
            self._failure = error
            self._wakeup.set()

    def abort(self) -> tuple[str, ...]:
        """The samples to abort for an abort asked from outside (once; then nothing)."""
        if self.state is not MailboxState.OPEN or self._abort_sent:
            return ()
        self._abort_sent = True
        return tuple(self.sample_ids[i] for i in sorted(self._unfinished))

    def close(self) -> tuple[str, ...]:
        """The caller left: drop unread outputs; returns the samples to abort."""
        to_abort = self.abort()
        self.state = MailboxState.CLOSED
        self._pending.clear()
        self._wakeup.set()
        return to_abort

    # -- consumer side (the caller) --------------------------------------------------------

    async def receive(self) -> RequestOutput:
        """The next output; raises ``StopAsyncIteration`` after the last one."""
        # One checkpoint per call, as trio's own receives: a wait that blocked was one, so
        # what it woke for is returned at once (a second one was a scheduler round per
        # streamed output, at 32 streams a step).
        waited = False
        while True:
            if self._pending:
                if not waited:
                    await trio.lowlevel.checkpoint()
                return self._pending.pop(next(iter(self._pending)))
            if self.state is MailboxState.FAILED:
                if not waited:
                    await trio.lowlevel.checkpoint()
                assert self._failure is not None  # set with the state
                raise self._failure
            if self.state is not MailboxState.OPEN:
                if not waited:
                    await trio.lowlevel.checkpoint()
                raise StopAsyncIteration
            self._wakeup = trio.Event()
            await self._wakeup.wait()
            waited = True


@dataclasses.dataclass(frozen=True, slots=True)
class RouterStatistics:
    open_requests: int
    pending_outputs: int  # delivered, not yet read by their callers
    merged_outputs: int  # outputs merged into an unread one because a caller lagged


class OutputRouter:
    """Actor: delivers the detokenizer's outputs into the callers' mailboxes.

    ``abort`` (sync) aborts samples: those left of a request one of whose samples failed.
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[OutputBatch],
        *,
        abort: Callable[[tuple[str, ...]], None],
    ) -> None:
        self._inbox = inbox
        self._abort = abort
        # Keyed by sample id, which admission makes unique in the engine: a caller's request
        # id is only a label (two requests may share one, and one request's derived ids may
        # equal another's), so it never decides where an output goes.
        self._by_sample: dict[str, OutputMailbox] = {}
        self._mailboxes: set[OutputMailbox] = set()
        self._merged_gone = 0
        # Callers of Engine.reset_prefix_cache and start/stop_profile waiting for the
        # cores' answers, by token.
        self._answers: dict[str, trio.MemorySendChannel[Any]] = {}

    def listen_answers(
        self, token: str, answers: trio.MemorySendChannel[Any] | None,
    ) -> None:
        """Deliver each core's :class:`PrefixCacheReset`, :class:`ProfilerControlled` or
        :class:`PauseControlled` for ``token`` into ``answers`` (an unbounded channel); None
        stops."""
        if answers is None:
            self._answers.pop(token, None)
        else:
            self._answers[token] = answers

    def open(self, admitted: AdmittedRequest) -> OutputMailbox:
        """Register a new request's mailbox under its sample ids (unique by construction)."""
        taken = [s for s in admitted.sample_ids if s in self._by_sample]
        if taken:  # cannot happen: admission numbers every request; refuse rather than misroute
            raise InvalidParamError(f"sample id {taken[0]!r} is already in use", param="request_id")
        mailbox = OutputMailbox(admitted)
        self._mailboxes.add(mailbox)
        for sample_id in admitted.sample_ids:
            self._by_sample[sample_id] = mailbox
        return mailbox

    def close(self, mailbox: OutputMailbox) -> tuple[str, ...]:
        """Forget a request's mailbox (its caller left); returns the samples to abort."""
        self._forget(mailbox)
        return mailbox.close()

    def find(self, request_id: str) -> list[OutputMailbox]:
        """The open requests submitted under ``request_id`` (any number: ids are labels)."""
        return [m for m in self._mailboxes if m.request_id == request_id]

    def fail_all(self, error: BaseException) -> None:
        """Fail every open request with ``error`` (the engine died or closed)."""
        for mailbox in list(self._mailboxes):
            mailbox.fail(error)
            self._forget(mailbox)

    def fail_samples(self, sample_ids: tuple[str, ...], error: BaseException) -> tuple[str, ...]:
        """Fail the requests any of ``sample_ids`` belongs to (an engine core serving them
        died); returns their other samples, for the caller to abort."""
        lost = set(sample_ids)
        to_abort: list[str] = []
        for mailbox in {self._by_sample[s] for s in lost if s in self._by_sample}:
            to_abort.extend(s for s in mailbox.abort() if s not in lost)
            mailbox.fail(error)
            self._forget(mailbox)
        return tuple(to_abort)

    def statistics(self) -> RouterStatistics:
        boxes = self._mailboxes
        return RouterStatistics(
            open_requests=len(boxes),
            pending_outputs=sum(b.pending for b in boxes),
            merged_outputs=self._merged_gone + sum(b.merged for b in boxes),
        )

    def _forget(self, mailbox: OutputMailbox) -> None:
        if mailbox in self._mailboxes:
            self._mailboxes.discard(mailbox)
            for sample_id in mailbox.sample_ids:
                del self._by_sample[sample_id]
            self._merged_gone += mailbox.merged

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox:
            task_status.started()
            async for batch in self._inbox:
                if isinstance(batch, CORE_ANSWERS):
                    answers = self._answers.get(batch.token)
                    if answers is not None:
                        answers.send_nowait(batch)
                    continue
                for sample_id, output in zip(batch.sample_ids, batch.outputs, strict=True):
                    mailbox = self._by_sample.get(sample_id)
                    if mailbox is None:
                        continue  # its caller left; the request was aborted
                    if output.finish_reason == "error":
                        # One failed sample fails the request: the caller reads what it
                        # has not read yet, then RequestFailedError; the other samples
                        # are aborted.
                        to_abort = mailbox.abort()
                        mailbox.fail(RequestFailedError(str(output.stop_reason)))
                        self._forget(mailbox)
                        self._abort(to_abort)
                        continue
                    mailbox.put(output)
                    if mailbox.state is MailboxState.FINISHED:
                        self._forget(mailbox)
