"""Server-side logits processors: vLLM V1's batch-level interface, loaded by name at startup.

A processor is a class named on the command line (``--logits-processors
my_pkg.bans:BanToken``, several separated by commas) and written against
:class:`LogitsProcessor` here, which mirrors vLLM V1's
(``vllm.v1.sample.logits_processor.LogitsProcessor``)::

    class BanToken(LogitsProcessor):
        def __init__(self, config, device, is_pin_memory):
            self.banned = {}                       # batch row -> token id

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.banned.pop(index, None)
            for index, params, _prompt, _outputs in batch_update.added:
                token = (params.extra_args or {}).get("ban")
                if token is None:
                    self.banned.pop(index, None)
                else:
                    self.banned[index] = token
            for a, b, direction in batch_update.moved:
                ...                                # move (or swap) row a's entry to b

        def apply(self, logits):                   # [batch_size, vocab], this step's rows
            for index, token in self.banned.items():
                logits[index, token] = float("-inf")
            return logits

Each step the processors see the requests that sample in it, one row each, as a persistent
batch: :meth:`ProcessorBatch.apply` tells them what changed since the step before
(:class:`BatchUpdate`: removed rows first, then added ones, then moves that keep the batch
dense, vLLM's order) and hands them the step's logits laid out in that order. ``added``
gives each new request's ``SamplingParams`` (``extra_args`` carries the request's
``vllm_xargs``), its prompt ids and its output ids as a live list, which grows as the
request samples. A request that skips a step (a prefill chunk that does not sample yet)
leaves the batch and is added again when it samples: its parameters are all a processor
should key on.

``validate_params`` is called at admission for every request (a ``ValueError`` is the
request's 400). A processor that raises in ``update_state`` or ``apply`` fails the requests
of that step (the ones it was applied to) with its error; the engine goes on, and the next
step starts the processors over from an empty batch (every earlier row removed).

Speculative decoding verifies several rows of a request in one step, which this interface
has no place for: the engine refuses ``--logits-processors`` with ``--speculative-config``
(as vLLM does), and a request's ``prediction`` (Predicted Outputs) when processors run.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from engine.errors import ConfigError
from engine.params import SamplingParams


class MoveDirectionality(enum.Enum):
    """How a row moves in :attr:`BatchUpdate.moved`: to an empty place, or swapped."""

    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


# vLLM's names: an added request is (batch index, params, prompt ids, live output ids); a
# removed one its index; a move (from, to, direction).
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
RemovedRequest = int
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclasses.dataclass(frozen=True)
class BatchUpdate:
    """What changed in the batch since the processors last saw it; apply ``removed``,
    then ``added``, then ``moved`` (an added or moved row may take an index another
    request had)."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessorConfig:
    """What a processor is told of the engine when it is built (vLLM passes its whole
    config; these are the parts a processor reads in practice)."""

    vocab_size: int  # the width of the logits
    max_num_seqs: int  # the most rows a step can hold


class LogitsProcessor(abc.ABC):
    """A server-side logits processor (vLLM V1's interface; see the module docstring).

    Built once per model runner (``__init__(config, device, is_pin_memory)``, run in the
    runner's thread); ``update_state`` then ``apply`` once per step that samples."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request whose parameters (``extra_args``) this
        processor cannot take; the request is refused before it is queued. Takes every
        request unless overridden."""
        return None

    @abc.abstractmethod
    def __init__(self, config: ProcessorConfig, device: torch.device, is_pin_memory: bool) -> None:
        ...

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits ([batch_size, vocab], fp32) processed; in place or new."""

    @abc.abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token is the most likely (the engine
        applies it either way)."""

    @abc.abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Take the batch's changes (None: none since the last step)."""


class _Processor(Protocol):
    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...

    def update_state(self, batch_update: BatchUpdate | None) -> None: ...


def parse_names(text: str) -> tuple[str, ...]:
    """``--logits-processors``: comma-separated ``module:Class`` (or ``module.Class``)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def load_logits_processors(names: Sequence[str]) -> tuple[type, ...]:
    """The classes ``names`` name, imported; :class:`ConfigError` naming
    ``logits_processors`` for a name that does not import or is no processor."""
    classes = []
    for name in names:
        module_name, sep, attr = name.partition(":")
        if not sep:
            module_name, _, attr = name.rpartition(".")
        if not module_name or not attr:
            raise _bad(f"{name!r} is not module:Class (or module.Class)")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # an import runs the module's code: any error is its
            raise _bad(f"cannot import {module_name!r} for {name!r}: {exc}") from exc
        cls = getattr(module, attr, None)
        if not isinstance(cls, type):
            raise _bad(f"{module_name!r} has no class {attr!r}")
        missing = [m for m in ("apply", "update_state", "validate_params")
                   if not callable(getattr(cls, m, None))]
        if missing:
            raise _bad(f"{name!r} is no logits processor: it lacks {', '.join(missing)} "
                       "(subclass engine.runner.logits_processors.LogitsProcessor)")
        classes.append(cls)
    return tuple(classes)


def _bad(message: str) -> ConfigError:
    return ConfigError(f"logits_processors: {message}", field="logits_processors")


def _describe(processor: object) -> str:
    cls = type(processor)
    return f"{cls.__module__}:{cls.__qualname__}"


class ProcessorBatch:
    """The processors of one model runner and their view of the batch (see the module
    docstring). Not thread-safe: it lives in the runner's thread."""

    def __init__(self, processors: Sequence[_Processor]) -> None:
        self.processors = tuple(processors)
        self._slots: dict[str, int] = {}  # request key -> its row in the processors' batch
        # After a failure the processors' state is unknown: their rows are removed at the
        # next step and every request is added again.
        self._stale: tuple[int, ...] = ()

    @classmethod
    def build(cls, classes: Sequence[type], config: ProcessorConfig,
              device: torch.device) -> ProcessorBatch | None:
        """One instance of each class (None when there are none)."""
        if not classes:
            return None
        return cls([c(config, device, False) for c in classes])

    def reset(self) -> None:
        """Forget every request (the runner forgot them): removed at the next step."""
        self._stale = tuple(sorted({*self._stale, *self._slots.values()}))
        self._slots = {}

    def apply(self, logits: torch.Tensor, rows: Sequence[Any]) -> tuple[torch.Tensor, dict[int, str]]:
        """Run the processors over ``logits`` (row ``b`` for ``rows[b]``, whose ``key``
        names its request). Returns the processed logits in the same row order, and the
        rows that failed, with why (every row, if a processor raised)."""
        keys = [r.key for r in rows]
        if None in keys or len(set(keys)) != len(keys):
            # One row per request is what the interface has room for (the runner refuses
            # proposals with processors): anything else is the runner's own fault.
            reason = "logits processors take one row per request and step"
            return logits, dict.fromkeys(range(len(rows)), reason)
        update, order = self._update(keys, rows)
        batch = logits if order == list(range(len(rows))) else logits[order]
        try:
            # The logits are the model's inference tensors (compute_logits runs under
            # inference mode): a processor writes them in place, as under vLLM.
            with torch.inference_mode():
                for processor in self.processors:
                    processor.update_state(update)
                    batch = processor.apply(batch)
                    if not isinstance(batch, torch.Tensor) or batch.shape != logits.shape:
                        raise TypeError(f"apply returned {type(batch).__name__} "
                                        f"{tuple(getattr(batch, 'shape', ()))}, not a "
                                        f"{tuple(logits.shape)} tensor")
        except Exception as exc:  # the processor is the operator's code: any error is its
            self.reset()
            reason = f"logits processor {_describe(processor)} failed: {type(exc).__name__}: {exc}"
            return logits, dict.fromkeys(range(len(rows)), reason)
        if batch is logits:
            return logits, {}
        with torch.inference_mode():
            out = torch.empty_like(logits)
            out[order] = batch.to(logits.dtype)
        return out, {}

    def _update(self, keys: list[str], rows: Sequence[Any]) -> tuple[BatchUpdate | None, list[int]]:
        """The change from the last step's batch to this one's, and each slot's row."""
        live = set(keys)
        removed = list(self._stale)
        self._stale = ()
        for key in [k for k in self._slots if k not in live]:
            removed.append(self._slots.pop(key))
        size = len(keys)
        taken = set(self._slots.values())
        free = iter(s for s in range(size) if s not in taken)
        added: list[AddedRequest] = []
        for b, key in enumerate(keys):
            if key not in self._slots:
                slot = next(free)
                self._slots[key] = slot
                r = rows[b]
                added.append((slot, r.params, list(r.prompt_token_ids), r.output_token_ids))
        # Rows past the batch's end move down into its holes, so the batch stays dense.
        holes = sorted(set(range(size)) - set(self._slots.values()))
        moved: list[MovedRequest] = []
        for key, slot in sorted(self._slots.items(), key=lambda kv: kv[1]):
            if slot >= size:
                hole = holes.pop(0)
                self._slots[key] = hole
                moved.append((slot, hole, MoveDirectionality.UNIDIRECTIONAL))
        order = [0] * size
        for b, key in enumerate(keys):
            order[self._slots[key]] = b
        if not (removed or added or moved):
            return None, order
        return BatchUpdate(size, tuple(sorted(removed)), tuple(added), tuple(moved)), order
