"""The bounded in-memory store behind ``/v1/responses``' ``store`` and ``previous_response_id``.

Pure (no I/O, no trio): the Responses routes (:mod:`engine.http.responses.routes`) own
one and call it from their one trio thread.

Each stored response keeps only its own turn: the chat messages its input added (the
previous turns are not copied) and its reply, with a link to the response it continued.
A conversation is read back by walking the links, so a chain of N turns costs N turns of
memory, not N²::

    resp_a (turn: user, assistant) <- resp_b (turn: tool result, assistant) <- resp_c ...

Bounds, both from :class:`engine.config.EngineConfig`:

* ``max_bytes``: the JSON size of what is kept; past it the least recently used responses
  go first (reading or continuing a conversation uses every response in its chain).
* ``ttl``: seconds a response is kept after its last use.

A chain whose older turn was dropped (or deleted) cannot be continued: :meth:`history`
raises :class:`MissingResponse` naming the missing id rather than answering from half a
conversation. Everything is lost when the server stops.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any


class MissingResponse(LookupError):
    """``response_id`` is not (or no longer) stored."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its body, its input items, the chat messages of its turn."""

    body: dict[str, Any]  # the response object, as GET returns it
    input_items: tuple[dict[str, Any], ...]  # this request's input items, with ids
    turn: tuple[dict[str, Any], ...]  # chat messages: this input's, then the reply's
    previous_id: str | None
    size: int  # bytes of JSON, counted against max_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class StoreStatistics:
    responses: int
    bytes: int
    evicted: int  # dropped for size or age since the start


class ResponseStore:
    """Responses by id, bounded by ``max_bytes`` of JSON and ``ttl`` seconds of disuse.

    ``clock`` returns seconds (monotonic); tests pass a fake one.
    """

    def __init__(self, max_bytes: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 1 or not ttl > 0:
            raise ValueError("a response store needs max_bytes >= 1 and ttl > 0")
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        # Least recently used first; the value is (entry, last use).
        self._entries: collections.OrderedDict[str, tuple[StoredResponse, float]] = (
            collections.OrderedDict())
        self._bytes = 0
        self._evicted = 0

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(len(self._entries), self._bytes, self._evicted)

    def __contains__(self, response_id: object) -> bool:
        self._expire()
        return response_id in self._entries

    def put(self, response_id: str, body: dict[str, Any],
            input_items: Sequence[dict[str, Any]], turn: Sequence[dict[str, Any]],
            previous_id: str | None) -> bool:
        """Store a finished response; False when it alone is over ``max_bytes`` (then it
        is not stored). Older responses are dropped to make room."""
        self._expire()
        size = sum(len(json.dumps(part, ensure_ascii=False, separators=(",", ":")))
                   for part in (body, list(input_items), list(turn)))
        if size > self.max_bytes:
            return False
        self._drop(response_id)
        while self._entries and self._bytes + size > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self._evicted += 1
        entry = StoredResponse(body, tuple(input_items), tuple(turn), previous_id, size)
        self._entries[response_id] = (entry, self._clock())
        self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse:
        """The response (a use: it becomes the most recent); :class:`MissingResponse`."""
        self._expire()
        found = self._entries.get(response_id)
        if found is None:
            raise MissingResponse(response_id)
        self._entries[response_id] = (found[0], self._clock())
        self._entries.move_to_end(response_id)
        return found[0]

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages of the conversation up to and including ``response_id``'s
        reply, oldest first; every response in the chain counts as used.
        :class:`MissingResponse` names the first one missing."""
        turns: list[tuple[dict[str, Any], ...]] = []
        seen: set[str] = set()
        next_id: str | None = response_id
        while next_id is not None and next_id not in seen:  # ids are fresh: no cycles
            seen.add(next_id)
            entry = self.get(next_id)
            turns.append(entry.turn)
            next_id = entry.previous_id
        return [message for turn in reversed(turns) for message in turn]

    def delete(self, response_id: str) -> None:
        """Forget the response; :class:`MissingResponse` when it is not stored."""
        self._expire()
        if response_id not in self._entries:
            raise MissingResponse(response_id)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        found = self._entries.pop(response_id, None)
        if found is not None:
            self._bytes -= found[0].size

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl
        # Least recently used first, so the expired ones are a prefix.
        while self._entries:
            oldest, (_, used) = next(iter(self._entries.items()))
            if used > deadline:
                break
            self._drop(oldest)
            self._evicted += 1
