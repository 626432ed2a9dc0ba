"""Benchmark the Triton kernels against the best torch alternative on the same device.

    python bench/kernels.py            # CUDA: the issue's shapes, one row per kernel+shape
    python bench/kernels.py --smoke    # no GPU: tiny shapes in the Triton CPU interpreter

Per kernel and shape it prints the median time, the achieved GB/s (memory-bound kernels:
bytes that must move, each input read once and each output written once) or TFLOP/s
(prefill), the ratio to the device's datasheet peak, and the torch alternative's time:
``scaled_dot_product_attention`` on K/V already gathered into dense tensors (the gather is
not timed, which favours torch) for attention, torch's sort-based top-p for sampling,
eager torch (the reference ops) for the pointwise ones, and for the quantized matmul (GGUF
Q4_0/Q8_0/Q4_K blocks) a bf16 ``x @ W.T`` of the same weight dequantized, whose weight
moves 2 bytes a value against the blocks' 0.56 (Q4_0, Q4_K) or 1.06 (Q8_0). Smoke mode only
proves the script runs: interpreter timings mean nothing.
"""

# ruff: noqa: B023  (each timing lambda runs inside its own loop iteration)
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Datasheet peaks (dense, no sparsity): leads, not measurements (METHOD.md: measure them).
PEAKS = {  # name fragment: (HBM GB/s, fp16/bf16 TFLOP/s)
    "H100": (3350.0, 989.0),
    "H200": (4800.0, 989.0),
    "A100": (2039.0, 312.0),
}


def _peak(device: torch.device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    return next((peak for frag, peak in PEAKS.items() if frag in name), (None, None))


def _time_ms(fn, device: torch.device, smoke: bool) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    runs = []
    for _ in range(1 if smoke else 5):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def _row(name, shape, ms, amount, unit, peak, torch_ms) -> str:
    rate = amount / (ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12)
    ratio = f"{rate / peak:6.1%}" if peak else "   n/a"
    return (f"{name:<13} {shape:<32} {ms:9.3f} {rate:9.2f} {unit:<7} {ratio}  "
            f"{torch_ms:9.3f} {torch_ms / ms:7.2f}x")


def _paged_setup(batch, ctx, hkv, d, bs, dtype, device):
    blocks_per = -(-ctx // bs)
    num_blocks = batch * blocks_per
    kc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    # Scrambled blocks: the kernels must follow the table, as in a real pool.
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per).to(torch.int32)
    return kc, vc, tables


def _gather(cache, tables, ctx):
    """[blocks, bs, Hkv, D] through the tables -> dense [B, Hkv, ctx, D] for SDPA."""
    b = tables.shape[0]
    g = cache[tables.long()].reshape(b, -1, cache.shape[2], cache.shape[3])[:, :ctx]
    return g.transpose(1, 2).contiguous()


def bench_decode(device, smoke, peak_bw):
    from engine.ops.triton.attention_decode import paged_attention_decode

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    shapes = [(2, 64, 4, 2, 32)] if smoke else [
        (64, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (256, 1024, 32, 8, 128)]
    for batch, ctx, h, hkv, d in shapes:
        kc, vc, tables = _paged_setup(batch, ctx, hkv, d, 16, dtype, device)
        q = torch.randn(batch, h, d, dtype=dtype, device=device)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        host = (ctx,) * batch
        ms = _time_ms(lambda: paged_attention_decode(q, kc, vc, tables, lens, d**-0.5, host), device, smoke)
        kd, vd, qd = _gather(kc, tables, ctx), _gather(vc, tables, ctx), q.unsqueeze(2)
        torch_ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, scale=d**-0.5, enable_gqa=True), device, smoke)
        nbytes = 2 * batch * ctx * hkv * d * kc.element_size() + 2 * q.numel() * q.element_size()
        print(_row("decode", f"B={batch} ctx={ctx} H={h}/{hkv} D={d}", ms, nbytes, "GB/s", peak_bw, torch_ms))


def bench_prefill(device, smoke, peak_flops):
    from engine.ops import AttentionMetadata
    from engine.ops.triton.attention_prefill import paged_attention_prefill

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    shapes = [(1, 32, 4, 2, 32)] if smoke else [(4, 2048, 32, 8, 128), (1, 8192, 32, 8, 128)]
    for batch, seq, h, hkv, d in shapes:
        kc, vc, tables = _paged_setup(batch, seq, hkv, d, 16, dtype, device)
        q = torch.randn(batch * seq, h, d, dtype=dtype, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(batch * seq, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=device),
            seq_lens=torch.full((batch,), seq, dtype=torch.int32, device=device),
            block_tables=tables, max_query_len=seq, max_seq_len=seq,
            query_lens_host=(seq,) * batch, seq_lens_host=(seq,) * batch,
        )
        ms = _time_ms(lambda: paged_attention_prefill(q, kc, vc, meta, d**-0.5), device, smoke)
        kd, vd = _gather(kc, tables, seq), _gather(vc, tables, seq)
        qd = q.view(batch, seq, h, d).transpose(1, 2).contiguous()
        torch_ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, scale=d**-0.5, enable_gqa=True), device, smoke)
        flops = 4 * batch * h * d * seq * seq / 2  # QK^T and PV over the causal half
        print(_row("prefill", f"B={batch} L={seq} H={h}/{hkv} D={d}", ms, flops, "TFLOP/s", peak_flops, torch_ms))


def _torch_top_p_sample(logits, temperature, top_p):
    """The usual torch recipe: softmax, full sort, cumsum, mask, multinomial, unsort."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, idx = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    sorted_probs = sorted_probs.masked_fill(cum - sorted_probs >= top_p[:, None], 0.0)
    return idx.gather(-1, torch.multinomial(sorted_probs, 1)).squeeze(-1)


def bench_sampling(device, smoke, peak_bw):
    from engine.ops.triton.sampling import sample

    shapes = [(2, 256)] if smoke else [(256, 151936), (32, 151936), (256, 32000)]
    for batch, vocab in shapes:
        logits = torch.randn(batch, vocab, device=device) * 4
        temp = torch.full((batch,), 0.8, device=device)
        top_k = torch.zeros(batch, dtype=torch.int32, device=device)
        top_p = torch.full((batch,), 0.9, device=device)
        min_p = torch.zeros(batch, device=device)
        seeds = torch.arange(batch, device=device)
        ms = _time_ms(lambda: sample(logits, temp, top_k, top_p, min_p, seeds), device, smoke)
        torch_ms = _time_ms(lambda: _torch_top_p_sample(logits, temp, top_p), device, smoke)
        nbytes = logits.numel() * 4  # one read of the logits: the floor for any sampler
        print(_row("sample top-p", f"B={batch} V={vocab}", ms, nbytes, "GB/s", peak_bw, torch_ms))


def bench_pointwise(device, smoke, peak_bw):
    from engine.ops.reference import TorchOps
    from engine.ops.triton import kv_cache, norm_rope

    ref = TorchOps()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    tokens, hidden, h, hkv, d = (4, 64, 4, 2, 16) if smoke else (8192, 4096, 32, 8, 128)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    r, w = torch.randn_like(x), torch.randn(hidden, dtype=dtype, device=device)
    esz = x.element_size()
    ms = _time_ms(lambda: norm_rope.fused_add_rms_norm(x, r, w, 1e-5), device, smoke)
    torch_ms = _time_ms(lambda: ref.fused_add_rms_norm(x, r, w, 1e-5), device, smoke)
    print(_row("add+rmsnorm", f"T={tokens} hidden={hidden}", ms, 4 * x.numel() * esz, "GB/s", peak_bw, torch_ms))

    q = torch.randn(tokens, h, d, dtype=dtype, device=device)
    k = torch.randn(tokens, hkv, d, dtype=dtype, device=device)
    cache = torch.randn(tokens + 1, d, dtype=dtype, device=device)
    pos = torch.arange(tokens, device=device)
    ms = _time_ms(lambda: norm_rope.rotary_embedding(pos, q, k, cache), device, smoke)
    torch_ms = _time_ms(lambda: ref.rotary_embedding(pos, q, k, cache), device, smoke)
    print(_row("rope", f"T={tokens} H={h}/{hkv} D={d}", ms, 2 * (q.numel() + k.numel()) * esz, "GB/s", peak_bw, torch_ms))

    kc = torch.empty(-(-tokens // 16), 16, hkv, d, dtype=dtype, device=device)
    vc = torch.empty_like(kc)
    slots = torch.randperm(tokens, device=device)
    ms = _time_ms(lambda: kv_cache.write_kv_cache(k, k, kc, vc, slots), device, smoke)
    torch_ms = _time_ms(lambda: ref.write_kv_cache(k, k, kc, vc, slots), device, smoke)
    print(_row("kv write", f"T={tokens} Hkv={hkv} D={d}", ms, 4 * k.numel() * esz, "GB/s", peak_bw, torch_ms))


def _random_blocks(fmt, n: int, k: int, device) -> torch.Tensor:
    """GGUF rows [n, bytes] of random codes whose fp16 scale fields (d; m or dmin) are small
    and finite, so the products stay finite."""
    nb = k // fmt.block
    raw = torch.randint(0, 256, (n, nb, fmt.block_bytes), dtype=torch.uint8, device=device)
    for off in (0, 2) if fmt.name in ("Q4_1", "Q4_K") else (0,):
        scale = (torch.rand(n, nb, device=device) * 0.04 - 0.02).to(torch.float16)
        raw[..., off : off + 2] = scale.view(torch.uint8).view(n, nb, 2)
    return raw.view(n, nb * fmt.block_bytes)


def bench_quant_matmul(device, smoke, peak_bw):
    """GGUF blocks through the Triton kernel (dequantized in registers) against torch's
    matmul of the same weight dequantized to bf16 (fp32 under the smoke interpreter), one
    decode token (GEMV) and a batch (GEMM). The rate is the weight's bytes as stored."""
    from engine.ops.quant import FORMATS, QuantizedWeight, dequantize_blocks
    from engine.ops.triton.quant_matmul import quant_matmul

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    (n, k), batches = ((64, 256), (1, 16)) if smoke else ((4096, 4096), (1, 128))
    for name in ("Q4_0", "Q8_0", "Q4_K"):
        fmt = FORMATS[name]
        raw = _random_blocks(fmt, n, k, device)
        w = QuantizedWeight(fmt, (n, k), "blocks", {"raw": raw})
        dense = dequantize_blocks(raw, fmt, k).to(dtype)
        for m in batches:
            x = torch.randn(m, k, dtype=dtype, device=device)
            ms = _time_ms(lambda: quant_matmul(x, w), device, smoke)
            torch_ms = _time_ms(lambda: x @ dense.T, device, smoke)
            print(_row(f"qmatmul {name}", f"M={m} N={n} K={k}", ms, raw.numel(), "GB/s", peak_bw, torch_ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; the CPU interpreter without CUDA")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            parser.error("no CUDA device: only --smoke runs (in the Triton CPU interpreter)")
        # Must precede the first triton import (see engine/ops/triton/__init__.py).
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cuda" if cuda else "cpu")
    peak_bw, peak_flops = _peak(device)
    name = torch.cuda.get_device_name(device) if cuda else "CPU, Triton interpreter (smoke only)"
    print(f"device: {name}; datasheet peaks: {peak_bw} GB/s, {peak_flops} TFLOP/s")
    print(f"{'kernel':<13} {'shape':<32} {'ms':>9} {'rate':>9} {'unit':<7} {'%peak':>6}  "
          f"{'torch ms':>9} {'speedup':>8}")
    with torch.inference_mode():
        bench_decode(device, args.smoke, peak_bw)
        bench_prefill(device, args.smoke, peak_flops)
        bench_sampling(device, args.smoke, peak_bw)
        bench_pointwise(device, args.smoke, peak_bw)
        bench_quant_matmul(device, args.smoke, peak_bw)


if __name__ == "__main__":
    main()
