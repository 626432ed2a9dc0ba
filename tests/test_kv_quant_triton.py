"""The Triton kernels over an 8-bit KV cache (int8 and fp8 e4m3) against the torch reference.

Runs in Triton's CPU interpreter without CUDA (``conftest.py`` sets ``TRITON_INTERPRET=1``
before triton is imported), on the GPU with it. The reference dequantizes the gathered
blocks to fp32 and runs SDPA; the kernels dequantize each tile in registers. Both attend
over the same dequantized values, so fp32 queries agree to summation order (2e-5, as in
``test_kernels.py``); bf16 queries round the dequantized tile to bf16 in the kernel and in
the reference alike (3e-2 on O(1) values, as there).
"""

from __future__ import annotations

import math
import os
import sys

import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from engine.ops import AttentionMetadata, QuantizedKV  # noqa: E402
from engine.ops.reference import TorchOps, quantize_kv  # noqa: E402
from engine.ops.triton import attention_decode, attention_prefill  # noqa: E402
from engine.ops.triton_ops import TritonOps  # noqa: E402

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("one_thread")]
DEVICE = torch.device("cuda" if _CUDA else "cpu")
# bf16 under the interpreter: its fp32 -> bf16 cast truncates where the reference rounds
# (see test_kernels.py), here applied to every dequantized K/V value, whose magnitudes reach
# ~5: a few truncated steps more than test_kernels.py's 3e-2.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2 if _CUDA else 8e-2, rtol=3e-2),
}
CODES = [torch.int8, torch.float8_e4m3fn]


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _cache(blocks: int, bs: int, hkv: int, d: int, code: torch.dtype, seed: int) -> QuantizedKV:
    x = _rand(blocks, bs, hkv, d, seed=seed) * torch.exp(_rand(blocks, bs, hkv, 1, seed=seed + 50))
    return QuantizedKV(*quantize_kv(x, code))


def _tables(seq_lens: list[int], bs: int, num_blocks: int, seed: int) -> torch.Tensor:
    need = [math.ceil(n / bs) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n]
        at += n
    return table.to(DEVICE)


@pytest.mark.parametrize("code", CODES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quantized_write_gives_the_references_codes_and_scales(code: torch.dtype, dtype: torch.dtype) -> None:
    blocks, bs, hkv, d = 6, 4, 3, 48  # 3 heads and 48 dims: padded lanes are masked
    key, value = _rand(7, hkv, d, seed=1, dtype=dtype), _rand(7, hkv, d, seed=2, dtype=dtype) * 30
    key[2, 1] = 0.0
    slots = torch.tensor([5, 0, 23, 12, 3, 16, 9], device=DEVICE)
    got, want = [], []
    for ops, out in ((TritonOps(), got), (TorchOps(), want)):
        caches = [QuantizedKV(torch.zeros(blocks, bs, hkv, d, device=DEVICE).to(code),
                              torch.full((blocks, bs, hkv), -1.0, device=DEVICE)) for _ in range(2)]
        ops.write_kv_cache(key, value, *caches, slots)
        out.extend(caches)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.scale, w.scale)  # untouched slots keep -1 on both sides
        a, b = g.data.float(), w.data.float()
        assert torch.equal(a, b)


# One token, exactly one block, one past it, and a context over several tiles and splits.
DECODE_LENS = [1, 16, 17, 300]


@pytest.mark.parametrize("code", CODES, ids=["int8", "fp8"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype", "splits"),
    [(8, 2, 64, torch.float32, 3), (8, 1, 128, torch.bfloat16, 1)],
)
def test_quantized_decode_matches_the_reference(code, heads, kv_heads, head_dim, dtype, splits) -> None:
    bs = 16
    num_blocks = sum(math.ceil(n / bs) for n in DECODE_LENS) + 2
    kc, vc = _cache(num_blocks, bs, kv_heads, head_dim, code, 10), _cache(num_blocks, bs, kv_heads, head_dim, code, 11)
    tables = _tables(DECODE_LENS, bs, num_blocks, seed=12)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    q = _rand(len(DECODE_LENS), heads, head_dim, seed=13, dtype=dtype)
    scale = head_dim**-0.5
    want = TorchOps().paged_attention_decode(q, kc, vc, tables, seq_lens, scale, tuple(DECODE_LENS))
    got = attention_decode.paged_attention_decode(
        q, kc, vc, tables, seq_lens, scale, tuple(DECODE_LENS), num_splits=splits
    )
    torch.testing.assert_close(got, want, **TOL[dtype])


PREFILL_QUERY = [1, 8, 5, 19, 21]
PREFILL_SEQ = [9, 8, 13, 36, 21]


@pytest.mark.parametrize("code", CODES, ids=["int8", "fp8"])
def test_quantized_prefill_over_chunks_matches_the_reference(code: torch.dtype) -> None:
    heads, kv_heads, head_dim, bs = 8, 2, 32, 8
    num_blocks = sum(math.ceil(n / bs) for n in PREFILL_SEQ) + 1
    kc, vc = _cache(num_blocks, bs, kv_heads, head_dim, code, 20), _cache(num_blocks, bs, kv_heads, head_dim, code, 21)
    tables = _tables(PREFILL_SEQ, bs, num_blocks, seed=22)
    starts = [0]
    for n in PREFILL_QUERY:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(PREFILL_QUERY), dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(PREFILL_SEQ, dtype=torch.int32, device=DEVICE),
        block_tables=tables, max_query_len=max(PREFILL_QUERY), max_seq_len=max(PREFILL_SEQ),
        query_lens_host=tuple(PREFILL_QUERY), seq_lens_host=tuple(PREFILL_SEQ),
    )
    q = _rand(sum(PREFILL_QUERY), heads, head_dim, seed=23)
    want = TorchOps().paged_attention_prefill(q, kc, vc, meta, head_dim**-0.5)
    got = attention_prefill.paged_attention_prefill(q, kc, vc, meta, head_dim**-0.5, block_m=16)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
