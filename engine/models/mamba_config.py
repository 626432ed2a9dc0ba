"""The Mamba-2 mixers of a hybrid decoder (Granite 4.0's "h" models,
``GraniteMoeHybridForCausalLM`` with ``mamba`` layers; NVIDIA's Nemotron-H,
``NemotronHForCausalLM``): their shape as config.json gives it (``ModelConfig.mamba``).

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
    # Nemotron-H's MLP blocks (a layer of their own, no attention, no state): no cache either.
    mlp_layers: tuple[int, ...] = ()
    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int  # B and C are shared by n_heads / n_groups heads each
    d_conv: int  # the causal convolution's width
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj
    dt_min: float  # time_step_limit: dt is clamped into [dt_min, dt_max]
    dt_max: float
    # Over tensor-parallel ranks (local()): how many ranks one gated-norm group spans (its
    # groups copied to every rank, n_groups 1: the norm's mean is summed over the ranks).
    norm_world: int = 1

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

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's states in one layer: the convolution's window, the SSM state."""
        return (self.conv_dim, self.d_conv - 1), (self.n_heads, self.head_dim, self.d_state)

    def local(self, world: int) -> MambaConfig:
        """One of ``world`` tensor-parallel ranks' share: its heads, and its groups (a
        share of them, or with one group, that group copied to every rank)."""
        if world == 1:
            return self
        split = self.n_groups % world == 0
        return dataclasses.replace(self, n_heads=self.n_heads // world,
                                   n_groups=self.n_groups // world if split else self.n_groups,
                                   norm_world=1 if split else world)

    def tensor_parallel_problem(self, world: int) -> str | None:
        """Why the mixers cannot be split over ``world`` ranks, or None."""
        if self.n_heads % world:
            return f"the Mamba layers' {self.n_heads} heads do not divide by {world}"
        if self.n_groups % world and self.n_groups != 1:
            return f"the Mamba layers' {self.n_groups} groups neither divide by {world} nor are one"
        if self.proj_bias:
            return "Mamba layers with projection biases (mamba_proj_bias) do not split over ranks"
        return None


_MAMBA_TYPES = ("mamba", "linear_attention")  # as released; transformers 5 writes the second
_ATTENTION_TYPES = ("attention", "full_attention")
# Nemotron-H's hybrid_override_pattern, a character a layer.
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def nemotron_h_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """A Nemotron-H config.json under the decoder's keys: its layers as ``layer_types``
    ("mamba", "attention", "mlp"; from ``hybrid_override_pattern`` as released or
    transformers 5's ``layers_block_type``), its norms' eps; the MLP's squared ReLU and
    the layers without RoPE are the family's own. MoE layers ("E", Nemotron 3) are refused."""
    pattern = raw.get("hybrid_override_pattern")
    if pattern is not None:
        unknown = sorted(set(pattern) - set(_PATTERN))
        if unknown:
            raise UnsupportedModelError(f"hybrid_override_pattern characters {unknown} are not known")
        types = [_PATTERN[c] for c in pattern]
    else:
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        types = [names.get(t, t) for t in raw.get("layers_block_type") or raw.get("layer_types") or []]
    if "moe" in types:
        raise UnsupportedModelError("Nemotron-H with MoE layers (Nemotron 3) is not supported; its "
                                    "Mamba, attention and MLP layers are")
    if raw.get("mlp_hidden_act", "relu2") != "relu2":
        raise UnsupportedModelError(f"Nemotron-H with mlp_hidden_act {raw.get('mlp_hidden_act')!r} is not "
                                    "supported (relu2 is)")
    if raw.get("sliding_window"):
        raise UnsupportedModelError("Nemotron-H with a sliding_window is not supported")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise UnsupportedModelError(f"Nemotron-H with {flag} is not supported")
    out = {k: v for k, v in raw.items() if k not in ("hybrid_override_pattern", "layers_block_type")}
    # tie_word_embeddings: transformers' class ties nothing, so a stored lm_head.weight is
    # the head whatever the flag says (and without one the embedding serves).
    return out | {"layer_types": types, "num_hidden_layers": len(types), "tie_word_embeddings": False,
                  "rms_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)), "hidden_act": "silu"}


def mamba_fields(raw: dict[str, Any], arch: str) -> MambaConfig | None:
    """Granite 4's Mamba layers (``layer_types`` "mamba"), or None where every layer is
    attention (granite-4.0-micro) or for any other architecture; Nemotron-H's Mamba and
    MLP layers (its raw config as :func:`nemotron_h_raw` gives it)."""
    if arch == "nemotron_h":
        return _nemotron_h(raw)
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


def _nemotron_h(raw: dict[str, Any]) -> MambaConfig:
    """Nemotron-H's mixers. Its dt is clamped by ``time_step_limit``, as the checkpoint's own
    modeling code reads it ((0, inf) as released). transformers 5's port clamps its prompt
    path alone at ``time_step_min`` (0.001) instead, and its decode path not at all."""
    types = raw["layer_types"]
    heads, head_dim = int(raw.get("mamba_num_heads", 128)), int(raw.get("mamba_head_dim", 64))
    groups = int(raw.get("n_groups", 8))
    if heads % groups:
        raise ValueError(f"n_groups ({groups}) must divide mamba_num_heads ({heads})")
    if raw.get("mamba_hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"Nemotron-H with mamba_hidden_act {raw.get('mamba_hidden_act')!r} is "
                                    "not supported (silu is)")
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    return MambaConfig(
        layers=tuple(i for i, t in enumerate(types) if t == "mamba"),
        mlp_layers=tuple(i for i, t in enumerate(types) if t == "mlp"),
        n_heads=heads, head_dim=head_dim, d_state=int(raw.get("ssm_state_size", 128)), n_groups=groups,
        d_conv=int(raw.get("conv_kernel", 4)), conv_bias=bool(raw.get("use_conv_bias", True)),
        proj_bias=bool(raw.get("use_bias", False)), dt_min=_json_float(limit[0]), dt_max=_json_float(limit[1]))


def state_bytes_per_slot(recurrent: Any, layers: int, dtype_bytes: int) -> int:
    """One request's recurrent state over ``layers`` of ``recurrent``'s layers (a
    MambaConfig or a DeltaNetConfig: ``state_shapes()``): the convolution's window in the
    model dtype and the recurrent state in fp32."""
    conv, ssm = recurrent.state_shapes()
    return layers * (math.prod(conv) * dtype_bytes + math.prod(ssm) * 4)


__all__ = ["MambaConfig", "mamba_fields", "nemotron_h_raw", "state_bytes_per_slot"]
