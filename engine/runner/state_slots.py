"""Which recurrent-state slot each request of a hybrid model holds (its Mamba or DeltaNet layers'
conv and SSM states, engine.models.layers.mamba).

A request takes a free slot at its first chunk (position 0) and keeps it until the
scheduler says it finished or was preempted (``StepPlan.finished_ids`` /
``preempted_ids``), or its step failed. At most ``max_num_seqs`` requests run at once, so
that many slots serve every plan; a plan that would need more, or a chunk past position 0
of a request without a slot, is a :class:`StepPlanError` (the scheduler and the runner
disagree). Every tensor-parallel rank and pipeline stage sees the same plans in the same
order and so hands out the same slots.

With the prefix cache on, ``checkpoints`` more slots follow the requests' (checkpoint
``c`` is slot ``count + c``): the block pool (engine.core.block_pool) decides which
checkpoint a chunk starts from or saves into, and the layers copy the states
(engine.models.layers.recurrent). A chunk that starts from a checkpoint takes its
request's slot there, whatever its position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.messages import ScheduledChunk
from engine.runner.request_state import StepPlanError


class StateSlots:
    """``count`` slots, handed out lowest first."""

    def __init__(self, count: int, device: torch.device, checkpoints: int = 0) -> None:
        self.count = count
        self.checkpoints = checkpoints
        self.device = device
        self._free = list(range(count - 1, -1, -1))
        self._owner: dict[str, int] = {}

    @property
    def in_use(self) -> int:
        return len(self._owner)

    def release(self, sample_id: str) -> None:
        """``sample_id``'s slot goes back to the free list (no-op without one)."""
        slot = self._owner.pop(sample_id, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        for sample_id in list(self._owner):
            self.release(sample_id)

    def assign(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Each chunk's slot, on the device and on the host, taking one for a request's
        first chunk. A request starting again at position 0 keeps its slot (its states
        are started afresh: the mixer reads a chunk at position 0 as a start)."""
        slots = []
        for c in chunks:
            slot = self._owner.get(c.sample_id)
            if slot is None:
                if c.start != 0 and c.state_load < 0:
                    raise StepPlanError(f"request {c.sample_id!r}: a chunk at position {c.start} "
                                        "but no recurrent state to continue from")
                if not self._free:
                    raise StepPlanError(f"request {c.sample_id!r}: all {self.count} recurrent "
                                        "state slots are held (max_num_seqs)")
                slot = self._owner[c.sample_id] = self._free.pop()
            slots.append(slot)
        return torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True), tuple(slots)

    def checkpoint_copies(self, chunks: Sequence[ScheduledChunk]) -> tuple[
            tuple[tuple[int, int], ...], tuple[tuple[int, int, int], ...]]:
        """The chunks' checkpoint loads ``(b, slot)`` and saves ``(b, offset, slot)`` by
        their index in the step."""
        loads, saves = [], []
        for b, c in enumerate(chunks):
            if c.state_load >= 0:
                loads.append((b, self._checkpoint_slot(c.state_load, c.sample_id)))
            last = 0
            for offset, ckpt in c.state_save:
                if not last < offset <= c.num_tokens:
                    raise StepPlanError(f"request {c.sample_id!r}: a state checkpoint after {offset} "
                                        f"of a chunk's {c.num_tokens} tokens (after {last})")
                saves.append((b, offset, self._checkpoint_slot(ckpt, c.sample_id)))
                last = offset
        return tuple(loads), tuple(saves)

    def _checkpoint_slot(self, ckpt: int, sample_id: str) -> int:
        if not 0 <= ckpt < self.checkpoints:
            raise StepPlanError(f"request {sample_id!r}: state checkpoint {ckpt} of {self.checkpoints}")
        return self.count + ckpt


__all__ = ["StateSlots"]
