"""The output of a pooling model's requests: their hidden states pooled into one vector.

A pooling request ends with its prompt: each of its chunks adds its rows to the request's
pool (``RequestState.pool``), and the step of its last chunk turns the pool into the
request's :class:`~engine.messages.PooledOutput` (a classifier's logits, or the embedding
as pooled: the front end normalises it, as the model or the request asks, in
:func:`engine.core.pooling.embedding`) instead of sampling.

A ``pool_tokens`` request (vLLM's ``token_embed``) keeps every row instead: its output is
the last hidden state of each prompt token, in order, as the model's pooler would read it.
So does every request of a token classifier (``token_classify``), whose rows then go
through its classifier head: one row of logits a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.messages import PooledOutput, ScheduledChunk
from engine.models.pooling import DenseLayer, PoolerConfig
from engine.runner.request_state import RequestState


def pool_outputs(
    pooler: PoolerConfig, model: Any, dtype: torch.dtype, hidden: torch.Tensor,
    chunks: Sequence[ScheduledChunk], states: Sequence[RequestState],
    dense: Sequence[DenseLayer] = (),
) -> tuple[PooledOutput, ...]:
    """Each chunk's rows of ``hidden`` add to its request's pool, and each chunk that ends
    its prompt (``sample``) gives the request's output (an embedding through ``dense``,
    sentence-transformers' Dense modules, in fp32)."""
    done: list[tuple[str, torch.Tensor]] = []
    rows_done: list[PooledOutput] = []
    row = 0
    for c, s in zip(chunks, states, strict=True):
        rows = hidden[row : row + c.num_tokens]
        row += c.num_tokens
        per_token = s.pool_tokens or pooler.pooling == "all"
        s.pool = _pool_rows("all" if per_token else pooler.pooling, s.pool, rows, c)
        if c.sample:
            assert s.pool is not None  # the last chunk always sets it
            pooled = s.pool
            if per_token:
                # Every prompt token's row: its own output, not stacked with the vectors.
                assert len(pooled) == len(s.prompt)
                if pooler.task == "token_classify":
                    pooled = model.classify_tokens(pooled.to(dtype))
                rows_done.append(PooledOutput(c.sample_id, _host_bytes(pooled)))
                continue
            if pooler.pooling == "mean":
                pooled = pooled / len(s.prompt)
            done.append((c.sample_id, pooled))
    if not done:
        return tuple(rows_done)
    vectors = torch.stack([v for _, v in done])
    if pooler.task == "classify":
        # A BERT cross-encoder's [CLS] rows, or a decoder classifier's last rows.
        vectors = model.classify(vectors.to(dtype))
    for layer in dense:
        vectors = F.linear(vectors.float(), layer.weight, layer.bias)
        if layer.activation == "tanh":
            vectors = torch.tanh(vectors)
    host = vectors.float().cpu().numpy().astype("<f4")
    return (*rows_done,
            *(PooledOutput(sid, host[i].tobytes()) for i, (sid, _) in enumerate(done)))


def _host_bytes(rows: torch.Tensor) -> bytes:
    return rows.float().cpu().numpy().astype("<f4").tobytes()


def _pool_rows(
    pooling: str, pool: torch.Tensor | None, rows: torch.Tensor, chunk: ScheduledChunk
) -> torch.Tensor | None:
    """A request's pool after one more chunk (fp32). A chunk from position 0 starts it
    afresh: a request recomputed after preemption pools its prompt once."""
    if chunk.start == 0:
        pool = None
    rows = rows.float()
    if pooling == "all":
        return rows.clone() if pool is None else torch.cat((pool, rows))
    if pooling == "cls":
        return rows[0] if chunk.start == 0 else pool
    if pooling == "last":
        return rows[-1] if chunk.sample else pool
    if pooling == "mean":
        total = rows.sum(0)
        return total if pool is None else pool + total
    top = rows.max(0).values  # "max"
    return top if pool is None else torch.maximum(pool, top)
