"""A row's numbers do not depend on the other rows of its call (CPU kernels).

Speculative verification computes ``1 + k`` positions of one request in one forward, where
plain decoding computes each in a one-token step; continuous batching puts a request's row
beside any others. Greedy speculation gives the plain tokens only if every position's
logits are the same bits either way (a near-tie flips on the last bit, and did: SmolLM2
Q4_1 left the plain greedy output at its 44th token when a verification chunk's attention
went through the padded multi-token SDPA instead of the decode kernel). So these checks
are bitwise (``torch.equal``), not within a tolerance:

* attention: each query row of a request with at most ``ROWWISE_MAX_QUERY_LEN`` query
  tokens equals that row alone as a one-token decode (its context up to itself), beside
  a decode row and a long prefill chunk, fp32 and bf16, plain and int8 KV, with and without
  a sliding window (the C ops; the torch reference pads a decode batch to its longest
  context, so its rows depend on their neighbours: it is not batch-invariant);
* quantized matmul: an M-row call equals M one-row calls on every path, for every GGUF
  format, fp32 and bf16 activations, one and two threads. "auto" switches from the int8
  paths to AMX-BF16 at ``AMX_BF16_MIN_TOKENS`` (49) rows, past the fused decode step's 48
  (bf16 activations cannot equal int8 ones), so its rows equal one-row calls below 49
  rows, and the path's own one-row calls from 49 on.
"""

from __future__ import annotations

import pytest
import torch
from test_quant import random_blocks

from engine.ops import AttentionMetadata, QuantizedKV
from engine.ops import cpu as cpu_ops
from engine.ops.cpu import CpuOps
from engine.ops.cpu import qmatmul as cq
from engine.ops.quant import FORMATS, QuantizedWeight
from engine.ops.reference import quantize_kv

AMX_BF16_MIN_TOKENS = 49  # quant.c
ROWWISE_MAX_QUERY_LEN = CpuOps.rowwise_max_query_len


def _cache(blocks: int, bs: int, kv_heads: int, dim: int, dtype: torch.dtype, int8: bool, seed: int):
    x = torch.randn(blocks, bs, kv_heads, dim, generator=torch.Generator().manual_seed(seed))
    if int8:
        return QuantizedKV(*quantize_kv(x, torch.int8))
    return x.to(dtype)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.skipif(not cpu_ops.available(), reason="C kernels not built")
def test_a_short_chunks_attention_rows_equal_one_token_decodes(dtype, int8, window) -> None:
    heads, kv_heads, dim, bs = 6, 2, 64, 8
    # A verification chunk (5 rows), a decode row, a chunk of the row-wise maximum, and a
    # prefill chunk one longer (the padded multi-token path), interleaved.
    qlens = [5, 1, ROWWISE_MAX_QUERY_LEN, ROWWISE_MAX_QUERY_LEN + 1]
    slens = [40, 23, 130, 90]
    per = [-(-n // bs) for n in slens]
    order = torch.randperm(sum(per) + 2, generator=torch.Generator().manual_seed(1)).tolist()
    tables = torch.zeros(len(slens), max(per), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per):
        tables[b, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    kc = _cache(len(order), bs, kv_heads, dim, dtype, int8, seed=2)
    vc = _cache(len(order), bs, kv_heads, dim, dtype, int8, seed=3)
    query = torch.randn(sum(qlens), heads, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64),  # unused by attention
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=tables, max_query_len=max(qlens), max_seq_len=max(slens),
        query_lens_host=tuple(qlens), seq_lens_host=tuple(slens),
    )
    ops = CpuOps()
    got = ops.paged_attention_prefill(query, kc, vc, meta, dim**-0.5, window=window)
    for b in (0, 1, 2):
        for i in range(qlens[b]):
            row, n = starts[b] + i, slens[b] - qlens[b] + i + 1
            alone = CpuOps().paged_attention_decode(
                query[row : row + 1], kc, vc, tables[b : b + 1], torch.tensor([n], dtype=torch.int32),
                dim**-0.5, (n,), window=window)
            assert torch.equal(got[row : row + 1], alone), (b, i)
    # The long chunk is still causal attention over its context (checked against the rows
    # computed one by one, within the dtype's rounding).
    b = 3
    for i in (0, qlens[b] - 1):
        row, n = starts[b] + i, slens[b] - qlens[b] + i + 1
        alone = CpuOps().paged_attention_decode(
            query[row : row + 1], kc, vc, tables[b : b + 1], torch.tensor([n], dtype=torch.int32),
            dim**-0.5, (n,), window=window)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got[row : row + 1], alone, atol=tol, rtol=tol)


needs_kernels = pytest.mark.skipif(not cq.available(), reason="C kernels not built")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_quantized_matmul_row_does_not_depend_on_the_other_rows(name, dtype) -> None:
    n, k = 40, 512  # three panels, the last one partial
    w = QuantizedWeight.from_blocks(random_blocks(name, n, k, seed=7), FORMATS[name], k)
    x = torch.randn(2 * AMX_BF16_MIN_TOKENS + 3, k, generator=torch.Generator().manual_seed(8)).to(dtype)
    for path in cq.paths():
        one = torch.cat([cq.qmatmul(x[i : i + 1], w, path=path, threads=1) for i in range(len(x))])
        for m in (2, 5, 9, AMX_BF16_MIN_TOKENS - 1, len(x)):
            for threads in (1, 2):
                assert torch.equal(cq.qmatmul(x[:m], w, path=path, threads=threads), one[:m]), (path, m)
    # "auto": the best int8 path below 49 rows, AMX-BF16 (where the CPU has it) from 49.
    int8 = next(p for p in ("avx512", "avx2", "portable") if p in cq.paths())
    one = torch.cat([cq.qmatmul(x[i : i + 1], w, path=int8, threads=1) for i in range(len(x))])
    for m in range(1, AMX_BF16_MIN_TOKENS):
        assert torch.equal(cq.qmatmul(x[:m], w), one[:m]), m
    wide = "amx-bf16" if "amx-bf16" in cq.paths() else int8
    one = torch.cat([cq.qmatmul(x[i : i + 1], w, path=wide, threads=1) for i in range(len(x))])
    assert torch.equal(cq.qmatmul(x, w), one)
