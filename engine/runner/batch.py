"""The flat varlen batch of a step: its token ids, positions and attention metadata.

:class:`BatchBuilder` turns a step's chunks and their requests' states into the batch the
model's forward takes; :func:`build_batch` is the layout itself (the draft model builds its
batches with it too).

One step's flat varlen batch (``B`` chunks, ``T`` tokens)::

    input_ids      [T]    chunk 0's tokens | chunk 1's tokens | ...
    positions      [T]    start .. start + num_tokens - 1 of each chunk
    slot_mapping   [T]    block_ids[pos // block_size] * block_size + pos % block_size
    query_start_loc[B+1]  0, n0, n0 + n1, ...
    seq_lens       [B]    start + num_tokens
    block_tables   [B, max_blocks], padded with 0
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.messages import ScheduledChunk
from engine.ops import AttentionMetadata
from engine.runner.request_state import RequestState, StepPlanError


class BatchBuilder:
    """The model inputs of a step's chunks, checked against the runner's budgets.

    ``mrope``: the model's rotary positions are M-RoPE's three streams (Qwen-VL), read
    from each request's state. On CPU the index tensors of small steps are reused step
    after step (:class:`HostBatch`): a step's tensors are valid until the next is built.
    """

    def __init__(
        self, *, block_size: int, device: torch.device, max_num_seqs: int, max_num_batched_tokens: int,
        mrope: bool,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mrope = mrope
        self._host = HostBatch() if device.type == "cpu" else None

    def prepare(
        self, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The flat batch's tensors, built with a handful of ops whatever the batch size."""
        if len(chunks) > self.max_num_seqs:
            raise StepPlanError(f"{len(chunks)} chunks exceed max_num_seqs={self.max_num_seqs}")
        spans = []
        for c, s in zip(chunks, states, strict=True):
            end = c.start + c.num_tokens
            # The proposal follows the known tokens.
            spans.append((c.start, [*s.tokens[c.start : end], *c.draft_token_ids], c.block_ids))
        if sum(len(t) for _, t, _ in spans) > self.max_num_batched_tokens:
            raise StepPlanError(
                f"{sum(len(t) for _, t, _ in spans)} tokens exceed "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        input_ids, pos, meta = build_batch(spans, self.block_size, self.device, self._host)
        if self.mrope:  # the rotary positions are M-RoPE's three streams
            pos = self._mrope_positions(chunks, states)
        ends = 0
        sample_rows = []
        for c in chunks:
            ends += c.num_tokens
            if c.sample:
                # A proposal of k tokens: the k + 1 last positions each draw a token.
                sample_rows.extend(range(ends - 1 - len(c.draft_token_ids), ends))
        return input_ids, pos, meta, sample_rows

    def _mrope_positions(
        self, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState]
    ) -> torch.Tensor:
        """[3, T]: each chunk's M-RoPE positions, the prompt's as computed at admission and
        every later token (outputs, proposals) at its index plus the request's delta."""
        streams: tuple[list[int], list[int], list[int]] = ([], [], [])
        for c, s in zip(chunks, states, strict=True):
            assert s.mrope is not None
            end = c.start + c.num_tokens
            cut = min(max(c.start, s.mrope.shape[1]), end)
            if cut > c.start:
                for out, rows in zip(streams, s.mrope[:, c.start : cut].tolist(), strict=True):
                    out.extend(rows)
            if end > cut:  # decode rows: plain Python, no tensor op per request
                later = range(cut + s.mrope_delta, end + s.mrope_delta)
                for out in streams:
                    out.extend(later)
        return torch.tensor(streams, dtype=torch.int64).to(self.device, non_blocking=True)


def build_batch(
    spans: Sequence[tuple[int, Sequence[int], Sequence[int]]], block_size: int, device: torch.device,
    host: HostBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``(input_ids, positions, metadata)`` of a flat varlen batch (the module docstring's
    layout): one span ``(start, token ids, block table)`` per sequence, its tokens at
    positions ``start ..``. An empty block table everywhere: an encoder, no KV cache.
    With ``host``, a small CPU step's tensors are ``host``'s, reused by the next call."""
    ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    width = max(len(table) for _, _, table in spans)
    tables: list[int] = []
    for start, tokens, table in spans:
        ids.extend(tokens)
        positions.extend(range(start, start + len(tokens)))
        query_lens.append(len(tokens))
        seq_lens.append(start + len(tokens))
        tables.extend(table)
        tables.extend((0,) * (width - len(table)))
    batch = len(spans)
    if torch.device(device).type == "cpu" and len(ids) <= _HOST_BATCH_TOKENS and width:
        return _host_batch(ids, positions, tables, width, query_lens, seq_lens, block_size, host)
    # One host tensor holds every int index; slices of it go to the device in one copy.
    packed = torch.tensor(ids + positions + tables + query_lens + seq_lens, dtype=torch.int64)
    dev = packed.to(device, non_blocking=True)
    t = len(ids)
    input_ids, pos = dev[:t], dev[t : 2 * t]
    block_tables = dev[2 * t : 2 * t + batch * width].view(batch, width)
    qlens = dev[2 * t + batch * width : 2 * t + batch * width + batch]
    slens = dev[2 * t + batch * width + batch :]
    req = torch.repeat_interleave(torch.arange(batch, device=device), qlens, output_size=t)
    if width:
        blocks = block_tables[req, pos // block_size]
        slot_mapping = blocks * block_size + pos % block_size
    else:  # an encoder: no KV cache to write
        slot_mapping = pos.new_empty(0)
    query_start_loc = torch.nn.functional.pad(qlens.cumsum(0), (1, 0)).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=slens.to(torch.int32),
        block_tables=block_tables.to(torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return input_ids, pos, meta


# Steps of at most this many tokens on CPU (decode steps, speculative verification) get
# their index tensors from lists in Python: two tensor constructions instead of a dozen
# dispatched ops (~0.2 ms of a ~4 ms single-stream step on the 2-core dev machine).
_HOST_BATCH_TOKENS = 64


class HostBatch:
    """Index tensors a runner reuses for its small CPU steps (``build_batch``'s ``host``).

    After a decode step has streamed the model's weights through the caches, each torch op
    that builds the next step's tensors costs tens of microseconds; here the values are
    written through numpy views of two buffers, and the tensor views of a step's shape
    (tokens, rows, table width: the same for most steps of a stream) are made once. A
    step's tensors are valid until the next step is built (the runner runs one at a time).
    """

    def __init__(self) -> None:
        self._wide = self._narrow = None
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def fill(self, ids: list[int], positions: list[int], slots: list[int], tables: list[int],
             starts: list[int], seq_lens: list[int], width: int) -> tuple[torch.Tensor, ...]:
        t, batch = len(ids), len(seq_lens)
        wide_n, narrow_n = 3 * t, batch * width + 2 * batch + 1
        if self._wide is None or self._wide.numel() < wide_n or self._narrow.numel() < narrow_n:
            self._wide = torch.zeros(max(wide_n, 3 * _HOST_BATCH_TOKENS), dtype=torch.int64)
            self._narrow = torch.zeros(max(2 * narrow_n, 1024), dtype=torch.int32)
            self._wide_np, self._narrow_np = self._wide.numpy(), self._narrow.numpy()
            self._views.clear()
        w, n = self._wide_np, self._narrow_np
        w[:t], w[t : 2 * t], w[2 * t : 3 * t] = ids, positions, slots
        bw = batch * width
        n[:bw], n[bw : bw + batch + 1], n[bw + batch + 1 : narrow_n] = tables, starts, seq_lens
        key = (t, batch, width)
        views = self._views.get(key)
        if views is None:
            wide, narrow = self._wide, self._narrow
            views = (wide[:t], wide[t : 2 * t], wide[2 * t : 3 * t], narrow[:bw].view(batch, width),
                     narrow[bw : bw + batch + 1], narrow[bw + batch + 1 : narrow_n])
            if len(self._views) >= 64:
                self._views.clear()
            self._views[key] = views
        return views


def _host_batch(
    ids: list[int], positions: list[int], tables: list[int], width: int, query_lens: list[int],
    seq_lens: list[int], block_size: int, host: HostBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """build_batch's result for a small CPU batch, the same values computed on lists."""
    t, batch = len(ids), len(query_lens)
    slots: list[int] = []
    starts = [0]
    row = 0
    for b, q in enumerate(query_lens):
        for p in positions[row : row + q]:
            if p // block_size >= width:  # as indexing the padded table raises
                raise IndexError(f"position {p} is past the block table's {width} blocks")
            slots.append(tables[b * width + p // block_size] * block_size + p % block_size)
        row += q
        starts.append(row)
    if host is not None:
        input_ids, pos, slot_mapping, block_tables, query_start_loc, seq_lens_t = host.fill(
            ids, positions, slots, tables, starts, seq_lens, width)
    else:
        wide = torch.tensor(ids + positions + slots, dtype=torch.int64)
        narrow = torch.tensor(tables + starts + seq_lens, dtype=torch.int32)
        input_ids, pos, slot_mapping = wide[:t], wide[t : 2 * t], wide[2 * t :]
        block_tables = narrow[: batch * width].view(batch, width)
        query_start_loc = narrow[batch * width : batch * width + batch + 1]
        seq_lens_t = narrow[batch * width + batch + 1 :]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return input_ids, pos, meta
