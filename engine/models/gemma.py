"""Gemma, Gemma 2 and Gemma 3 (text): the Llama decoder's attention with Gemma's layer
around it.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`, the
Llama family's), each as transformers computes it:

* RMSNorms ``x / rms(x) * (1 + weight)`` computed in fp32 and rounded once (Llama rounds
  ``x / rms(x)`` first, then multiplies by a weight stored without the 1). Gemma 1 has
  Llama's two a layer (before attention, before the MLP); Gemma 2 and 3 four: before and
  after attention, before and after the MLP (the "sandwich");
* the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
* embeddings are scaled by ``sqrt(hidden_size)`` (rounded to the model dtype first);
* attention scale ``query_pre_attn_scalar ** -0.5`` (Gemma 1: ``head_dim ** -0.5``); Gemma 2 soft-caps attention scores
  (``attn_logit_softcapping``) and final logits (``final_logit_softcapping``);
* local (sliding-window) and global layers alternate (``ModelConfig.layer_windows``);
  Gemma 3's local layers rotate with their own base (``rope_local_base_freq``, no scaling)
  and it normalises each head of q and k before RoPE (with the same ``1 + weight`` norm).

Projections, the embedding and the (tied) head go through the same quantization-aware
helpers as the Llama decoder (:mod:`engine.models.layers.linear`), so a GGUF's blocks are
kept.

Gemma 3 with its vision tower (``Gemma3ForConditionalGeneration``, 4B to 27B:
:class:`Gemma3VisionModel`): a SigLIP encoder, a projector that pools its patches, and the
Gemma 3 decoder, whose image tokens attend to each other both ways. What transformers
computes, and this module with it:

* the tower is SigLIP whole: every layer, then its ``post_layernorm``
  (:class:`Gemma3VisionTower`, on :class:`~engine.models.layers.vision_tower.ViTEncoder`);
* the projector averages the patch grid (64 x 64 at 896 pixels) down to
  ``mm_tokens_per_image`` cells (16 x 16), norms each with Gemma's ``1 + w`` RMSNorm in
  fp32 and multiplies it by ``mm_input_projection_weight`` [vision hidden, text hidden];
* the decoder's embeddings are scaled by ``sqrt(hidden)`` and then the image rows are
  replaced by the projector's output, unscaled;
* in a prefill, each query among an image's placeholders sees every placeholder of that
  image, the later ones included, on full and sliding layers alike (transformers' block
  mask: ``or(causal, same image)``, and on sliding layers ``and`` the window). The causal
  attention runs first for the whole step; the rows of each image are then attended
  again over their request's keys up to the image's end
  (:func:`engine.ops.reference.paged_attention_block`). Decode steps are causal.

An image's placeholders must be prefilled in one chunk (the scheduler keeps them together:
``SchedulerConfig.whole_images``), since the first of them reads the last's keys.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.decoder import LAYER_NORMS, Decoder, DecoderLayer, decoder_weight_names
from engine.models.layers.norm import gemma_norm_weight, gemma_rms_norm
from engine.models.layers.shard import ShardedWeights
from engine.models.layers.vision_tower import TOWER, ViTEncoder
from engine.models.vision_config import Gemma3VisionConfig
from engine.ops import AttentionMetadata, Ops
from engine.ops.cpu.fused_spec import FusedLayer, FusedModel
from engine.ops.reference import paged_attention_block
from engine.parallel import SINGLE, TensorParallel

# Gemma's sandwich: a norm before and after the MLP too.
GEMMA_LAYER_NORMS = (*LAYER_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclasses.dataclass(slots=True)
class GemmaLayer(DecoderLayer):
    # input_norm: before attention; post_norm: after it (Gemma 2/3's post_attention_layernorm;
    # None in Gemma 1, which adds attention's output as it is).
    pre_ffn_norm: torch.Tensor  # before the MLP (Gemma 1's post_attention_layernorm)
    post_ffn_norm: torch.Tensor | None  # after it; None in Gemma 1


class GemmaModel(Decoder):
    """Gemma / Gemma 2 / Gemma 3 decoder stack plus (tied) LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        return decoder_weight_names(config, LAYER_NORMS if config.architecture == "gemma" else GEMMA_LAYER_NORMS)

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: Ops,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        assert config.query_pre_attn_scalar is not None  # from_hf requires it for Gemma
        self._init_common(config, ops, dtype, device, tp, scale=config.query_pre_attn_scalar**-0.5,
                          softcap=config.attn_logit_softcapping)
        self._init_rope_tables()
        # transformers: Gemma 2 builds the scale in the model dtype, Gemma 3 in fp32 and
        # casts it; both round sqrt(hidden) to the dtype before the multiply.
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: self._norm_weight(weights, "model.norm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _norm_weight(self, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return gemma_norm_weight(weights, name, self.device)

    def _layer(self, get: ShardedWeights, i: int) -> GemmaLayer:  # type: ignore[override]
        p = f"model.layers.{i}."
        norm = lambda name: self._norm_weight(get.weights, p + name)  # noqa: E731
        qk_norm = self.config.qk_norm
        sandwich = self.config.architecture != "gemma"
        return GemmaLayer(
            input_norm=norm("input_layernorm.weight"),
            post_norm=norm("post_attention_layernorm.weight") if sandwich else None,
            pre_ffn_norm=norm("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
            post_ffn_norm=norm("post_feedforward_layernorm.weight") if sandwich else None,
            q_norm=norm("self_attn.q_norm.weight") if qk_norm else None,
            k_norm=norm("self_attn.k_norm.weight") if qk_norm else None,
            **self._plain_layer_parts(get, i),
        )

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._rms(x, weight)

    def _attend(self, layer: DecoderLayer, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention, or for a bidirectional model (EmbeddingGemma) each request's
        whole prompt attending to all of itself (a sliding layer within the window either
        side); the scheduler gives such a model whole prompts only, uncached."""
        if not self.config.bidirectional:
            return super()._attend(layer, q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        row = 0
        for b, (n, context) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            if n != context:
                raise ValueError(f"a bidirectional model's chunk must be its whole prompt: "
                                 f"{n} of {context} tokens")
            out[row:row + n] = paged_attention_block(
                q[row:row + n], k_cache, v_cache, meta.block_tables[b], 0, n, self.scale,
                window=layer.window, softcap=self.attn_softcap, symmetric=True)
            row += n
        return out

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """The fused decode step, which attends causally: none for a bidirectional model."""
        return None if self.config.bidirectional else super().plan_fused_step(kv_caches)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(self.ops, x, weight, self.eps)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V."""
        hidden = self._hidden_stream_in(input_ids, positions, self.embed_scale)
        if not self.tp.stage.enabled:
            out = self._run_fused(hidden, positions, meta, kv_caches)  # small CPU steps: one C call
            if out is not None:
                return out
        return self._run_layers(hidden, positions, meta, kv_caches)

    def _run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The layers one by one from the stream ``hidden``, then the final norm (or, on a
        pipeline stage before the last, the stream sent on and None)."""
        ops = self.ops
        stage = self.tp.stage
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, GemmaLayer)
            x = self._rms(hidden, layer.input_norm)
            x = self._attention(layer, x, positions, meta, k_cache, v_cache)
            hidden = hidden + (x if layer.post_norm is None else self._rms(x, layer.post_norm))
            x = self._rms(hidden, layer.pre_ffn_norm)
            x = layer.down(ops.gelu_tanh_and_mul(layer.gate_up(x)))  # row-parallel: the whole output
            hidden = hidden + (x if layer.post_ffn_norm is None else self._rms(x, layer.post_ffn_norm))
        if not stage.last:
            stage.send([hidden])
            return None  # type: ignore[return-value]
        return self._rms(hidden, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32, soft-capped (in the model dtype, as transformers; with
        tensor parallelism, on the gathered logits)."""
        logits = self._logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def fused_description(self) -> FusedModel:
        return dataclasses.replace(super().fused_description(), gemma=True, activation="gelu_tanh")

    def _fused_layer(self, layer: DecoderLayer) -> FusedLayer:
        assert isinstance(layer, GemmaLayer)
        return dataclasses.replace(super()._fused_layer(layer), pre_ffn_norm=layer.pre_ffn_norm,
                                   post_ffn_norm=layer.post_ffn_norm)


_PROJECTOR = "multi_modal_projector."


def gemma3_vision_weight_names(vision: Gemma3VisionConfig) -> list[str]:
    """The tower's, its post-norm's and the projector's tensors, under the engine's names."""
    names = [TOWER + "embeddings.patch_embedding.weight", TOWER + "embeddings.patch_embedding.bias",
             TOWER + "embeddings.position_embedding.weight"]
    for i in range(vision.tower.num_hidden_layers):
        p = f"{TOWER}encoder.layers.{i}."
        for part in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", "self_attn.q_proj",
                     "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"):
            names += [p + part + ".weight", p + part + ".bias"]
    names += [TOWER + "post_layernorm.weight", TOWER + "post_layernorm.bias",
              _PROJECTOR + "mm_soft_emb_norm.weight", _PROJECTOR + "mm_input_projection_weight"]
    return names


def gemma3_checkpoint_name(name: str) -> str:
    """A Gemma 3 checkpoint's tower and projector tensors under the engine's names
    (transformers 5 nests them under ``model.``, both drop SigLIP's ``vision_model.``)."""
    for old in ("model.vision_tower.", "model.multi_modal_projector."):
        if name.startswith(old):
            name = name[len("model."):]
            break
    return name.replace("vision_tower.vision_model.", TOWER, 1)


class Gemma3VisionTower(ViTEncoder):
    """SigLIP's every layer and post-norm, then Gemma 3's projector: pixels [N, C, H, W] ->
    [N, mm_tokens_per_image, text hidden] in the model dtype."""

    def __init__(self, vision: Gemma3VisionConfig, get: ShardedWeights, norm_weight: torch.Tensor) -> None:
        super().__init__(vision.tower, get, vision.tower.num_hidden_layers)
        self.gemma3 = vision
        self.post_norm = (get(TOWER + "post_layernorm.weight"), get(TOWER + "post_layernorm.bias"))
        self.soft_norm = (1.0 + norm_weight).contiguous()  # fp32, as transformers' Gemma3RMSNorm
        self.projection = get(_PROJECTOR + "mm_input_projection_weight")  # [vision hidden, text hidden]

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg, g3 = self.cfg, self.gemma3
        x = self.hidden_states(pixels)[-1]
        x = F.layer_norm(x, (cfg.hidden_size,), *self.post_norm, eps=cfg.layer_norm_eps)
        n, _, d = x.shape
        side = g3.patches_per_side
        grid = x.transpose(1, 2).reshape(n, d, side, side)
        pooled = F.avg_pool2d(grid, g3.pool, g3.pool).flatten(2).transpose(1, 2)  # [N, cells, D]
        xf = pooled.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.layer_norm_eps)
                  * self.soft_norm).to(pooled.dtype)
        return torch.matmul(normed, self.projection)


def image_blocks(rows: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> list[tuple[int, int, int, int, int]]:
    """The step's image placeholder rows as blocks ``(first row, end row, request, first
    position, end position)``: runs of consecutive rows of one request (two images of a
    request are apart by their boundary tokens)."""
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)
    at = rows.tolist()
    pos = positions.index_select(0, rows).tolist()
    blocks: list[tuple[int, int, int, int, int]] = []
    for i, (row, p) in enumerate(zip(at, pos, strict=True)):
        b = bisect.bisect_right(starts, row) - 1
        if i and row == at[i - 1] + 1 and b == blocks[-1][2]:
            r0, _, _, p0, _ = blocks[-1]
            blocks[-1] = (r0, row + 1, b, p0, p + 1)
        else:
            blocks.append((row, row + 1, b, p, p + 1))
    return blocks


class Gemma3VisionModel(GemmaModel):
    """The Gemma 3 decoder with its SigLIP tower; image placeholders' rows take the tower's
    output, and attend to their image's every placeholder."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        assert isinstance(config.vision, Gemma3VisionConfig)
        return GemmaModel.weight_names(config) + gemma3_vision_weight_names(config.vision)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return gemma3_checkpoint_name(name)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 tp: TensorParallel = SINGLE) -> None:
        # Over tensor-parallel ranks each holds the whole tower (it encodes every image of
        # a step, as the one rank would) and its share of the decoder's heads.
        super().__init__(config, weights, ops, dtype=dtype, device=device, tp=tp)
        assert isinstance(config.vision, Gemma3VisionConfig)
        norm = ShardedWeights(weights, torch.float32, self.device)(_PROJECTOR + "mm_soft_emb_norm.weight")
        self.vision = Gemma3VisionTower(config.vision, ShardedWeights(weights, dtype, self.device), norm)
        self._blocks: list[tuple[int, int, int, int, int]] = []

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] float pixels -> [N, mm_tokens_per_image, hidden] in the model dtype."""
        return self.vision(pixels.to(self.device))

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`GemmaModel.forward`; with ``mm_embeds`` ``(rows, embeddings)`` those rows'
        embeddings replaced (after the text's scaling) and each image's rows attended both
        ways within it."""
        if mm_embeds is None:
            return super().forward(input_ids, positions, meta, kv_caches)
        rows, values = mm_embeds
        hidden = self._hidden_stream_in(input_ids, positions, self.embed_scale)
        hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
        self._blocks = image_blocks(rows, positions, meta)
        try:
            return self._run_layers(hidden, positions, meta, kv_caches)
        finally:
            self._blocks = []

    def _attend(self, layer: DecoderLayer, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = super()._attend(layer, q, k_cache, v_cache, meta)
        for r0, r1, b, p0, p1 in self._blocks:
            out[r0:r1] = paged_attention_block(
                q[r0:r1], k_cache, v_cache, meta.block_tables[b], p0, p1, self.scale,
                window=layer.window, softcap=self.attn_softcap)
        return out


__all__ = ["GEMMA_LAYER_NORMS", "Gemma3VisionModel", "Gemma3VisionTower", "GemmaLayer", "GemmaModel",
           "gemma3_checkpoint_name", "gemma3_vision_weight_names", "image_blocks"]
