"""The scheduler's live requests and its two queues, in policy order.

``fcfs`` orders by arrival; ``priority`` by priority (a larger value is a lower priority),
then arrival. The running queue is kept in that order too, so its last request is the one
to preempt. A preempted request goes back to the front of the waiting queue (``fcfs``) or
to its place in it (``priority``).

A sample of an ``n > 1`` request may wait for another sample's prompt: it is not
scheduled until that prompt is computed, so the prompt's blocks are shared through the
prefix cache rather than computed twice.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from engine.core.request import Request


class RequestQueue:
    """Live requests by sample id, the waiting and running queues, and the samples waiting
    for another one's prompt. Membership only: request state is the scheduler's."""

    def __init__(self, policy: str) -> None:
        self._priority = policy == "priority"
        self._key: Callable[[Request], tuple[int, ...]] = (
            _priority_key if self._priority else _fcfs_key)
        self._requests: dict[str, Request] = {}
        # Read freely; changed only through the methods below.
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # kept in queue order: the victim is the last
        self._waiters: dict[str, list[Request]] = {}  # request id -> samples waiting for its prompt
        self._prompt_pending: set[str] = set()  # live requests whose prompt is not all computed

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._requests

    def get(self, sample_id: str) -> Request | None:
        return self._requests.get(sample_id)

    def ids(self) -> tuple[str, ...]:
        """Every live request's sample id, waiting and running."""
        return tuple(self._requests)

    def computing_prompt(self, sample_id: str) -> bool:
        """Whether ``sample_id`` is live and its prompt is not all computed yet."""
        return sample_id in self._prompt_pending

    def add(self, req: Request) -> None:
        """A new request, at the back of the waiting queue (its place, by priority)."""
        self._requests[req.sample_id] = req
        self._prompt_pending.add(req.sample_id)
        if req.wait_for is not None:
            self._waiters.setdefault(req.wait_for, []).append(req)
        self._enqueue_waiting(req, front=False)

    def start(self, req: Request) -> None:
        """Move a waiting request to its place in the running queue."""
        self.waiting.remove(req)
        bisect.insort(self.running, req, key=self._key)

    def requeue(self, req: Request) -> None:
        """Move a preempted running request back to the waiting queue."""
        self.running.remove(req)
        self._enqueue_waiting(req, front=True)

    def remove(self, req: Request) -> None:
        """Forget a finished request; samples waiting for its prompt wait no more."""
        del self._requests[req.sample_id]
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.prompt_computed(req.sample_id)

    def prompt_computed(self, sample_id: str) -> None:
        """``sample_id``'s prompt is in the KV cache: wake the samples waiting for it."""
        self._prompt_pending.discard(sample_id)
        for waiter in self._waiters.pop(sample_id, ()):
            waiter.wait_for = None

    def _enqueue_waiting(self, req: Request, *, front: bool) -> None:
        if self._priority:
            bisect.insort(self.waiting, req, key=self._key)
        elif front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)


def _fcfs_key(req: Request) -> tuple[int, ...]:
    return (req.arrival,)


def _priority_key(req: Request) -> tuple[int, ...]:
    return (req.priority, req.arrival)
