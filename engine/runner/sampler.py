"""Per-step sampling: logit bias, min_tokens, penalties, seeds and logprobs around ``ops.sample``.

The model runner calls ``Sampler(logits, rows, bitmask)`` once per step with one row per
request that produces a token. The work, in order (vLLM's order)::

    logits -> the server's logits processors (--logits-processors, vLLM V1's interface)
           -> grammar bitmask (-inf where structured output forbids) -> + logit_bias
           -> min_tokens mask -> allowed_token_ids -> bad_words
           -> repetition penalty -> presence/frequency
           -> ops.sample (temperature -> top-k -> top-p -> min-p -> draw)

A forbidden token stays -inf through every later step (a bias or penalty cannot lift it),
so the draw, whichever ``ops`` does it (torch, C or Triton), only picks allowed tokens; a
row left with none becomes a :class:`SamplingFailure`. The logits processors run first,
on the raw logits, so no processor can lift a token the grammar, allowed_token_ids or
bad_words forbid; one that raises fails the rows it was applied to (the step's), not the
engine.

Logprobs, sampled and top-N, are ``log_softmax`` of the logits after bias and penalties and
before temperature (what ``ops.sample`` reports for the sampled token).

Seeds: a seeded request draws with seed ``splitmix64(params.seed, step)`` where ``step`` is
the number of tokens it has output so far, so its tokens are the same whatever else shares
its batch, and whichever row it sits in. An unseeded row takes a seed from the Sampler's own
generator. Two samples of one ``n > 1`` request must carry different ``params.seed`` (vLLM
gives sample ``i`` the seed ``seed + i``), or they draw identical tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from engine.ops import Ops
from engine.ops.sampling_ref import truncate
from engine.params import SamplingParams
from engine.runner.logits_processors import ProcessorBatch

_U64 = (1 << 64) - 1
# splitmix64 constants (Steele, Lea & Flood, "Fast splittable pseudorandom number
# generators", OOPSLA 2014): the golden-ratio increment and the two finaliser multipliers.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# vLLM treats temperatures below 1e-5 as greedy: dividing logits by them overflows fp32.
_GREEDY_TEMPERATURE = 1e-5

SampledToken = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingFailure:
    """A row that cannot be sampled; only its request fails. ``reason`` is fit for a client."""

    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The model's EOS ids; they count as stop tokens for min_tokens unless ignore_eos.
    eos_token_ids: tuple[int, ...]
    # The request (sample id) the row samples for: the logits processors keep their
    # per-request state by it. None where no processor runs (the draft model's rows).
    key: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenBitmask:
    """Allowed tokens of a step's constrained rows: ``mask[i]`` (int32 words, bit ``t`` of
    the row = token ``t`` allowed; see ``engine.structured.bitmask``) for batch row
    ``rows[i]``. ``mask`` is on the CPU, where the grammar libraries fill it."""

    mask: torch.Tensor
    rows: tuple[int, ...]


def step_seed(seed: int, step: int) -> int:
    """The ``step``-th output of a splitmix64 stream seeded with ``seed``, as a signed int64.

    ``seed`` may be any int64 (it is taken mod 2**64); consecutive steps give unrelated
    seeds, so the per-step torch generators do not share structure.
    """
    z = ((seed & _U64) + (step + 1) * _GOLDEN) & _U64
    z = ((z ^ (z >> 30)) * _MIX1) & _U64
    z = ((z ^ (z >> 27)) * _MIX2) & _U64
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


class Sampler:
    """Turns one step's logits into one token (with logprobs) per request row.

    ``ops`` supplies ``sample``; ``seed`` seeds the generator that unseeded rows draw their
    per-step seeds from. Not thread-safe: one Sampler belongs to one model runner.
    """

    def __init__(self, ops: Ops, *, seed: int = 0, processors: ProcessorBatch | None = None) -> None:
        self._ops = ops
        self._generator = torch.Generator().manual_seed(seed)
        self.mask_apply_seconds = 0.0  # time spent applying grammar bitmasks
        # The server's logits processors and their view of the batch (None: none loaded).
        self.processors = processors

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow],
        bitmask: TokenBitmask | None = None,
    ) -> list[SampledToken | SamplingFailure]:
        """Sample row ``b`` of ``logits`` ([B, V]) for ``rows[b]``, only among the tokens
        ``bitmask`` allows for its constrained rows.

        Returns, per row, ``(token_id, logprob, top)`` where ``top`` holds the
        ``params.logprobs`` most likely ``(token_id, logprob)`` pairs, best first, or ``()``;
        or a :class:`SamplingFailure` for a row that has no token to draw (NaN or +inf in
        its adjusted logits, or every token masked). A returned id is always inside the
        vocabulary: the rest of the batch is sampled as if the failed rows were absent.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [len(rows), V] = [{len(rows)}, V], got {tuple(logits.shape)}"
            )
        if not rows:
            return []
        logits = logits.float()
        failures: dict[int, str] = {}
        if self.processors is not None:
            logits, failures = self.processors.apply(logits, rows)
        if bitmask is not None:
            t0 = time.perf_counter()
            if logits.dtype != torch.float32 or not logits.is_contiguous():
                logits = logits.contiguous()
            # In place: the runner's logits are this step's own tensor, used for nothing else.
            self._ops.apply_token_bitmask(logits, bitmask.mask, list(bitmask.rows))
            self.mask_apply_seconds += time.perf_counter() - t0
        logits = self._adjust_logits(logits, rows)
        # A batch of greedy rows only draws no seeds (nothing would use them), whichever
        # path samples it. On an op set with a one-pass arg-max (the C kernels) such a batch
        # takes it; that pass also finds the rows with nothing to draw (it declines the
        # batch, and the general path below reports them).
        all_greedy = all(r.params.temperature < _GREEDY_TEMPERATURE for r in rows)
        greedy = getattr(self._ops, "greedy", None)
        fast = greedy(logits) if greedy is not None and all_greedy and not failures else None
        if fast is not None:
            token_list, logprob_list = fast
        else:
            failures = {**_unsamplable_rows(logits), **failures}
            if failures:
                # Neutral logits for the failed rows, so no kernel sees a NaN or an empty row;
                # their draws are discarded below.
                logits = logits.clone()
                logits[list(failures)] = 0.0
            token_ids, logprobs = self._ops.sample(
                logits, *self._sampling_tensors(rows, logits, draw=not all_greedy))
            token_list, logprob_list = token_ids.tolist(), logprobs.tolist()
        tops = self._top_logprobs(logits, rows)
        out: list[SampledToken | SamplingFailure] = []
        vocab = logits.shape[-1]
        for b, (token, logprob, top) in enumerate(
            zip(token_list, logprob_list, tops, strict=True)
        ):
            if b in failures:
                out.append(SamplingFailure(failures[b]))
            elif not 0 <= token < vocab:
                # A kernel fault; never hand an id past the embedding table to anyone.
                out.append(SamplingFailure(f"the sampler drew token id {token}, outside the vocabulary"))
            else:
                out.append((token, logprob, top))
        return out

    def distributions(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(adjusted, probs)`` of each row: the logits after bias, min_tokens and penalties
        (what logprobs are taken from), and the distribution a draw of the row follows
        (temperature, top-k, top-p, min-p; a greedy row: one-hot on its arg-max). No seed
        is drawn: the Sampler's generator is left where it was.

        Speculative decoding's rejection rule reads them (``engine.runner.spec_verify``);
        the draft model draws its proposal from them."""
        adjusted = self._adjust_logits(logits.float(), rows)
        temps, top_ks, top_ps, min_ps = self._truncation_tensors(rows, adjusted)
        probs = torch.softmax(truncate(adjusted, temps, top_ks, top_ps, min_ps), dim=-1)
        greedy = (temps <= 0).nonzero().squeeze(-1)
        if greedy.numel():
            probs[greedy] = torch.nn.functional.one_hot(
                adjusted[greedy].argmax(-1), adjusted.shape[-1]).to(probs.dtype)
        return adjusted, probs

    # -- logit adjustments -------------------------------------------------------------

    def _adjust_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Bias, min_tokens and penalties; returns ``logits`` untouched when no row uses them."""
        vocab = logits.shape[-1]
        bias = _logit_bias_entries(rows, vocab)
        banned = _min_tokens_entries(rows, vocab)
        words = _bad_words_entries(rows, vocab)
        banned = (banned[0] + words[0], banned[1] + words[1])
        allowed = [b for b, r in enumerate(rows) if r.params.allowed_token_ids is not None]
        rep_rows = [b for b, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        pf_rows = [
            b
            for b, r in enumerate(rows)
            if (r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0)
            and len(r.output_token_ids) > 0
        ]
        if not (bias[0] or banned[0] or allowed or rep_rows or pf_rows):
            return logits  # the common case: nothing to do, not even a copy
        # A contiguous copy: the caller's logits stay as the model produced them, and the
        # penalties index the copy as a flat [B * V] view.
        logits = logits.clone(memory_format=torch.contiguous_format)
        device = logits.device
        if bias[0]:
            index = (torch.tensor(bias[0], device=device), torch.tensor(bias[1], device=device))
            # accumulate: a token listed twice in a tuple gets both biases (dicts cannot repeat)
            logits.index_put_(index, torch.tensor(bias[2], device=device), accumulate=True)
        if banned[0]:
            index = (torch.tensor(banned[0], device=device), torch.tensor(banned[1], device=device))
            logits[index] = float("-inf")
        if allowed:
            _keep_only_allowed(logits, rows, allowed)
        if rep_rows:
            _apply_repetition_penalty(logits, rows, rep_rows)
        if pf_rows:
            _apply_presence_frequency(logits, rows, pf_rows)
        return logits

    # -- sampling parameters -----------------------------------------------------------

    def _sampling_tensors(
        self, rows: Sequence[SamplingRow], logits: torch.Tensor, draw: bool = True
    ) -> tuple[torch.Tensor, ...]:
        """(temperature, top_k, top_p, min_p, seeds) as [B] tensors on the logits' device;
        without ``draw`` the unseeded rows get seed 0 and the generator does not move."""
        seeds = []
        unseeded = [b for b, r in enumerate(rows) if r.params.seed is None]
        drawn = iter(self._draw_seeds(len(unseeded)) if draw else [0] * len(unseeded))
        for r in rows:
            if r.params.seed is None:
                seeds.append(next(drawn))
            else:
                seeds.append(step_seed(r.params.seed, len(r.output_token_ids)))
        return (*self._truncation_tensors(rows, logits),
                torch.tensor(seeds, dtype=torch.int64, device=logits.device))

    @staticmethod
    def _truncation_tensors(
        rows: Sequence[SamplingRow], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p, min_p) as [B] tensors on the logits' device."""
        temps, top_ks, top_ps, min_ps = [], [], [], []
        vocab = logits.shape[-1]
        for r in rows:
            p = r.params
            temps.append(0.0 if p.temperature < _GREEDY_TEMPERATURE else p.temperature)
            # -1 and 0 mean "off", and so does k >= V; clamped so a huge k fits the int32.
            top_ks.append(p.top_k if 0 < p.top_k < vocab else 0)
            top_ps.append(p.top_p)
            min_ps.append(p.min_p)
        device = logits.device
        return (
            torch.tensor(temps, dtype=torch.float32, device=device),
            torch.tensor(top_ks, dtype=torch.int32, device=device),
            torch.tensor(top_ps, dtype=torch.float32, device=device),
            torch.tensor(min_ps, dtype=torch.float32, device=device),
        )

    def _draw_seeds(self, count: int) -> list[int]:
        if count == 0:
            return []  # keep the generator's stream unmoved when every row is seeded
        # The full int64 range: randint's upper bound is exclusive, so 2**63 - 1 is the max.
        low, high = -(1 << 63), (1 << 63) - 1
        return torch.randint(
            low, high, (count,), generator=self._generator, dtype=torch.int64
        ).tolist()

    # -- logprobs ----------------------------------------------------------------------

    def _top_logprobs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> list[tuple[tuple[int, float], ...]]:
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(rows)
        wanted = [b for b, r in enumerate(rows) if r.params.logprobs]
        if not wanted:
            return tops
        n_max = min(max(rows[b].params.logprobs or 0 for b in wanted), logits.shape[-1])
        logprobs = torch.log_softmax(logits[wanted], dim=-1)
        values, ids = torch.topk(logprobs, n_max, dim=-1)
        for i, (vals, toks) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            n = rows[wanted[i]].params.logprobs or 0
            # A forbidden token (grammar, min_tokens) is no alternative: fewer entries come
            # back when fewer than n tokens are allowed (and -inf has no JSON form).
            tops[wanted[i]] = tuple(
                (t, v) for t, v in zip(toks[:n], vals[:n], strict=True) if v != float("-inf"))
        return tops


def _unsamplable_rows(logits: torch.Tensor) -> dict[int, str]:
    """Rows with no token to draw, and why: NaN or +inf anywhere, or every token -inf.

    One reduction in the common case: ``amax`` propagates NaN, is +inf when any entry is,
    and is -inf only when every entry is; so a finite maximum clears the row.
    """
    top = logits.amax(dim=-1)
    bad = (~torch.isfinite(top)).nonzero().squeeze(-1).tolist()
    reasons = {}
    for b in bad:
        row = logits[b]
        if bool(torch.isnan(row).any()):
            reasons[b] = "the logits hold NaN (a numerical fault in the model or the penalties)"
        elif bool(torch.isposinf(row).any()):
            reasons[b] = "the logits hold +inf (a penalty or bias overflowed)"
        else:
            reasons[b] = (
                "no token can be sampled: every token is masked (the structured output "
                "grammar, stop_token_ids or EOS under min_tokens, logit_bias, "
                "allowed_token_ids, bad_words, a logits processor)"
            )
    return reasons


def _logit_bias_entries(
    rows: Sequence[SamplingRow], vocab: int
) -> tuple[list[int], list[int], list[float]]:
    """(row, token, bias) triples of every row's logit_bias, as three parallel lists."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    values: list[float] = []
    for b, r in enumerate(rows):
        for tok, value in r.params.logit_bias:
            if tok >= vocab:
                # The API checks ids against the vocabulary at submit; this is the backstop.
                raise ValueError(
                    f"logit_bias token id {tok} is out of range for vocabulary size {vocab}"
                )
            row_idx.append(b)
            tok_idx.append(tok)
            values.append(value)
    return row_idx, tok_idx, values


def _min_tokens_entries(rows: Sequence[SamplingRow], vocab: int) -> tuple[list[int], list[int]]:
    """(row, token) pairs to ban: stop tokens of rows still short of ``min_tokens``.

    EOS counts as a stop token unless ``ignore_eos`` (then EOS does not end the request, so
    there is no reason to keep it from being sampled).
    """
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for b, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops.update(r.eos_token_ids)
        # A stop id beyond the logits cannot be sampled, so there is nothing to mask.
        in_vocab = sorted(t for t in stops if t < vocab)
        row_idx.extend([b] * len(in_vocab))
        tok_idx.extend(in_vocab)
    return row_idx, tok_idx


def _bad_words_entries(rows: Sequence[SamplingRow], vocab: int) -> tuple[list[int], list[int]]:
    """(row, token) pairs to ban for ``bad_words``, as vLLM bans them: a one-token word
    always; a longer word's last token where the row's output already ends with the rest
    of the word (a word whose start lies in the prompt is not tracked)."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for b, r in enumerate(rows):
        words = r.params.bad_words_token_ids
        if not words:
            continue
        outputs = r.output_token_ids
        for word in words:
            head = len(word) - 1
            if head > len(outputs) or word[-1] >= vocab:
                continue
            if head == 0 or tuple(outputs[len(outputs) - head:]) == word[:-1]:
                row_idx.append(b)
                tok_idx.append(word[-1])
    return row_idx, tok_idx


def _keep_only_allowed(logits: torch.Tensor, rows: Sequence[SamplingRow], which: list[int]) -> None:
    """-inf for every token outside each row's ``allowed_token_ids`` (ids past the
    logits, possible only for a padded vocabulary, are nothing to keep)."""
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, b in enumerate(which):
        ids = [t for t in rows[b].params.allowed_token_ids or () if t < vocab]
        row_idx.extend([i] * len(ids))
        tok_idx.extend(ids)
    banned = torch.ones((len(which), vocab), dtype=torch.bool)
    banned[row_idx, tok_idx] = False
    banned = banned.to(logits.device)
    if len(which) == logits.shape[0]:  # every row (the samples of one request, say)
        logits.masked_fill_(banned, float("-inf"))
        return
    index = torch.tensor(which, device=logits.device)
    logits[index] = logits[index].masked_fill(banned, float("-inf"))


def _token_counts(
    token_lists: Sequence[Sequence[int]], which: list[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ``(row, token)`` pairs, as flat indices ``row * vocab + token``, and counts.

    ``token_lists[i]`` holds the tokens of row ``which[i]``. Working on the pairs that occur
    keeps the cost proportional to the tokens, not to ``rows x vocab``.
    """
    tokens = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.int64)
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
        # A wrong id would silently penalise a token of the next row.
        raise ValueError(f"token ids must lie in [0, {vocab}) to apply penalties")
    lengths = torch.tensor([len(toks) for toks in token_lists])
    row_ids = torch.repeat_interleave(torch.tensor(which, dtype=torch.int64), lengths)
    flat, counts = torch.unique(row_ids * vocab + tokens, return_counts=True)
    return flat.to(device), counts.to(device=device, dtype=torch.float32)


def _per_pair(values: list[float], flat: torch.Tensor, vocab: int) -> torch.Tensor:
    """Broadcast one value per batch row to the flat ``(row, token)`` indices of that row."""
    return torch.tensor(values, device=flat.device)[flat // vocab]


def _apply_repetition_penalty(
    logits: torch.Tensor, rows: Sequence[SamplingRow], which: list[int]
) -> None:
    """HF/CTRL semantics over prompt + output tokens: divide positive logits, multiply others."""
    vocab = logits.shape[-1]
    seen = [[*rows[b].prompt_token_ids, *rows[b].output_token_ids] for b in which]
    flat, _ = _token_counts(seen, which, vocab, logits.device)
    penalty = _per_pair([r.params.repetition_penalty for r in rows], flat, vocab)
    view = logits.view(-1)
    picked = view[flat]
    view[flat] = torch.where(picked > 0, picked / penalty, picked * penalty)


def _apply_presence_frequency(
    logits: torch.Tensor, rows: Sequence[SamplingRow], which: list[int]
) -> None:
    """OpenAI semantics over output tokens: ``logit -= count * freq + (count > 0) * presence``."""
    vocab = logits.shape[-1]
    outputs = [rows[b].output_token_ids for b in which]
    flat, counts = _token_counts(outputs, which, vocab, logits.device)
    freq = _per_pair([r.params.frequency_penalty for r in rows], flat, vocab)
    presence = _per_pair([r.params.presence_penalty for r in rows], flat, vocab)
    view = logits.view(-1)
    view[flat] -= counts * freq + presence
