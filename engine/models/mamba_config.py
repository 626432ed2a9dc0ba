"""The Mamba-2 mixers of a hybrid decoder (Granite 4.0's "h" models,
``GraniteMoeHybridForCausalLM`` with ``mamba`` layers; NVIDIA's Nemotron-H,
``NemotronHForCausalLM``; TII's Falcon-H1, ``FalconH1ForCausalLM``): their shape as
config.json gives it (``ModelConfig.mamba``), and Falcon-H1's multipliers
(``ModelConfig.falcon_h1``).

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
    # Nemotron-H's MLP and MoE blocks (a layer of their own, no attention, no state): no cache either.
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
    # The output's gate: an RMS norm per group of y * silu(z) (gated_norm, Granite's and
    # Nemotron-H's), of y before the gate (norm_before_gate), or no norm at all (Falcon-H1's
    # mamba_rms_norm false: y * silu(z)); the norm's weight multiplies the fp32 normed
    # values before they are rounded (norm_weight_fp32, Falcon-H1's) or after.
    gated_norm: bool = True
    norm_before_gate: bool = False
    norm_weight_fp32: bool = False
    # Falcon-H1's ssm_multipliers: in_proj's output scaled, one factor for each of its
    # parts (z, x, B, C, dt); () for none.
    in_multipliers: tuple[float, ...] = ()
    # Mamba2ForCausalLM's residual_in_fp32: the residual stream is kept in fp32 between
    # blocks (each block's norm reads it rounded to the model dtype).
    residual_in_fp32: bool = False

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
    the layers without RoPE are the family's own. MoE layers ("E", Nemotron 3) are "moe"
    (engine.models.moe_config reads their experts)."""
    pattern = raw.get("hybrid_override_pattern")
    if pattern is not None:
        unknown = sorted(set(pattern) - set(_PATTERN))
        if unknown:
            raise UnsupportedModelError(f"hybrid_override_pattern characters {unknown} are not known")
        types = [_PATTERN[c] for c in pattern]
    else:
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        types = [names.get(t, t) for t in raw.get("layers_block_type") or raw.get("layer_types") or []]
        unknown = sorted(set(types) - set(_PATTERN.values()))
        if unknown:
            raise UnsupportedModelError(f"Nemotron-H layers_block_type {unknown} are not known")
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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FalconH1Multipliers:
    """Falcon-H1's muP multipliers, applied to the activations where transformers applies
    them: the attention's input and output, the Mamba mixer's input and output (in_proj's
    parts: ``MambaConfig.in_multipliers``), the MLP's gate and output, the logits. Its
    key_multiplier scales the attention scores (the attention scale), its
    embedding_multiplier is ``ModelConfig.embedding_multiplier``."""

    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0
    lm_head: float = 1.0
    key: float = 1.0


def falcon_h1_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """A Falcon-H1 config.json under the decoder's keys. Each of its layers runs attention
    and a Mamba mixer side by side on one norm, so each is two cache layers here:
    attention at ``2 i``, its Mamba mixer at ``2 i + 1`` (``layer_types``). Biases on
    any projection are refused (the released models have none)."""
    for flag in ("attention_bias", "mlp_bias", "mamba_proj_bias", "projectors_bias"):
        if raw.get(flag):
            raise UnsupportedModelError(f"Falcon-H1 with {flag} is not supported")
    for key in ("hidden_act", "mamba_hidden_act"):
        if raw.get(key, "silu") != "silu":
            raise UnsupportedModelError(f"Falcon-H1 with {key} {raw.get(key)!r} is not supported (silu is)")
    layers = int(raw["num_hidden_layers"])
    return dict(raw, layer_types=["attention", "mamba"] * layers, num_hidden_layers=2 * layers)


# transformers' Mamba2Config defaults, for the keys a config.json leaves out.
_MAMBA2_DEFAULTS = dict(num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096, state_size=128,
                        num_hidden_layers=64, layer_norm_epsilon=1e-5, expand=2, conv_kernel=4, n_groups=8,
                        use_bias=False, use_conv_bias=True, hidden_act="silu", residual_in_fp32=True,
                        time_step_limit=(0.0, math.inf), tie_word_embeddings=False, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2)


def mamba2_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """A Mamba-2 (``Mamba2ForCausalLM``: Mamba-Codestral, the mamba2-*-hf conversions)
    config.json under the decoder's keys: every layer a Mamba block, no attention (the
    attention fields the decoder reads are the mixer's heads, and unused)."""
    out = _MAMBA2_DEFAULTS | raw
    if out["hidden_act"] != "silu":
        raise UnsupportedModelError(f"Mamba-2 with hidden_act {out['hidden_act']!r} is not supported (silu is)")
    layers, heads = int(out["num_hidden_layers"]), int(out["num_heads"])
    return out | {"layer_types": ["mamba"] * layers, "num_attention_heads": heads, "num_key_value_heads": heads,
                  "intermediate_size": int(out["expand"]) * int(out["hidden_size"]),
                  "rms_norm_eps": float(out["layer_norm_epsilon"])}


def falcon_h1_multipliers(raw: dict[str, Any], arch: str) -> FalconH1Multipliers | None:
    """Falcon-H1's multipliers (transformers' defaults: 1 each), None for other families."""
    if arch != "falcon_h1":
        return None
    gate, down = raw.get("mlp_multipliers") or (1.0, 1.0)
    return FalconH1Multipliers(
        attention_in=float(raw.get("attention_in_multiplier", 1.0)),
        attention_out=float(raw.get("attention_out_multiplier", 1.0)),
        ssm_in=float(raw.get("ssm_in_multiplier", 1.0)), ssm_out=float(raw.get("ssm_out_multiplier", 1.0)),
        mlp_gate=float(gate), mlp_down=float(down), lm_head=float(raw.get("lm_head_multiplier", 1.0)),
        key=float(raw.get("key_multiplier", 1.0)))


def recurrent_raw(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The config.json of a family with Mamba layers only or alongside others under the
    decoder's keys (Nemotron-H, Falcon-H1, Mamba-2, Mamba and FalconMamba); any other as it is."""
    if arch == "nemotron_h":
        return nemotron_h_raw(raw)
    if arch == "falcon_h1":
        return falcon_h1_raw(raw)
    if arch == "mamba2":
        return mamba2_raw(raw)
    if arch == "jamba":
        return jamba_raw(raw)
    return mamba1_raw(raw) if arch in ("mamba", "falcon_mamba") else raw


def mamba_fields(raw: dict[str, Any], arch: str) -> MambaConfig | None:
    """Granite 4's Mamba layers (``layer_types`` "mamba"), or None where every layer is
    attention (granite-4.0-micro) or for any other architecture; Nemotron-H's Mamba and
    MLP layers (its raw config as :func:`nemotron_h_raw` gives it)."""
    if arch == "nemotron_h":
        return _nemotron_h(raw)
    if arch == "falcon_h1":
        return _falcon_h1(raw)
    if arch == "mamba2":
        return _mamba2(raw)
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
    heads, head_dim, groups = _mamba_heads(raw, int(raw.get("mamba_expand", 2)) * int(raw["hidden_size"]))
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"GraniteMoeHybrid Mamba layers with hidden_act "
                                    f"{raw.get('hidden_act')!r} are not supported (silu is)")
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    return MambaConfig(
        layers=mamba, n_heads=heads, head_dim=head_dim, d_state=int(raw.get("mamba_d_state", 256)),
        n_groups=groups, d_conv=int(raw.get("mamba_d_conv", 4)),
        conv_bias=bool(raw.get("mamba_conv_bias", True)), proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_min=_json_float(limit[0]), dt_max=_json_float(limit[1]))


def _mamba_heads(raw: dict[str, Any], d_inner: int) -> tuple[int, int, int]:
    """Granite 4's and Falcon-H1's mixer heads, their width and B/C groups
    (``mamba_n_heads``, ``mamba_d_head``, "auto": the mixer's width ``d_inner`` over the
    heads, ``mamba_n_groups``), checked against each other."""
    heads = int(raw.get("mamba_n_heads", 128))
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = d_inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != d_inner:
        raise ValueError(f"mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) must be the mixer's width ({d_inner})")
    groups = int(raw.get("mamba_n_groups", 1))
    if heads % groups:
        raise ValueError(f"mamba_n_groups ({groups}) must divide mamba_n_heads ({heads})")
    return heads, head_dim, groups


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
        mlp_layers=tuple(i for i, t in enumerate(types) if t in ("mlp", "moe")),  # (the MoE blocks: ModelConfig.moe)
        n_heads=heads, head_dim=head_dim, d_state=int(raw.get("ssm_state_size", 128)), n_groups=groups,
        d_conv=int(raw.get("conv_kernel", 4)), conv_bias=bool(raw.get("use_conv_bias", True)),
        proj_bias=bool(raw.get("use_bias", False)), dt_min=_json_float(limit[0]), dt_max=_json_float(limit[1]))


def _mamba2(raw: dict[str, Any]) -> MambaConfig:
    """Mamba-2's mixers, one a layer (its raw config as :func:`mamba2_raw` gives it)."""
    heads, head_dim, groups = int(raw["num_heads"]), int(raw["head_dim"]), int(raw["n_groups"])
    if heads * head_dim != int(raw["expand"]) * int(raw["hidden_size"]):
        raise ValueError(f"num_heads ({heads}) x head_dim ({head_dim}) must be expand x hidden_size")
    if heads % groups:
        raise ValueError(f"n_groups ({groups}) must divide num_heads ({heads})")
    limit = raw["time_step_limit"] or (0.0, math.inf)
    return MambaConfig(
        layers=tuple(range(int(raw["num_hidden_layers"]))), n_heads=heads, head_dim=head_dim,
        d_state=int(raw["state_size"]), n_groups=groups, d_conv=int(raw["conv_kernel"]),
        conv_bias=bool(raw["use_conv_bias"]), proj_bias=bool(raw["use_bias"]),
        dt_min=_json_float(limit[0]), dt_max=_json_float(limit[1]),
        residual_in_fp32=bool(raw["residual_in_fp32"]))


def _falcon_h1(raw: dict[str, Any]) -> MambaConfig:
    """Falcon-H1's mixers (every odd cache layer, :func:`falcon_h1_raw`): ``mamba_d_ssm``
    wide (else ``mamba_expand`` x hidden), its gated norm optional (``mamba_rms_norm``,
    off as released), its in_proj scaled by ``ssm_multipliers``."""
    d_ssm = raw.get("mamba_d_ssm")
    heads, head_dim, groups = _mamba_heads(
        raw, int(d_ssm) if d_ssm is not None else int(raw.get("mamba_expand", 2)) * int(raw["hidden_size"]))
    multipliers = tuple(float(m) for m in raw.get("ssm_multipliers") or (1.0,) * 5)
    if len(multipliers) != 5:
        raise ValueError(f"ssm_multipliers has {len(multipliers)} values, not 5 (z, x, B, C, dt)")
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    return MambaConfig(
        layers=tuple(range(1, int(raw["num_hidden_layers"]), 2)), n_heads=heads, head_dim=head_dim,
        d_state=int(raw.get("mamba_d_state", 256)), n_groups=groups, d_conv=int(raw.get("mamba_d_conv", 4)),
        conv_bias=bool(raw.get("mamba_conv_bias", True)), proj_bias=False,
        dt_min=_json_float(limit[0]), dt_max=_json_float(limit[1]),
        gated_norm=bool(raw.get("mamba_rms_norm", False)),
        norm_before_gate=bool(raw.get("mamba_norm_before_gate", True)), norm_weight_fp32=True,
        in_multipliers=() if all(m == 1.0 for m in multipliers) else multipliers)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Mamba1Config:
    """The selective-scan (Mamba-1) mixers of ``MambaForCausalLM`` and
    ``FalconMambaForCausalLM``, one a layer: ``d_inner`` channels, each with its own
    ``d_state``-wide state and its own decay per state value (``A`` is ``[d_inner,
    d_state]``); dt through a ``dt_rank`` bottleneck; B and C shared by the channels."""

    layers: tuple[int, ...]
    mlp_layers: tuple[int, ...] = ()  # (none: what attention_layers reads of any recurrent config)
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj
    # FalconMamba's mixer_rms_eps: dt's bottleneck, B and C each RMS-normed (no weight)
    # before use; None for Mamba. Jamba's norms have weights (bcdt_norm_weights).
    bcdt_norm_eps: float | None = None
    bcdt_norm_weights: bool = False
    module: str = "mixer"  # where a layer's mixer sits: "mixer", Jamba's "mamba"
    residual_in_fp32: bool = True

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's states in one layer: the convolution's window, the SSM state."""
        return (self.d_inner, self.d_conv - 1), (self.d_inner, self.d_state)

    def local(self, world: int) -> Mamba1Config:
        """One of ``world`` tensor-parallel ranks' share: its ``d_inner / world`` channels
        (each channel's convolution, state, dt, A and D are its own)."""
        return self if world == 1 else dataclasses.replace(self, d_inner=self.d_inner // world)

    def tensor_parallel_problem(self, world: int) -> str | None:
        """Why the mixers cannot be split over ``world`` ranks, or None."""
        if self.d_inner % world:
            return f"the Mamba layers' {self.d_inner} channels (intermediate size) do not divide by {world}"
        if self.proj_bias:
            return "Mamba layers with projection biases (use_bias) do not split over ranks"
        return None


# transformers' MambaConfig / FalconMambaConfig defaults, for the keys a config.json leaves out.
_MAMBA1_DEFAULTS = dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=32,
                        layer_norm_epsilon=1e-5, pad_token_id=0, bos_token_id=0, eos_token_id=0, expand=2,
                        conv_kernel=4, use_bias=False, use_conv_bias=True, hidden_act="silu",
                        residual_in_fp32=True, time_step_rank="auto", tie_word_embeddings=True,
                        mixer_rms_eps=1e-6)


def mamba1_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """A Mamba or FalconMamba config.json under the decoder's keys (every layer a Mamba
    block; the attention fields, unused, set to one head of the model's width)."""
    out = _MAMBA1_DEFAULTS | raw
    if out["hidden_act"] != "silu":
        raise UnsupportedModelError(f"Mamba with hidden_act {out['hidden_act']!r} is not supported (silu is)")
    hidden = int(out["hidden_size"])
    inner = int(out.get("intermediate_size") or int(out["expand"]) * hidden)
    rank = out["time_step_rank"]
    return out | {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": hidden, "intermediate_size": inner,
                  "time_step_rank": math.ceil(hidden / 16) if rank == "auto" else int(rank),
                  "rms_norm_eps": float(out["layer_norm_epsilon"])}


def mamba1_fields(raw: dict[str, Any], arch: str) -> Mamba1Config | None:
    """The mixers of a Mamba / FalconMamba config as :func:`mamba1_raw` gives it; None
    for other families."""
    if arch == "jamba":
        return _jamba(raw)
    if arch not in ("mamba", "falcon_mamba"):
        return None
    return Mamba1Config(
        layers=tuple(range(int(raw["num_hidden_layers"]))), d_inner=int(raw["intermediate_size"]),
        d_state=int(raw["state_size"]), d_conv=int(raw["conv_kernel"]), dt_rank=int(raw["time_step_rank"]),
        conv_bias=bool(raw["use_conv_bias"]), proj_bias=bool(raw["use_bias"]),
        bcdt_norm_eps=float(raw["mixer_rms_eps"]) if arch == "falcon_mamba" else None,
        residual_in_fp32=bool(raw["residual_in_fp32"]))


def jamba_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """A Jamba config.json under the decoder's keys: its layers' kinds (attention every
    ``attn_layer_period``-th from ``attn_layer_offset``, Mamba-1 the others) as
    ``layer_types``."""
    for key in ("hidden_act",):
        if raw.get(key, "silu") != "silu":
            raise UnsupportedModelError(f"Jamba with {key} {raw.get(key)!r} is not supported (silu is)")
    layers = int(raw["num_hidden_layers"])
    period, offset = int(raw.get("attn_layer_period", 8)), int(raw.get("attn_layer_offset", 4))
    return dict(raw, layer_types=["attention" if i % period == offset else "mamba" for i in range(layers)])


def _jamba(raw: dict[str, Any]) -> Mamba1Config:
    """Jamba's Mamba-1 mixers: dt, B and C RMS-normed with weights at rms_norm_eps."""
    hidden = int(raw["hidden_size"])
    rank = raw.get("mamba_dt_rank", "auto")
    return Mamba1Config(
        layers=tuple(i for i, t in enumerate(raw["layer_types"]) if t == "mamba"),
        d_inner=int(raw.get("mamba_expand", 2)) * hidden, d_state=int(raw.get("mamba_d_state", 16)),
        d_conv=int(raw.get("mamba_d_conv", 4)), dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        conv_bias=bool(raw.get("mamba_conv_bias", True)), proj_bias=bool(raw.get("mamba_proj_bias", False)),
        bcdt_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), bcdt_norm_weights=True, module="mamba",
        residual_in_fp32=False)


def state_bytes_per_slot(recurrent: Any, layers: int, dtype_bytes: int) -> int:
    """One request's recurrent state over ``layers`` of ``recurrent``'s layers (a
    MambaConfig or a DeltaNetConfig: ``state_shapes()``): the convolution's window in the
    model dtype and the recurrent state in fp32."""
    conv, ssm = recurrent.state_shapes()
    return layers * (math.prod(conv) * dtype_bytes + math.prod(ssm) * 4)


__all__ = ["FalconH1Multipliers", "Mamba1Config", "MambaConfig", "jamba_raw", "mamba1_fields", "mamba1_raw", "falcon_h1_multipliers", "falcon_h1_raw", "mamba2_raw",
           "mamba_fields", "nemotron_h_raw", "recurrent_raw", "state_bytes_per_slot"]
