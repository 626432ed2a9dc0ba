"""CUDA graphs for decode steps: the model's forward captured once per padded batch size.

A decode step of a small model on a GPU is mostly launch overhead: a few hundred kernels
of microseconds each, issued one by one from Python. :class:`DecodeGraphs` captures the
forward of a decode-only batch (one new token per request) at startup for a set of batch
sizes, and a later decode step of ``B`` requests copies its inputs into persistent device
buffers and replays the graph of the smallest captured size ``>= B``. Everything else runs
eagerly as before: prefill and mixed steps, batches above the largest size, steps with
image embeddings, M-RoPE models, and sampling (which reads the forward's output rows).

The buffers a graph reads (its kernels hold their addresses, so they are never
reallocated)::

    input_ids    [S]            the step's tokens, stale values in the padding rows
    positions    [S]
    slot_mapping [S]            -1 in the padding rows: the KV write skips a negative slot
    seq_lens     [S]            0 in the padding rows: their attention reads nothing
    block_tables [S, W]         W = blocks of max_model_len; stale columns are never read
                                (a row reads only the blocks of its seq_len)

The decode attention's split count is fixed at capture from ``max_model_len`` (a request
can grow to it while its graph is replayed); a split past a request's context finds no
keys and weighs nothing in the reduce. So a replayed step's attention sums its context in
other slices than the eager step of the same batch would: the logits agree to rounding.

Without CUDA (the tests' CPU runs) the same class runs the forward eagerly on the padded
buffers instead of replaying: the padding and the buffer handling are the same code.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.ops import AttentionMetadata

logger = logging.getLogger("engine")

# vLLM's default capture sizes: 1, 2, 4, then every 8; here every 8 up to 64 and coarser
# above (a decode step is weight-bound, so padding a batch of 130 to 160 costs little, and
# fewer graphs start faster and hold less memory).
_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
          320, 384, 448, 512)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes captured for ``max_num_seqs``: the table's sizes below it, and
    ``max_num_seqs`` itself so that every decode batch has a graph."""
    sizes = [s for s in _SIZES if s < max_num_seqs]
    return (*sizes, max_num_seqs)


class DecodeGraphs:
    """The captured decode forwards of one model and KV pool (see the module docstring).

    ``forward(input_ids, positions, meta)`` is the model's forward over this runner's KV
    caches. ``capture()`` records a graph per size (on CUDA); ``run`` returns the hidden
    states of a decode step's rows, or ``None`` for a step it does not take.
    """

    def __init__(
        self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor], *,
        device: torch.device, sizes: Sequence[int], block_size: int, max_model_len: int,
    ) -> None:
        self.forward = forward
        self.device = torch.device(device)
        self.sizes = tuple(sorted(set(sizes)))
        self.max_model_len = max_model_len
        batch, width = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.slot_mapping = torch.full((batch,), -1, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.block_tables = torch.zeros((batch, width), dtype=torch.int32, device=self.device)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # decode steps replayed (or, without CUDA, run on the buffers)
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _meta(self, size: int) -> AttentionMetadata:
        """The metadata the captured forward of ``size`` rows reads: the buffers' views,
        with every request taken as long as ``max_model_len`` for the host-side choices
        (the attention's split count)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=(1,) * size,
            seq_lens_host=(self.max_model_len,) * size,
        )

    def _run_eager(self, size: int) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self._meta(size))

    def capture(self) -> None:
        """Record one graph per size, largest first (the smaller ones reuse its memory
        pool). On CPU there is nothing to record. Raises what a capture raises (a kernel
        that synchronises with the host, say); the caller then runs eagerly."""
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        try:
            for size in reversed(self.sizes):
                # Once eagerly first: kernels compile and autotune outside the capture.
                self._run_eager(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._run_eager(size)
                self._graphs[size] = (graph, hidden)
        except BaseException:
            self._graphs.clear()
            raise
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states ``[B, hidden]`` of a decode-only step, from the graph of the
        smallest captured size ``>= B``; ``None`` when the step is not one it takes (a
        prefill or mixed step, more rows than the largest size, M-RoPE positions)."""
        rows = input_ids.shape[0]
        if not meta.decode_only or rows != len(meta.seq_lens_host) or positions.dim() != 1:
            return None
        at = bisect.bisect_left(self.sizes, rows)
        width = meta.block_tables.shape[1]
        if at == len(self.sizes) or width > self.block_tables.shape[1] or meta.max_seq_len > self.max_model_len:
            return None
        size = self.sizes[at]
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:rows].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:rows, :width].copy_(meta.block_tables, non_blocking=True)
        if size > rows:
            self.slot_mapping[rows:size].fill_(-1)
            self.seq_lens[rows:size].fill_(0)
        self.replays += 1
        captured = self._graphs.get(size)
        if captured is None:  # no CUDA: the same buffers, run eagerly
            return self._run_eager(size)[:rows]
        graph, hidden = captured
        graph.replay()
        return hidden[:rows]


def describe(graphs: DecodeGraphs) -> str:
    """The startup log's line for the captured graphs."""
    sizes = graphs.sizes
    shown = ", ".join(map(str, sizes)) if len(sizes) <= 8 else (
        f"{', '.join(map(str, sizes[:4]))}, ..., {', '.join(map(str, sizes[-2:]))}")
    return (f"CUDA graphs: decode captured for {len(sizes)} batch sizes ({shown}) in "
            f"{graphs.capture_seconds:.2f} s, {graphs.capture_bytes / 2**20:.0f} MiB")
