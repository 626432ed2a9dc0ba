"""Plain-torch sampling: the CPU path and the oracle for the Triton sampling kernel.

Order of operations for one row (the Sampler has already applied logit bias, min_tokens
masking and penalties to ``logits``)::

    logits --/temperature--> top-k --> top-p --> min-p --> softmax --> inverse CDF
       |
       +--> log_softmax --> logprob of the chosen token (raw: no temperature, no truncation)

Top-k, then top-p, then min-p is the order of vLLM's pre-V1 sampler; vLLM V1 moved min-p
in front of top-k/top-p. Top-p measures mass after the masks before it, so it does not
commute with either neighbour; top-k and min-p do commute (min-p compares each token with
the row's maximum, which top-k never removes).

Masks are thresholds, so a mask never depends on how a sort orders equal values and a
kernel can reproduce it without sorting:

* **top-k** keeps every token whose logit is ``>=`` the k-th largest logit of the row. With
  ties at the k-th value it keeps all of them, so it may keep more than ``k`` tokens (vLLM
  does the same). ``k <= 0`` or ``k >= V`` keeps every token.
* **top-p** keeps every token whose probability is ``>=`` ``t``, where ``t`` is the largest
  probability value such that the tokens with probability ``>= t`` hold at least ``p`` of
  the mass: the smallest set reaching ``p``, widened to include every token tied with its
  last member. The most likely token always stays. ``p >= 1`` keeps every token. Probabilities are
  ``softmax`` of the (temperature-scaled, top-k-masked) logits in fp32 and the mass is an
  fp32 ``cumsum`` in descending order, so a kernel summing in another order can differ only
  when the mass lands within rounding of ``p``.
* **min-p** keeps tokens with ``prob >= min_p * max_prob``, evaluated as
  ``exp(logit - max_logit) >= min_p`` (the same inequality without the softmax sum). The
  arg-max token always stays. ``min_p == 0`` keeps every token.

Greedy rows (temperature 0) take ``argmax(logits)``; among equal maxima the lowest token id
wins (``torch.argmax`` returns the first). Other rows draw by inverse CDF: one ``u ~ U[0,
1)`` per row from a generator seeded by the row's own seed, and the first token whose
cumulative probability exceeds ``u``, so ``P(token i) = probs[i]`` and a row's draw depends
on nothing else in the batch. One uniform per row instead of one noise value per token
(an exponential race) made a batch of 32 temperature-1 rows over a 49k vocabulary ~10x
cheaper on CPU. (The Triton kernel races with Philox noise instead: on a GPU the per-token
noise is free and a race needs no scan.)
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
# Top-p looks for its cut among the 256, then the 4096 most likely tokens before sorting a
# whole row: on CPU a top-256 of a 49k vocabulary costs ~1/15 and a top-4096 ~1/6 of the full
# sort, and a peaked LLM distribution usually reaches p within the first few hundred tokens.
_TOP_P_PROBES = (256, 4096)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens below each row's k-th largest logit; ties at the k-th are kept.

    ``logits`` is ``[B, V]`` float, ``top_k`` is ``[B]`` int; ``k <= 0`` or ``k >= V`` turns
    the row's top-k off. Returns a new tensor, or ``logits`` itself when no row is active;
    the input is never modified.
    """
    vocab = logits.shape[-1]
    rows = ((top_k > 0) & (top_k < vocab)).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return logits
    out = logits.clone()
    ks = top_k[rows].long()
    # One topk at the largest k of the active rows, then each row reads its own k-th value.
    top_vals = torch.topk(logits[rows], int(ks.max()), dim=-1).values
    kth = top_vals.gather(-1, (ks - 1).unsqueeze(-1))
    sub = out[rows]
    out[rows] = sub.masked_fill(sub < kth, _NEG_INF)
    return out


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest top set of tokens holding mass ``>= p``, plus ties with its last one.

    ``logits`` is ``[B, V]`` float (probabilities are its fp32 softmax), ``top_p`` is ``[B]``
    float in ``(0, 1]``; ``p >= 1`` turns the row's top-p off. Returns masked logits (a new
    tensor, or ``logits`` itself when no row is active; the input is never modified). See
    the module docstring for the exact threshold definition.
    """
    rows = (top_p < 1.0).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return logits
    probs = torch.softmax(logits[rows].float(), dim=-1)
    ps = top_p[rows].float().unsqueeze(-1)
    threshold = torch.empty_like(ps)
    pending = torch.arange(len(rows), device=probs.device)  # rows whose cut is not found yet
    for probe in (*_TOP_P_PROBES, probs.shape[-1]):
        # torch.topk with k = V sorts the whole row, so the last probe settles every row.
        head = torch.topk(probs[pending], min(probe, probs.shape[-1]), dim=-1).values
        cum = torch.cumsum(head, dim=-1)
        found = (cum[:, -1] >= ps[pending, 0]) | (head.shape[-1] == probs.shape[-1])
        done = pending[found]
        threshold[done] = _top_p_threshold(head[found], cum[found], ps[done])
        pending = pending[~found]
        if pending.numel() == 0:
            break
    out = logits.clone()
    out[rows] = out[rows].masked_fill(probs < threshold, _NEG_INF)
    return out


def _top_p_threshold(
    sorted_probs: torch.Tensor, cum: torch.Tensor, ps: torch.Tensor
) -> torch.Tensor:
    """The probability at the cut: the first sorted position whose running mass is ``>= p``.

    Tokens strictly before the cut hold mass ``< p``. If rounding leaves the whole row
    short of ``p``, the cut is the last position (every token stays). ``cum`` is the fp32
    running sum of ``sorted_probs`` (descending); on CPU a prefix gives the same sums as the
    full sort, as torch.cumsum adds left to right.
    """
    cut = (cum < ps).sum(dim=-1, keepdim=True).clamp_max(sorted_probs.shape[-1] - 1)
    return sorted_probs.gather(-1, cut)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with ``prob < min_p * max_prob`` (as ``exp(logit - max) < min_p``).

    ``logits`` is ``[B, V]`` float, ``min_p`` is ``[B]`` float in ``[0, 1]``; 0 turns the
    row's min-p off. Returns masked logits (a new tensor, or ``logits`` itself when no row is
    active; the input is never modified).
    """
    rows = (min_p > 0.0).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return logits
    out = logits.clone()
    sub = out[rows]
    ratio = torch.exp(sub - sub.max(dim=-1, keepdim=True).values)
    out[rows] = sub.masked_fill(ratio < min_p[rows].float().unsqueeze(-1), _NEG_INF)
    return out


def row_uniforms(seeds: torch.Tensor) -> torch.Tensor:
    """``[B]`` fp64 draws from ``U[0, 1)``; draw ``b`` depends only on ``seeds[b]``.

    One generator is re-seeded per row (a loop over rows, one number each).
    """
    gen = torch.Generator(device="cpu")
    out = torch.empty(len(seeds), dtype=torch.float64)
    for b, seed in enumerate(seeds.tolist()):
        gen.manual_seed(seed)  # negative int64 seeds are valid (torch remaps them)
        out[b] = torch.rand((), generator=gen, dtype=torch.float64)
    return out


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative mass first exceeds ``u * total``.

    ``probs`` is ``[B, V]`` (rows need not sum to exactly 1, masked tokens are 0), ``uniforms``
    ``[B]`` in ``[0, 1)``. A zero-probability token never starts a rise of the running sum,
    so it is never the first to exceed the target; where rounding puts ``u * total`` at the
    very top, the row's last token of positive probability is taken instead.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    target = uniforms.to(device=cdf.device, dtype=cdf.dtype).unsqueeze(-1) * total
    picked = torch.searchsorted(cdf, target, right=True)
    last_positive = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picked, last_positive).squeeze(-1)


def _take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]``, without the copy when ``rows`` is every row in order."""
    return x if rows.numel() == x.shape[0] else x[rows]


def truncate(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature-scaled logits with top-k, top-p and min-p masks applied, in that order.

    Rows with temperature 0 are scaled by 1 (they are sampled greedily anyway).
    """
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.float() / temp.float().unsqueeze(-1)
    return apply_min_p(apply_top_p(apply_top_k(scaled, top_k), top_p), min_p)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; see ``engine.ops.Ops.sample`` and the module docstring.

    Returns ``(token_ids [B] int64, logprobs [B] fp32)``; a logprob is the chosen token's
    under ``log_softmax(logits)``, before temperature and truncation.
    """
    logits = logits.float()
    batch = logits.shape[0]
    token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    greedy = temperature <= 0
    greedy_rows = greedy.nonzero().squeeze(-1)
    random_rows = (~greedy).nonzero().squeeze(-1)
    if greedy_rows.numel() > 0:
        token_ids[greedy_rows] = torch.argmax(_take_rows(logits, greedy_rows), dim=-1)
    if random_rows.numel() > 0:
        masked = truncate(
            _take_rows(logits, random_rows),
            temperature[random_rows],
            top_k[random_rows],
            top_p[random_rows],
            min_p[random_rows],
        )
        probs = torch.softmax(masked, dim=-1)
        token_ids[random_rows] = inverse_cdf(probs, row_uniforms(seeds[random_rows]))
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return token_ids, logprobs
