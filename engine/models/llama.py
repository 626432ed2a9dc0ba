"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2, Qwen3 and SmolLM2.

The variations are switches on :class:`ModelConfig`: Qwen2 has q/k/v biases
(``attention_bias``), Qwen3 normalises each head of q and k before RoPE (``qk_norm``) and
may set ``head_dim`` apart from ``hidden_size / heads``, SmolLM2 and small Qwen2 tie the
LM head to the embedding. Weights arrive under Hugging Face names; q/k/v and gate/up are
concatenated once at build time so a layer runs two fused matmuls instead of five.

A forward pass takes a flat varlen batch (every request's new tokens back to back) and
the paged KV cache; all kernels come from the ``Ops`` object given to the constructor.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.config import ModelConfig
from engine.ops import AttentionMetadata, Ops


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with the config's rope scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
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


def rope_cos_sin_cache(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[max_pos, head_dim]: cos of every (position, frequency) then sin, cast to ``dtype``.

    Computed in fp32 and cast once, as HF does per call, so both round identically.
    """
    inv_freq = rope_inv_freq(config)
    t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)


class Linear:
    """``y = x @ weight.T (+ bias)`` for one weight, packed once where that pays.

    On CPU, torch's plain ``F.linear`` reorders the weight into the GEMM library's blocked
    layout on every call. Packing it once at build time into oneDNN's layout (the kernels
    ``torch.compile`` uses on CPU) saves that. bf16/fp16 results are bitwise equal to
    ``F.linear``'s. fp32 goes through oneDNN too rather than MKL (which ``F.linear`` calls):
    on an AMD EPYC dev machine MKL's fp32 GEMM ran at half oneDNN's speed (SmolLM2 decode
    23 vs 47 tok/s at batch 1, 245 vs 551 at batch 32), at the price of fp32 results that
    differ from ``F.linear`` in the last bits (summation order). The packed path is checked
    against ``F.linear`` once at build time and dropped if this torch lacks it or
    disagrees. The plain weight stays too: tied embeddings read it.
    """

    __slots__ = ("weight", "bias", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        self.weight = weight
        self.bias = bias
        self._packed: torch.Tensor | None = None
        if pack and weight.device.type == "cpu":
            self._pack()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _pack(self) -> None:
        w = self.weight
        if not _mkldnn_supports(w.dtype):
            return
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH)
            probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
            if not torch.allclose(self(probe).float(), F.linear(probe, w, self.bias).float(), rtol=1e-2, atol=1e-2):
                raise RuntimeError("packed linear disagrees with F.linear")
        except (RuntimeError, AttributeError):
            self._packed = None


# The batch size oneDNN tunes its packed layout for; any batch works.
_PACK_BATCH = 32


def _mkldnn_supports(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    check = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else torch.ops.mkldnn._is_mkldnn_fp16_supported
    return bool(check())


@dataclasses.dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear  # [(H + 2 * Hkv) * D, hidden], with q/k/v biases when the model has them
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


class LlamaModel:
    """The decoder stack plus LM head, over weights given under Hugging Face names."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: Ops,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        get = _Weights(weights, dtype, self.device)
        self.embed = get("model.embed_tokens.weight")
        self.layers = [self._layer(get, i) for i in range(config.num_hidden_layers)]
        self.norm = get("model.norm.weight")
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = Linear(self.embed)
        else:
            self.lm_head = Linear(get("lm_head.weight"))
        self.cos_sin_cache = rope_cos_sin_cache(config, dtype, self.device)

    def _layer(self, get: _Weights, i: int) -> _Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"])
        return _Layer(
            input_norm=get(p + "input_layernorm.weight"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            qkv=Linear(torch.cat([get(attn + f"{n}_proj.weight") for n in "qkv"]), bias),
            o_proj=Linear(get(attn + "o_proj.weight")),
            q_norm=get(attn + "q_norm.weight") if self.config.qk_norm else None,
            k_norm=get(attn + "k_norm.weight") if self.config.qk_norm else None,
            gate_up=Linear(torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")])),
            down=Linear(get(mlp + "down_proj.weight")),
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V."""
        ops = self.ops
        hidden = F.embedding(input_ids, self.embed)
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, self.eps)
            else:
                x, residual = ops.fused_add_rms_norm(hidden, residual, layer.input_norm, self.eps)
            attn = self._attention(layer, x, positions, meta, k_cache, v_cache)
            x, residual = ops.fused_add_rms_norm(attn, residual, layer.post_norm, self.eps)
            hidden = layer.down(ops.silu_and_mul(layer.gate_up(x)))
        assert residual is not None  # num_hidden_layers >= 1 is checked at build time
        out, _ = ops.fused_add_rms_norm(hidden, residual, self.norm, self.eps)
        return out

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        ops = self.ops
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = ops.rms_norm(q, layer.q_norm, self.eps)
            k = ops.rms_norm(k, layer.k_norm, self.eps)
        q, k = ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            o = ops.paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                meta.seq_lens_host,
            )
        else:
            o = ops.paged_attention_prefill(q, k_cache, v_cache, meta, self.scale)
        return layer.o_proj(o.reshape(t, h * d))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for the rows of ``hidden`` [N, hidden]."""
        return self.lm_head(hidden).float()


class _Weights:
    """Fetches a weight by HF name, cast to the model dtype and device; names a missing one."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.weights, self.dtype, self.device = weights, dtype, device

    def __call__(self, name: str) -> torch.Tensor:
        try:
            w = self.weights[name]
        except KeyError:
            raise CorruptModelError(f"weight {name!r} is missing from the checkpoint") from None
        return w.to(device=self.device, dtype=self.dtype).contiguous()


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    ops: Ops,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """Build the decoder for ``config``; raises a typed error for an unusable config."""
    if config.num_hidden_layers < 1:
        raise CorruptModelError("config.json: num_hidden_layers must be at least 1")
    if config.num_attention_heads % config.num_key_value_heads:
        raise CorruptModelError(
            f"config.json: num_attention_heads ({config.num_attention_heads}) is not a multiple "
            f"of num_key_value_heads ({config.num_key_value_heads})"
        )
    return LlamaModel(config, weights, ops, dtype=dtype, device=device)
