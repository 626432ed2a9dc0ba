"""The token bitmask both backends fill, and applying it to the logits.

One int32 row of ``ceil(vocab / 32)`` words per sample, token ``t`` allowed iff bit
``t % 32`` of word ``t // 32`` is set::

    word:   0                   1                        W - 1
    bits:   t0 t1 ... t31  |  t32 t33 ... t63  |  ...  |  ... t(V-1) [padding bits]
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def clear_bits(words: int, ids: list[int]) -> torch.Tensor:
    """An int32 bitmask row with every bit set but those of ``ids``."""
    row = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
    for i in ids:
        row[i // 32] &= np.uint32(~(1 << (i % 32)) & 0xFFFFFFFF)
    return torch.from_numpy(row.view(np.int32).copy())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t]`` to -inf, in place, for every token ``t`` that bitmask row ``i``
    forbids, where ``r = rows[i]``. ``logits`` is fp32 [B, V]; ``bitmask`` int32
    [len(rows), W] on the CPU (moved to the logits' device here). xgrammar's kernels do the
    work: C++ on the CPU, Triton/CUDA on a GPU."""
    # Lazy: a heavy optional library (about 2 s to import beside torch), needed only once a
    # structured request reaches the sampler.
    import xgrammar

    if not rows:
        return
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        return
    # Rows of the batch that have no constraint stay untouched: the mask rows are spread to
    # their batch rows (indices) rather than padding a full-batch mask.
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32,
                      device=bitmask.device)
    full[torch.tensor(rows, device=bitmask.device)] = bitmask
    xgrammar.apply_token_bitmask_inplace(logits, full, indices=rows)
