"""Rotary position tables: every RoPE scaling type as transformers computes it.

:func:`rope_cos_sin_cache` is a model's table from its config; :func:`cos_sin_cache` the
table of any base, scaling and head size.

A model keeps one table ``[max_positions, head_dim]`` per distinct RoPE (Gemma 3 has two:
its sliding layers use their own base and no scaling): ``cos`` of every (position,
frequency) in the first half of a row, ``sin`` in the second, each already multiplied by
the type's attention factor (YaRN, longrope) and cast once to the model dtype, as
transformers casts its per-call ``cos``/``sin``.

Types whose frequencies depend on the sequence length are tabulated per position, which is
what transformers computes for a request that grows one token at a time:

* ``dynamic`` (NTK): transformers recomputes the base from ``seq_len = max position + 1``
  each forward once it passes the trained length. Row ``p`` uses ``seq_len = p + 1``:
  equal to transformers for a prompt within the trained length and every token decoded
  after it; a prompt longer than the trained length gets, in transformers, the base of its
  last position at all its positions (an artefact of batching it in one forward).
* ``longrope`` (Phi-3, also ``su``): short factors while ``seq_len <= original``, long ones
  past it. Row ``p`` uses the short factors below ``original`` and the long ones from
  there. transformers instead recomputes the whole sequence with the long factors once it
  crosses ``original`` (Phi-3's ``prepare_inputs_for_generation`` drops its cache there);
  requests within ``original_max_position_embeddings`` are identical.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from engine.errors import UnsupportedModelError
from engine.models.checkpoint import read_stored
from engine.models.config import ModelConfig


def cos_sin_cache(
    *,
    theta: float,
    scaling: dict[str, Any] | None,
    head_dim: int,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """[max_positions, head_dim]: cos then sin of every position's angles (see module doc)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    positions = torch.arange(max_positions, dtype=torch.float32)
    factor = 1.0
    if kind == "dynamic":
        freqs = positions.unsqueeze(1) * _dynamic_inv_freq(theta, scaling or {}, head_dim, max_positions)
    elif kind in ("longrope", "su"):
        freqs, factor = _longrope_freqs(theta, scaling or {}, head_dim, positions)
    else:
        inv_freq, factor = _inv_freq(theta, scaling, head_dim)
        freqs = torch.outer(positions, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return torch.cat((cos, sin), dim=-1).to(device=device, dtype=dtype)


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def _inv_freq(theta: float, scaling: dict[str, Any] | None, head_dim: int) -> tuple[torch.Tensor, float]:
    """Position-independent types: inverse frequencies [head_dim / 2] and attention factor."""
    inv_freq = 1.0 / (theta ** _exponents(head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(theta, scaling, head_dim)
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1's frequency-dependent scaling: long wavelengths are divided by `factor`,
    # short ones kept, and the band in between interpolated smoothly.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(theta: float, scaling: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by ``factor``, keep the high ones, ramp between
    (by how many turns each makes over the original length), and scale cos/sin by
    ``0.1 ln(factor) + 1`` (or the ``mscale`` ratio DeepSeek configs give)."""
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else float(scaling["max_position_embeddings"]) / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:
        # The dimension whose wavelength makes `turns` turns over the original length.
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    base = theta ** _exponents(head_dim)
    inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv_freq, float(attention)


def _dynamic_inv_freq(theta: float, scaling: dict[str, Any], head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim / 2]: row p is NTK's frequencies for ``seq_len = p + 1``,
    in fp32 tensor arithmetic as transformers evaluates it."""
    trained = int(scaling["max_position_embeddings"])
    factor = float(scaling["factor"])
    seq_len = torch.arange(1, max_positions + 1, dtype=torch.int64).clamp(min=trained)
    base = theta * ((factor * seq_len / trained) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base.unsqueeze(1) ** _exponents(head_dim))


def _longrope_freqs(
    theta: float, scaling: dict[str, Any], head_dim: int, positions: torch.Tensor
) -> tuple[torch.Tensor, float]:
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else float(scaling["max_position_embeddings"]) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** _exponents(head_dim)
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)
    inv = torch.where((positions < original).unsqueeze(1), short, long)
    return positions.unsqueeze(1) * inv, float(attention)


def rope_cos_sin_cache(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, *, local: bool = False
) -> torch.Tensor:
    """[max_pos, rope_dim]: ``config``'s table (:func:`cos_sin_cache`), cast to ``dtype``.

    ``local``: the table of Gemma 3's sliding layers (their own base, no scaling). Computed
    in fp32 and cast once, as HF does per call, so both round identically.
    """
    theta, scaling = config.rope_theta, config.rope_scaling
    if local and config.rope_local_theta is not None:
        theta, scaling = config.rope_local_theta, None
    return cos_sin_cache(
        theta=theta, scaling=scaling, head_dim=config.rope_dim,
        max_positions=config.max_position_embeddings, dtype=dtype, device=device,
    )


def pairs_to_halves(w: torch.Tensor, head_dim: int, rotary: int = 0) -> torch.Tensor:
    """q's or k's rows ([heads * head_dim, in], or a bias [heads * head_dim]) for a model
    whose RoPE turns interleaved pairs ``(x0, x1), (x2, x3), ...`` (GPT-J's layout: ERNIE
    4.5, GLM-4), laid out for the rotate-half RoPE every op set runs: each head's first
    ``rotary`` rows (all of them when 0) even ones first, then odd ones, the rest as they
    are. A query's and a key's values meet only in their dot product, which the same order
    on both leaves unchanged, and the pairs are turned by the same angles."""
    rotary = rotary or head_dim
    heads = w.reshape(-1, head_dim, *w.shape[1:])
    rot = heads[:, :rotary]
    return torch.cat([rot[:, 0::2], rot[:, 1::2], heads[:, rotary:]], dim=1).reshape(w.shape)


class PairsToHalves(Mapping):
    """A checkpoint's tensors with q_proj's and k_proj's rows (and biases) laid out by
    :func:`pairs_to_halves`, read on demand; every other tensor as stored."""

    _NAMES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias")

    def __init__(self, weights: Mapping, head_dim: int, rotary: int = 0) -> None:
        self._weights, self._head_dim, self._rotary = weights, head_dim, rotary

    def __getitem__(self, name: str) -> Any:
        w = self._weights[name]
        if name.endswith(self._NAMES):
            return pairs_to_halves(read_stored(w), self._head_dim, self._rotary)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

