"""Pausing generation, sleep mode and reloading the weights, as vLLM's engine clients offer
them to RL trainers and to servers sharing a machine between models
(``pause_generation``, ``resume_generation``, ``is_paused``, ``sleep``, ``wake_up``,
``is_sleeping``, and ``collective_rpc("reload_weights")``).

:class:`SleepMode` is mixed into :class:`engine.api.engine.Engine`. Each call goes to every
serving engine core's scheduler as a :class:`~engine.messages.ControlPause` and returns
once every core has answered (engine.actors.scheduler: the pause's conditions, then the
model's sleep on its thread between steps; engine.runner.sleep: what sleeping gives back).
While paused or asleep nothing is scheduled: new requests wait in the queue (vLLM blocks
them until a resume) and are served after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import trio

from engine.errors import InvalidParamError, PauseConflictError, RequestFailedError
from engine.messages import ControlPause, PauseControlled
from engine.runner.sleep import LEVEL_TAGS, check_tags

# What a pause does with the requests already in the engine (vLLM's PauseMode).
PAUSE_MODES = ("abort", "wait", "keep")
# How long a pause (other than "wait", which waits for its requests however long they
# take), a resume or a wake waits for every core's answer: a level 2 wake reads the
# checkpoint again.
PAUSE_ANSWER_SECONDS = 600.0


class SleepMode:
    """The pause and sleep calls of :class:`engine.api.engine.Engine` (which provides
    ``config`` and ``_ask_cores``)."""

    config: Any
    # The cores' last answers: paused, sleep level (-1: awake), tags asleep.
    _pause_state: tuple[bool, int, tuple[str, ...]] = (False, -1, ())

    _ask_cores: Any  # (make, seconds) -> (answers, complete)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop scheduling (vLLM's ``pause_generation``), in every engine core. ``mode``:
        ``"abort"`` ends the requests in the engine (their streams finish with
        ``finish_reason == "abort"``), ``"wait"`` returns once they have finished (new
        requests wait meanwhile), ``"keep"`` freezes them where they are, to go on after
        :meth:`resume_generation`. ``clear_cache`` drops the prefix cache afterwards (not
        with ``"keep"``). New requests wait until the resume."""
        _check_mode(mode)
        await self._control(ControlPause("", "pause", mode, bool(clear_cache), -1))

    async def resume_generation(self) -> None:
        """Schedule again after :meth:`pause_generation` (vLLM's). Refused while the model
        sleeps: :meth:`wake_up` resumes it."""
        if self._pause_state[2]:
            raise InvalidParamError("the model sleeps: wake_up resumes generation", param="action")
        await self._control(ControlPause("", "resume"))

    async def is_paused(self) -> bool:
        """Whether generation is paused (by a pause or a sleep)."""
        return self._pause_state[0]

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause as :meth:`pause_generation` does with ``mode``, then sleep (vLLM's
        ``sleep``): level 1 gives back the KV cache's memory, level 2 the weights' too (read
        again from the checkpoint by :meth:`wake_up`); level 0 only pauses. The prefix
        cache is dropped; requests kept with ``"keep"`` recompute what they had when they
        run again. Levels 1 and 2 need the engine opened with ``enable_sleep_mode``. A
        sleep no deeper than the current one changes nothing."""
        _check_mode(mode)
        if level not in LEVEL_TAGS:
            raise InvalidParamError(f"sleep level must be 0, 1 or 2, not {level!r}", param="level")
        if level >= 1 and not self.config.enable_sleep_mode:
            raise InvalidParamError("sleep mode is not enabled: open the engine with "
                                    "enable_sleep_mode (--enable-sleep-mode)", param="level")
        if level <= self._pause_state[1]:
            return
        await self._control(ControlPause("", "pause", mode, True, level))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back what sleeps (vLLM's ``wake_up``): ``tags`` "weights" and "kv_cache"
        (None: both). Once nothing sleeps, generation resumes."""
        try:
            wanted = check_tags(list(tags) if tags else None)
        except ValueError as exc:
            raise InvalidParamError(str(exc), param="tags") from None
        await self._control(ControlPause("", "wake", tags=wanted if tags else ()))

    async def is_sleeping(self) -> bool:
        """Whether anything sleeps (vLLM's ``is_sleeping``); a level 0 sleep counts, as
        vLLM's does, until :meth:`wake_up`, and so do weights a failed
        :meth:`reload_weights` left unbuilt."""
        return self._pause_state[1] >= 0 or bool(self._pause_state[2])

    async def reload_weights(self) -> None:
        """Read the checkpoint again and rebuild the model from it, in every engine core and
        on every rank (vLLM's ``collective_rpc("reload_weights")``): a trainer wrote new
        weights to the model's folder. Between two steps: the running requests are
        preempted (each recomputes what it had with the new weights and goes on) and the
        prefix cache is dropped. Weights asleep are woken by it. Generation goes on as it
        was, paused or not."""
        await self._control(ControlPause("", "reload", "keep"))

    async def collective_rpc(self, method: str, timeout: float | None = None,  # noqa: ASYNC109 - vLLM's
                             args: Sequence[Any] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's ``collective_rpc`` for the one method it is used for with this engine's
        workers, ``"reload_weights"`` (no arguments): one ``None`` a rank, as vLLM's
        workers answer it. Any other method is refused: this engine runs no caller's code
        on its workers."""
        if method != "reload_weights":
            raise InvalidParamError(f"collective_rpc runs only 'reload_weights' here, not {method!r}",
                                    param="method")
        if args or kwargs:
            raise InvalidParamError("reload_weights takes no arguments (it reads the model's own "
                                    "checkpoint)", param="args")
        if timeout is None:
            await self.reload_weights()
        else:
            try:
                with trio.fail_after(timeout):
                    await self.reload_weights()
            except trio.TooSlowError:
                raise RequestFailedError(f"reload_weights did not finish within {timeout} s; it "
                                         "goes on in the engine") from None
        config = self.config
        return [None] * (config.tensor_parallel_size * config.pipeline_parallel_size
                         * config.data_parallel_size)

    def sleeping_tags(self) -> tuple[str, ...]:
        """What sleeps now ("weights", "kv_cache")."""
        return self._pause_state[2]

    async def _control(self, message: ControlPause) -> None:
        seconds = math.inf if message.mode == "wait" and message.action == "pause" else PAUSE_ANSWER_SECONDS
        answers, complete = await self._ask_cores(
            lambda token: ControlPause(token, message.action, message.mode, message.clear_cache,
                                       message.level, message.tags), seconds)
        _record(self, answers)
        failed = [a for a in answers if isinstance(a, PauseControlled) and a.error]
        if any(a.conflict for a in failed):
            raise PauseConflictError(next(a.error for a in failed if a.conflict))
        errors = [a.error for a in failed]
        if errors or not complete:
            raise RequestFailedError(errors[0] if errors else f"an engine core did not answer "
                                     f"the {message.action}")


def _record(engine: SleepMode, answers: list[Any]) -> None:
    """Keep the cores' state from their answers: paused if any core is, the deepest sleep,
    every tag asleep somewhere."""
    got = [a for a in answers if isinstance(a, PauseControlled)]
    if got:
        engine._pause_state = (any(a.paused for a in got), max(a.sleep_level for a in got),
                               tuple(sorted({t for a in got for t in a.sleeping})))


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidParamError(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}",
                                param="mode")


__all__ = ["PAUSE_MODES", "SleepMode"]
