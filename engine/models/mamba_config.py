"""The Mamba-2 mixers of a hybrid decoder (Granite 4.0's "h" models,
``GraniteMoeHybridForCausalLM`` with ``mamba`` layers): their shape as config.json gives
it (``ModelConfig.mamba``).

A Mamba-2 layer keeps no KV cache. Each request carries two recurrent states a layer
instead, whatever its length: the last ``d_conv - 1`` inputs of the causal convolution
(``conv_dim`` channels) and the SSM state (``n_heads x head_dim x d_state``). The runner
holds one slot of each per running request (engine.runner.kv_cache.allocate_kv_caches).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MambaConfig:
    """The Mamba-2 layers of a hybrid model and their mixer's shape."""

    layers: tuple[int, ...]  # the Mamba layers' indices; the others are attention layers
    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int  # B and C are shared by n_heads / n_groups heads each
    d_conv: int  # the causal convolution's width
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj
    dt_min: float  # time_step_limit: dt is clamped into [dt_min, dt_max]
    dt_max: float

    @property
    def d_inner(self) -> int:
        """The width of x, z and the gated norm: ``n_heads * head_dim``."""
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def in_proj_size(self) -> int:
        """in_proj's rows: z, then x, B and C, then one dt a head."""
        return self.d_inner + self.conv_dim + self.n_heads


_MAMBA_TYPES = ("mamba", "linear_attention")  # as released; transformers 5 writes the second
_ATTENTION_TYPES = ("attention", "full_attention")


def mamba_fields(raw: dict[str, Any], arch: str) -> MambaConfig | None:
    """Granite 4's Mamba layers (``layer_types`` "mamba"), or None where every layer is
    attention (granite-4.0-micro) or for any other architecture."""
    if arch != "granite_hybrid":
        return None
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * layers
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {layers}")
    unknown = sorted({t for t in types if t not in _MAMBA_TYPES + _ATTENTION_TYPES})
    if unknown:
        raise UnsupportedModelError(f"GraniteMoeHybrid layer_types {unknown} are not supported "
                                    "(attention and mamba are)")
    mamba = tuple(i for i, t in enumerate(types) if t in _MAMBA_TYPES)
    if not mamba:
        return None
    hidden, heads = int(raw["hidden_size"]), int(raw.get("mamba_n_heads", 128))
    d_inner = int(raw.get("mamba_expand", 2)) * hidden
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = d_inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != d_inner:
        raise ValueError(f"mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) must be "
                         f"mamba_expand x hidden_size ({d_inner})")
    groups = int(raw.get("mamba_n_groups", 1))
    if heads % groups:
        raise ValueError(f"mamba_n_groups ({groups}) must divide mamba_n_heads ({heads})")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"GraniteMoeHybrid Mamba layers with hidden_act "
                                    f"{raw.get('hidden_act')!r} are not supported (silu is)")
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    return MambaConfig(
        layers=mamba, n_heads=heads, head_dim=head_dim, d_state=int(raw.get("mamba_d_state", 256)),
        n_groups=groups, d_conv=int(raw.get("mamba_d_conv", 4)),
        conv_bias=bool(raw.get("mamba_conv_bias", True)), proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_min=_json_float(limit[0]), dt_max=_json_float(limit[1]))


def _json_float(value: Any) -> float:
    """A float of config.json: a number, a string ("Infinity"), or transformers 5's
    ``{"__float__": "Infinity"}`` for a value JSON cannot write."""
    if isinstance(value, dict):
        value = value.get("__float__")
    return float(value)


def state_bytes_per_slot(mamba: MambaConfig, layers: int, dtype_bytes: int) -> int:
    """One request's recurrent state over ``layers`` Mamba layers: the convolution's window
    in the model dtype and the SSM state in fp32."""
    conv = mamba.conv_dim * (mamba.d_conv - 1) * dtype_bytes
    ssm = mamba.n_heads * mamba.head_dim * mamba.d_state * 4
    return layers * (conv + ssm)


__all__ = ["MambaConfig", "mamba_fields", "state_bytes_per_slot"]
