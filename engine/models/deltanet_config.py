"""The Gated DeltaNet layers of Qwen3.5 (``Qwen3_5ForCausalLM``; the text model of
``Qwen3_5ForConditionalGeneration``): their shape as config.json gives it
(``ModelConfig.deltanet``).

Like a Mamba layer (engine.models.mamba_config), a Gated DeltaNet layer keeps no KV cache
but two states a request: the causal convolution's last ``d_conv - 1`` inputs (q, k and v
channels) and a ``key_head_dim x value_head_dim`` matrix a value head, whatever the
request's length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeltaNetConfig:
    """The Gated DeltaNet layers ("linear_attention") of a hybrid model and their shape."""

    layers: tuple[int, ...]  # the DeltaNet layers' indices; the others are attention layers
    num_k_heads: int  # query and key heads, each shared by num_v_heads / num_k_heads value heads
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    d_conv: int
    mlp_layers: tuple[int, ...] = ()  # (no layer of its own is an MLP alone)
    # Qwen3-Next stores its projections grouped by key head (in_proj_qkvz, in_proj_ba);
    # Qwen3.5 each part whole (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
    grouped: bool = False
    # A GGUF's value heads, in llama.cpp's tiled order: value head j reads key head
    # j % num_k_heads (Hugging Face's grouped order: j // (num_v_heads / num_k_heads)). Every
    # value-head tensor (v's rows, z, b, a, A_log, dt_bias, out_proj's columns) keeps it.
    tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def local(self, world: int) -> DeltaNetConfig:
        """One of ``world`` tensor-parallel ranks' share: its key and value heads."""
        if world == 1:
            return self
        return dataclasses.replace(self, num_k_heads=self.num_k_heads // world, num_v_heads=self.num_v_heads // world)

    def tensor_parallel_problem(self, world: int) -> str | None:
        """Why the layers cannot be split over ``world`` ranks, or None."""
        if self.num_k_heads % world or self.num_v_heads % world:
            return (f"the Gated DeltaNet layers' {self.num_k_heads} key and {self.num_v_heads} value heads do not "
                    f"divide by {world}")
        if self.tiled and world > 1:
            return ("the GGUF's Gated DeltaNet value heads are in llama.cpp's tiled order, where a rank's key "
                    "heads' value heads are not one run of rows")
        return None

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's states in one layer: the convolution's window, each value head's
        key-by-value state."""
        return (self.conv_dim, self.d_conv - 1), (self.num_v_heads, self.k_head_dim, self.v_head_dim)


def deltanet_fields(raw: dict[str, Any], arch: str) -> DeltaNetConfig | None:
    """Qwen3.5's Gated DeltaNet layers (``layer_types`` "linear_attention", else every layer
    but each ``full_attention_interval``-th), or None for any other architecture."""
    if arch not in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        return None
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {layers}")
    unknown = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if unknown:
        raise UnsupportedModelError(f"Qwen3.5 layer_types {unknown} are not supported "
                                    "(linear_attention and full_attention are)")
    k_heads, v_heads = int(raw.get("linear_num_key_heads", 16)), int(raw.get("linear_num_value_heads", 32))
    if v_heads % k_heads:
        raise ValueError(f"linear_num_key_heads ({k_heads}) must divide linear_num_value_heads ({v_heads})")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"Qwen3.5 with hidden_act {raw.get('hidden_act')!r} is not supported (silu is)")
    return DeltaNetConfig(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"), num_k_heads=k_heads,
        num_v_heads=v_heads, k_head_dim=int(raw.get("linear_key_head_dim", 128)),
        v_head_dim=int(raw.get("linear_value_head_dim", 128)), d_conv=int(raw.get("linear_conv_kernel_dim", 4)),
        grouped=arch == "qwen3_next", tiled=bool(raw.get("linear_value_heads_tiled", False)))


__all__ = ["DeltaNetConfig", "deltanet_fields"]
