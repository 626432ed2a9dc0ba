"""Sampling without a vocabulary sort: per-row thresholds by radix search, then a race.

One program per row (``B`` programs), each streaming its row of ``V`` logits:

1. **stats**: the raw max, its first index (greedy), and the raw and temperature-scaled
   log-sum-exp (for the logprob and the top-p mass).
2. **top-k** (if on): the k-th largest scaled logit, found exactly by a radix search over
   the logits' order-preserving int32 keys, 4 bits per pass (8 passes). Each pass counts,
   for 16 candidate thresholds at once, how many tokens are ``>=`` each candidate and keeps
   the largest candidate whose count still reaches ``k``.
3. **top-p** (if on): the same search with each token weighted by ``exp(x - max)`` and the
   target ``p * Z_k`` (``Z_k`` the mass left after top-k): the largest logit ``t`` whose
   tokens ``>= t`` hold at least ``p`` of the mass. This is the threshold definition of
   ``engine.ops.sampling_ref`` (ties at the cut are kept), found in logit space.
4. **draw**: tokens passing every threshold (and ``exp(x - max) >= min_p``) race with
   Gumbel noise from Philox, ``tl.rand(seed, token_id)``: ``argmax(x - log(-log u))``
   picks token ``i`` with probability ``softmax(x)[i]`` over the kept set. The random
   stream depends only on the row's seed and the token id, never on the batch.

Per pass a row is read once (``V`` fp32); a sort would instead move the row and an index
per element through several radix passes and then need a cumsum and a scatter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RADIX_BITS = 4  # 16 candidates per pass: 8 passes over 32-bit keys
KEY_OFFSET = 2**31  # int32 keys shifted to [0, 2^32) so candidates grow from zero


# The helpers below are inlined by hand in the hot loops: on GPU it makes no difference,
# but every nested @triton.jit call costs milliseconds per program in the CPU interpreter.
# Order-preserving key of an fp32 logit: reinterpret as int32 and flip the magnitude bits
# of negative values, so `key(a) >= key(b)` exactly when `a >= b` (+0.0 sorts above -0.0).
# The map is an involution, so the same expression turns a key back into its float.


@triton.jit
def _radix_threshold(row_ptr, vocab, temp, m_scaled, target, USE_MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Largest key ``T`` with ``f(T) >= target``, ``f(T)`` = count (or exp-mass) of keys >= T.

    ``f`` only falls as ``T`` grows, so the answer is built 4 bits at a time from the top.
    If even the smallest key misses the target (rounding with p near 1) it returns the
    smallest key, which keeps every token.
    """
    digits = tl.arange(0, 1 << 4)
    prefix = tl.zeros([], dtype=tl.int64)  # T + 2^31, in [0, 2^32)
    for step in tl.static_range(32 // 4):
        shift = 28 - 4 * step  # a constexpr: step is static_range's
        cand = (prefix + (digits.to(tl.int64) << shift) - 2147483648).to(tl.int32)
        total = tl.zeros([1 << 4], dtype=tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            # IEEE division, bit-identical to torch's logits / temperature.
            x = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=float("-inf")), temp)
            bits = x.to(tl.int32, bitcast=True)
            key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
            ge = (key[:, None] >= cand[None, :]) & mask[:, None]
            if USE_MASS:
                w = tl.exp(x - m_scaled)
                total += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
            else:
                total += tl.sum(ge.to(tl.float32), axis=0)  # exact: counts < 2^24
        best = tl.max(tl.where(total >= target, digits, 0), axis=0)
        prefix += best.to(tl.int64) << shift
    key = (prefix - 2147483648).to(tl.int32)
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _mass_at_or_above(row_ptr, vocab, temp, m_scaled, thr, BLOCK_V: tl.constexpr):
    z = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        x = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=float("-inf")), temp)
        z += tl.where(mask & (x >= thr), tl.exp(x - m_scaled), 0.0)
    return tl.sum(z, axis=0)


@triton.jit
def _sample_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,
    token_ptr, logprob_ptr, keep_ptr,
    vocab, stride_row,
    BLOCK_V: tl.constexpr, WRITE_KEEP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    temp = tl.load(temp_ptr + row)
    greedy = temp <= 0.0
    temp = tl.where(greedy, 1.0, temp)

    # Pass 1: raw max + first argmax, raw and scaled exp-sums (online, rescaled per chunk).
    m_raw = tl.full([], float("-inf"), tl.float32)
    s_raw = tl.zeros([], tl.float32)
    arg = tl.zeros([], tl.int32)
    s_scaled = tl.zeros([], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf"))
        c_max = tl.max(x, axis=0)
        c_arg = tl.min(tl.where(x == c_max, offs, 2147483647), axis=0)
        new_m = tl.maximum(m_raw, c_max)
        arg = tl.where(c_max > m_raw, c_arg, arg)  # strict: the earliest maximum wins
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        s_raw = s_raw * tl.exp(m_raw - safe) + tl.sum(tl.exp(x - safe), axis=0)
        s_scaled = s_scaled * tl.exp(tl.math.div_rn(m_raw - safe, temp)) + tl.sum(
            tl.exp(tl.math.div_rn(x - safe, temp)), axis=0
        )
        m_raw = new_m
    m_scaled = tl.math.div_rn(m_raw, temp)

    token = arg
    if not greedy:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        thr = tl.full([], float("-inf"), tl.float32)
        z = s_scaled
        if (top_k > 0) & (top_k < vocab):
            thr = _radix_threshold(row_ptr, vocab, temp, m_scaled, top_k.to(tl.float32), False, BLOCK_V)
            if top_p < 1.0:
                z = _mass_at_or_above(row_ptr, vocab, temp, m_scaled, thr, BLOCK_V)
        if top_p < 1.0:
            thr_p = _radix_threshold(row_ptr, vocab, temp, m_scaled, top_p * z, True, BLOCK_V)
            thr = tl.maximum(thr, thr_p)
        # Draw: Gumbel race among the kept tokens, Philox keyed by the row's seed.
        seed = tl.load(seed_ptr + row)
        best = tl.full([], float("-inf"), tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            x = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=float("-inf")), temp)
            keep = mask & (x >= thr) & (tl.exp(x - m_scaled) >= min_p)
            if WRITE_KEEP:
                tl.store(keep_ptr + row * vocab + offs, keep.to(tl.int8), mask=mask)
            u = tl.rand(seed, offs)
            score = tl.where(keep, x - tl.log(-tl.log(u)), float("-inf"))
            c_best = tl.max(score, axis=0)
            c_arg = tl.min(tl.where(score == c_best, offs, 2147483647), axis=0)
            token = tl.where(c_best > best, c_arg, token)
            best = tl.maximum(best, c_best)
    x_tok = tl.load(row_ptr + token)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, x_tok - m_raw - tl.log(s_raw))


def _launch(logits, temperature, top_k, top_p, min_p, seeds, keep):
    batch, vocab = logits.shape
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return tokens, logprobs
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # 1024 fp32 per chunk: 4 KB per load wave; x16 candidates stays within the registers.
    block_v = min(1024, triton.next_power_of_2(vocab))
    _sample_kernel[(batch,)](
        logits,
        temperature.float().contiguous(),
        top_k.to(torch.int32).contiguous(),
        top_p.float().contiguous(),
        min_p.float().contiguous(),
        seeds.to(torch.int64).contiguous(),
        tokens, logprobs, keep if keep is not None else tokens,
        vocab, logits.stride(0),
        BLOCK_V=block_v, WRITE_KEEP=keep is not None,
        num_warps=8,  # one program streams a whole row; 256 threads keep enough loads in flight
    )
    return tokens, logprobs


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Ops.sample``: one token per row and its raw logprob; see the module docstring."""
    return _launch(logits, temperature, top_k, top_p, min_p, seeds, None)


def keep_mask(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """[B, V] bool: the tokens the kernel's thresholds keep (rows with temperature > 0).

    For tests: it runs the sampling kernel itself with its mask written out, so it checks
    exactly what ``sample`` draws from. Greedy rows are left False.
    """
    batch, vocab = logits.shape
    keep = torch.zeros((batch, vocab), dtype=torch.int8, device=logits.device)
    seeds = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    _launch(logits, temperature, top_k, top_p, min_p, seeds, keep)
    return keep.bool()
