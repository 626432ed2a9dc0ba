"""Whisper (``WhisperForConditionalGeneration``): an audio encoder over the whole 30-second
window of log-mel frames, and GPT-2's decoder (:mod:`engine.models.layers.absolute`) with a
cross-attention to the encoder's states between each layer's attention and MLP::

    h = h + o(attn(ln1(h)))                          self-attention, paged KV as any decoder's
    h = h + o_x(softmax(q_x(ln_x(h)) K_x^T) V_x)     K_x, V_x: the clip's, one pair a layer
    h = h + fc2(gelu(fc1(ln2(h))))

A request's clip travels as an ``ImageInput`` of no placeholder tokens (offset 0, length
0); the runner asks :meth:`WhisperModel.encode_image_inputs` for the clip's cross-attention
keys and values once (the encoder's states, its final LayerNorm, then each layer's
``encoder_attn.k_proj`` / ``v_proj``: ``[layers, 2, heads, 1500, head_dim]``), keeps them
while the request lives, and passes each step's rows with their request's pair
(``cross``). Whisper's encoder, unlike Qwen2-Audio's, attends over the padding too
(transformers passes it no mask), so every clip runs the whole window.

Tensor names: ``model.encoder.*``, ``model.decoder.*`` and ``proj_out`` (tied to the
token table). The keys' projections have no bias; the layers read zeros in its place.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.audio_config import AudioConfig
from engine.models.config import ModelConfig
from engine.models.layers.absolute import (
    AbsoluteDecoder,
    AbsoluteLayer,
    AbsoluteNames,
    absolute_weight_names,
)
from engine.models.layers.audio_tower import AudioEncoder, encoder_weight_names
from engine.models.layers.linear import embed
from engine.models.layers.shard import ShardedWeights
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel

ENCODER = "model.encoder."
DECODER = "model.decoder.layers.{i}."
_CROSS = ("encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj", "encoder_attn.out_proj")
# A request's rows of a step and its clip's cross-attention keys and values.
CrossSpan = tuple[int, int, torch.Tensor]


class _ZeroKeyBias(Mapping):
    """The checkpoint's tensors, with zeros for each (absent) key projection's bias."""

    def __init__(self, weights: Mapping, config: ModelConfig) -> None:
        self._weights = weights
        self._zeros = {f"{DECODER.format(i=i)}{part}.k_proj.bias": config.hidden_size
                       for i in range(config.num_hidden_layers) for part in ("self_attn", "encoder_attn")}

    def __getitem__(self, name: str) -> Any:
        if name in self._zeros:
            return torch.zeros(self._zeros[name])
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter([*self._weights, *self._zeros])

    def __len__(self) -> int:
        return len(self._weights) + len(self._zeros)


class WhisperModel(AbsoluteDecoder):
    """Whisper's decoder with its cross-attention, and its audio encoder."""

    NAMES = AbsoluteNames(
        embed="model.decoder.embed_tokens",
        positions="model.decoder.embed_positions",
        layer=DECODER,
        attn_norm="self_attn_layer_norm",
        qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        o="self_attn.out_proj",
        mlp_norm="final_layer_norm",
        fc1="fc1",
        fc2="fc2",
        final_norm="model.decoder.layer_norm",
    )
    cross_attention = True  # the runner keeps each request's encoder output while it lives

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        assert isinstance(config.vision, AudioConfig)
        names = [n for n in absolute_weight_names(config, cls.NAMES) if not n.endswith("k_proj.bias")]
        for i in range(config.num_hidden_layers):
            p = DECODER.format(i=i)
            names += [p + "encoder_attn_layer_norm.weight", p + "encoder_attn_layer_norm.bias",
                      p + "encoder_attn.k_proj.weight"]
            for part in ("encoder_attn.q_proj", "encoder_attn.v_proj", "encoder_attn.out_proj"):
                names += [p + part + ".weight", p + part + ".bias"]
        return names + encoder_weight_names(config.vision, ENCODER)

    def __init__(self, config: ModelConfig, weights: Mapping, ops: Ops, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tp: TensorParallel = SINGLE) -> None:
        weights = _ZeroKeyBias(weights, config)
        super().__init__(config, weights, ops, dtype=dtype, device=device, tp=tp)
        assert isinstance(config.vision, AudioConfig)
        get = ShardedWeights(weights, dtype, self.device)
        self.encoder = AudioEncoder(config.vision, get, ENCODER)
        self.cross = []
        for i in range(config.num_hidden_layers):
            p = DECODER.format(i=i)
            q, k, v, o = ((get(p + n + ".weight"), get(p + n + ".bias")) for n in _CROSS)
            self.cross.append(((get(p + "encoder_attn_layer_norm.weight"),
                                get(p + "encoder_attn_layer_norm.bias")), q, k, v, o))

    def encode_image_inputs(self, clips: Sequence[Any]) -> list[torch.Tensor]:
        """``ImageInput``s of clips (``pixels``: the whole window's log-mel frames, float32
        ``(mel, frames)``) -> each clip's cross-attention keys and values,
        ``[layers, 2, heads, positions, head_dim]``."""
        heads, hd = self.config.num_attention_heads, self.config.head_dim
        out = []
        for clip in clips:
            features = torch.frombuffer(bytearray(clip.pixels), dtype=torch.float32).view(clip.shape)
            states = self.encoder.states(features.to(self.device), self.encoder.cfg.max_source_positions)
            states = F.layer_norm(states, (states.shape[-1],), *self.encoder.norm)
            n = states.shape[0]
            out.append(torch.stack([
                torch.stack([F.linear(states, k[0], k[1]).view(n, heads, hd).transpose(0, 1),
                             F.linear(states, v[0], v[1]).view(n, heads, hd).transpose(0, 1)])
                for _, _, k, v, _ in self.cross]).contiguous())
        return out

    def _cross_attend(self, i: int, x: torch.Tensor, cross: Sequence[CrossSpan]) -> torch.Tensor:
        """Layer ``i``'s cross-attention of the rows ``x`` (normed), each span against its
        clip's keys and values."""
        _, q_proj, _, _, o_proj = self.cross[i]
        heads, hd = self.config.num_attention_heads, self.config.head_dim
        q = F.linear(x, *q_proj)
        out = torch.empty_like(q)
        for r0, r1, kv in cross:
            qs = q[r0:r1].view(1, r1 - r0, heads, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0),
                                               scale=hd**-0.5)
            out[r0:r1] = o[0].transpose(0, 1).reshape(r1 - r0, heads * hd)
        return F.linear(out, *o_proj)

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        cross: Sequence[CrossSpan] = (),
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; every row belongs to a span of
        ``cross`` (its request's clip)."""
        hidden = self._embed(input_ids) + embed(self.positions, positions, self.dtype)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            assert isinstance(layer, AbsoluteLayer)
            x = self._ln(hidden, layer.input_norm, layer.input_norm_bias)
            hidden = hidden + (self._attention(layer, x, positions, meta, k_cache, v_cache) + layer.o_bias)
            hidden = hidden + self._cross_attend(i, self._ln(hidden, *self.cross[i][0]), cross)
            x = self._ln(hidden, layer.post_norm, layer.post_norm_bias)
            hidden = hidden + (layer.down(self.act(layer.gate_up(x))) + layer.down_bias)
        return self._ln(hidden, *self.norm)


__all__ = ["WhisperModel"]
