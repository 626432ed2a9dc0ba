"""Whisper's decoding rules as a logits processor (the batch-level interface of
:mod:`engine.runner.logits_processors`): its checkpoint's suppressed tokens for every
transcription, and the timestamp rules for one that asks for segments.

A transcription's ``extra_args`` carry ``whisper_suppress``: the checkpoint's
``suppress_tokens`` (the non-speech symbols OpenAI's decoder suppresses) are never
sampled, and its ``begin_suppress_tokens`` (a blank, the end of text) are not the first
token, as transformers' ``SuppressTokensLogitsProcessor`` and
``SuppressTokensAtBeginLogitsProcessor`` apply them (before the timestamp rules).

Such a request's prompt leaves out ``<|notimestamps|>``, and its ``extra_args`` carry
``whisper_timestamps``. Whisper then writes each segment between two timestamp tokens
(``<|0.00|>`` to ``<|30.00|>``, every 20 ms, right after ``<|notimestamps|>`` in its
vocabulary), and these rules keep what it writes well formed, as transformers'
``WhisperTimeStampLogitsProcessor`` and OpenAI's decoder apply them each step:

1. ``<|notimestamps|>`` is never sampled;
2. after a pair of timestamps, text comes next (no third timestamp); after a timestamp
   that follows text, a timestamp or the end comes next (no text: the segment is closed
   and the next must open);
3. timestamps never go back (and a closing one is after its opening one);
4. the first token is a timestamp, at most ``max_initial_timestamp_index`` steps in;
5. where the timestamps together are likelier than the likeliest text token, a
   timestamp is sampled.
"""

from __future__ import annotations

import torch

from engine.params import WHISPER_SUPPRESS, WHISPER_TIMESTAMPS
from engine.runner.logits_processors import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    ProcessorConfig,
)

OPT_IN = WHISPER_TIMESTAMPS  # the extra_args key a request sets for the timestamp rules


def whisper_timestamp_processor(no_timestamps_id: int | None, eos_id: int,
                                max_initial_index: int | None, suppress: tuple[int, ...] = (),
                                begin_suppress: tuple[int, ...] = ()) -> type[LogitsProcessor]:
    """The processor class for a model whose ``<|notimestamps|>`` is ``no_timestamps_id``
    (the timestamps follow it; None: a tokenizer without them) and whose end of text is
    ``eos_id``; ``suppress`` / ``begin_suppress``: its checkpoint's token lists."""

    class WhisperRules(LogitsProcessor):
        def __init__(self, config: ProcessorConfig, device: torch.device, is_pin_memory: bool) -> None:
            self.rows: dict[int, list[int]] = {}  # batch row -> its live output ids (timestamps)
            self.suppressed: dict[int, list[int]] = {}  # the same, for the suppressed tokens
            self.first = no_timestamps_id + 1 if no_timestamps_id is not None else 0
            self.suppress = torch.tensor(suppress, dtype=torch.long, device=device)
            self.begin = torch.tensor(begin_suppress, dtype=torch.long, device=device)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for table, key in ((self.rows, OPT_IN), (self.suppressed, WHISPER_SUPPRESS)):
                for index in batch_update.removed:
                    table.pop(index, None)
                for index, params, _prompt, outputs in batch_update.added:
                    if (params.extra_args or {}).get(key) and (key != OPT_IN or no_timestamps_id is not None):
                        table[index] = outputs
                    else:
                        table.pop(index, None)
                for a, b, direction in batch_update.moved:
                    moving = table.pop(a, None)
                    if direction is MoveDirectionality.SWAP:
                        other = table.pop(b, None)
                        if other is not None:
                            table[a] = other
                    if moving is not None:
                        table[b] = moving

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for k, seq in self.suppressed.items():
                if self.suppress.numel():
                    logits[k, self.suppress] = float("-inf")
                if not seq and self.begin.numel():
                    logits[k, self.begin] = float("-inf")
            first = self.first
            for k, seq in self.rows.items():
                row = logits[k]
                row[no_timestamps_id] = float("-inf")
                last = len(seq) >= 1 and seq[-1] >= first
                before = len(seq) < 2 or seq[-2] >= first
                if last:
                    if before:
                        row[first:] = float("-inf")  # a pair closed: text next
                    else:
                        row[:eos_id] = float("-inf")  # a segment closed: no text
                stamps = [t for t in seq if t >= first]
                floor = first if not stamps else stamps[-1] + (0 if last and not before else 1)
                row[first:floor] = float("-inf")
                if not seq:
                    row[:first] = float("-inf")
                    if max_initial_index is not None:
                        row[first + max_initial_index + 1:] = float("-inf")
                logprobs = torch.log_softmax(row.float(), -1)
                if logprobs[first:].logsumexp(-1) > logprobs[:first].max():
                    row[:first] = float("-inf")
            return logits

    return WhisperRules


__all__ = ["OPT_IN", "whisper_timestamp_processor"]
