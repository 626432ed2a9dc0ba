"""The runner's LoRA adapters: read on first use, kept in host memory (least recently used
evicted past ``--max-cpu-loras``), copied into the model's slots (``--max-loras``, least
recently used evicted) for the steps that use them, and each step's token-to-slot table.

A request names its adapter by :class:`engine.messages.LoraAdapter` (name, folder, id);
the runner reads the folder itself, so a core in another process needs nothing but the
request. The scheduler keeps the adapters of one step within the slots; a step asking for
more is a :class:`StepPlanError` (a bug, not a bad request).

With tensor or pipeline parallelism every rank runs its own manager over the same step
plans: it reads each adapter from its folder itself, keeps only its cut of it
(:meth:`LoraSlots.cut`: its stage's layers, its share of each), and fills its slots in the
same order, so every rank computes the same token-to-slot table from the plan (the
workers' answers are checked against rank 0's each step, as for sampled tokens).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch

from engine.errors import UnsupportedModelError
from engine.messages import LoraAdapter, ScheduledChunk
from engine.models.config import ModelConfig
from engine.models.lora import LoraWeights, read_lora_adapter
from engine.ops import LoraSegments
from engine.runner.request_state import RequestState, StepPlanError


@dataclasses.dataclass(frozen=True, slots=True)
class LoraSettings:
    """The engine's LoRA limits (EngineConfig's --max-loras, --max-lora-rank,
    --max-cpu-loras and --lora-dtype resolved)."""

    max_loras: int
    max_rank: int
    max_cpu_loras: int
    dtype: torch.dtype


class LoraManager:
    """Adapters between their folders, host memory and the model's slots."""

    def __init__(self, model, config: ModelConfig, settings: LoraSettings) -> None:
        enable = getattr(model, "enable_lora", None)
        if enable is None:
            raise UnsupportedModelError(f"LoRA adapters are not supported for {config.architecture} models")
        self.config = config
        self.settings = settings
        self.slots = enable(max_loras=settings.max_loras, max_rank=settings.max_rank, dtype=settings.dtype)
        self.device = next(iter(self.slots.wrappers[0].values())).a.device
        self._host: OrderedDict[int, LoraWeights] = OrderedDict()  # adapter id -> weights, LRU first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        # Live requests per adapter id: their adapters stay read (a slot may need them again
        # after an eviction, and their folders may be gone by then: an unloaded adapter).
        self._pins: dict[int, int] = {}
        self.loads = 0  # adapters read from their folders (tests read it)
        self.slot_writes = 0  # adapters copied into a slot

    def acquire(self, adapter: LoraAdapter) -> None:
        """A request starts with ``adapter``: read it (unless held) and keep it read until
        :meth:`release`; raises :class:`engine.errors.LoraAdapterError`."""
        self.load(adapter)
        self._pins[adapter.id] = self._pins.get(adapter.id, 0) + 1

    def release(self, adapter: LoraAdapter) -> None:
        left = self._pins.get(adapter.id, 0) - 1
        if left > 0:
            self._pins[adapter.id] = left
        else:
            self._pins.pop(adapter.id, None)
            self._trim()

    def _trim(self, keep: int | None = None) -> None:
        """Past --max-cpu-loras, drop the least recently used adapters no live request holds
        (those held stay: a step may need them in a slot again), and never ``keep``."""
        excess = len(self._host) - self.settings.max_cpu_loras
        for aid in [aid for aid in self._host if aid not in self._pins and aid != keep][:max(0, excess)]:
            del self._host[aid]

    def load(self, adapter: LoraAdapter) -> LoraWeights:
        """``adapter``'s weights, read from its folder unless held; raises
        :class:`engine.models.lora.LoraAdapterError`."""
        held = self._host.get(adapter.id)
        if held is not None:
            self._host.move_to_end(adapter.id)
            return held
        # Checked whole, then kept as this rank holds it: its stage's layers, its cut of each.
        weights = self.slots.cut(read_lora_adapter(adapter.path, adapter.name, self.config, self.settings.max_rank))
        self.loads += 1
        self._host[adapter.id] = weights
        self._trim(keep=adapter.id)
        return weights

    def segments(self, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState]) -> LoraSegments | None:
        """The step's token-to-slot table (None: every token is the base model's), with
        each adapter of the step in a slot."""
        adapters = {s.lora.id: s.lora for s in states if s.lora is not None}
        if not adapters:
            return None
        if len(adapters) > self.settings.max_loras:
            raise StepPlanError(f"{len(adapters)} adapters in one step exceed max_loras={self.settings.max_loras}")
        slot_of = {aid: self._slot(adapter, adapters) for aid, adapter in adapters.items()}
        runs: list[tuple[int, int, int]] = []
        token_slots: list[int] = []
        start = 0
        for c, s in zip(chunks, states, strict=True):
            # The chunk's rows in the flat batch: a proposal's positions are within
            # num_tokens (ScheduledChunk), as Batch.prepare lays them out. Not counted from
            # the request's tokens: a tensor- or pipeline-parallel worker's may lag.
            n = c.num_tokens
            slot = -1 if s.lora is None else slot_of[s.lora.id]
            token_slots.extend((slot,) * n)
            if slot >= 0:
                if runs and runs[-1][2] == slot and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], start + n, slot)
                else:
                    runs.append((start, start + n, slot))
            start += n
        table = torch.tensor(token_slots, dtype=torch.int32)
        return LoraSegments(tuple(runs), table if self.device.type == "cpu" else table.to(self.device))

    def _slot(self, adapter: LoraAdapter, needed: dict[int, LoraAdapter]) -> int:
        slot = self._slot_of.get(adapter.id)
        if slot is not None:
            self._slot_of.move_to_end(adapter.id)
            return slot
        used = set(self._slot_of.values())
        free = [s for s in range(self.settings.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:  # the least recently used adapter this step does not need
            victim = next(aid for aid in self._slot_of if aid not in needed)
            slot = self._slot_of.pop(victim)
        self.slots.write(slot, self.load(adapter))
        self.slot_writes += 1
        self._slot_of[adapter.id] = slot
        return slot


__all__ = ["LoraManager", "LoraSettings"]
