"""Speculative decoding proposals: prompt lookup (n-gram) and Predicted Outputs.

Pure functions over token ids. The scheduler asks for a proposal when it plans a decode
step for a request whose every token is known (nothing of it in flight); the model runner
verifies the proposal in the same forward as the request's next token (see
``Verifier.sample`` in engine/runner/verify.py and docs/architecture.md, "Speculative decoding").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(
    context: Sequence[int], haystack: Sequence[int] | None, k: int, n_max: int, n_min: int,
    *, after: int | None = None,
) -> tuple[tuple[int, ...], int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the last ``n`` tokens of
    ``context`` (``n`` from ``n_max`` down to ``n_min``, longest match first), and where in
    the haystack they start (-1: no proposal).

    ``haystack`` is where to look: ``None`` for ``context`` itself (prompt lookup: the
    latest occurrence); a Predicted Outputs request gives its prediction, and ``after``,
    where its previous proposal started: the earliest occurrence whose continuation starts
    there or later is taken (the output walks through the prediction in order), else the
    latest one.
    """
    if k < 1 or not context:
        return (), -1
    ctx = np.asarray(context, dtype=np.int64)
    hay = ctx if haystack is None else np.asarray(haystack, dtype=np.int64)
    size = len(hay)
    for n in range(min(n_max, len(ctx)), n_min - 1, -1):
        suffix = ctx[len(ctx) - n:]
        # Starts i with a continuation (i + n <= size - 1; in the context itself this also
        # leaves out the suffix's own position).
        last = size - n - 1
        if last < 0:
            continue
        idx = np.flatnonzero(hay[: last + 1] == suffix[0])
        for j in range(1, n):
            if not idx.size:
                break
            idx = idx[hay[idx + j] == suffix[j]]
        if idx.size:
            pick = int(idx[-1])
            if after is not None:
                later = idx[idx + n >= after]
                if later.size:
                    pick = int(later[0])
            start = pick + n
            return tuple(hay[start : start + k].tolist()), start
    return (), -1
