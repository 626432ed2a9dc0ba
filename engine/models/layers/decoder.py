"""The generic decoder: attention, gated MLP, the layer and the stack that the Llama family
(Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2) and the mixture-of-experts models built
on it (Mixtral, Qwen2-MoE, Qwen3-MoE: see ``moe``) share, and that Gemma, LLaVA and Qwen-VL
build on.

The variations are switches on :class:`ModelConfig`: Qwen2 has q/k/v biases
(``attention_bias``), Qwen3 normalises each head of q and k before RoPE (``qk_norm``) and
may set ``head_dim`` apart from ``hidden_size / heads``, SmolLM2 and small Qwen2 tie the
LM head to the embedding, Phi-3 stores q/k/v and gate/up fused, Mistral and Qwen2 may slide
a window over some layers (``ModelConfig.layer_windows``), SmolLM3 leaves RoPE out of
some (``nope_layers``), Phi-4-mini rotates part of each head (``rotary_dim``), Granite
scales by its multipliers (``embedding_multiplier``, ``residual_multiplier``,
``attention_multiplier``, ``logits_scaling``). Weights arrive under Hugging
Face names; q/k/v and gate/up are concatenated once at build time so a layer runs two
fused matmuls instead of five.

A forward pass takes a flat varlen batch (every request's new tokens back to back) and
the paged KV cache; all kernels come from the ``Ops`` object given to the constructor.
Small CPU steps run every layer in one C call (``engine/ops/cpu/fused.py``), which is
handed :meth:`Decoder.fused_description`, not the model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers.linear import Linear, embed, make_linear
from engine.models.layers.lora import LoraLinear, LoraSlots
from engine.models.layers.mamba import mamba_weight_names
from engine.models.layers.moe import SparseMoeBlock, sparse_layer_weight_names
from engine.models.layers.norm import head_norm
from engine.models.layers.rope import rope_cos_sin_cache
from engine.models.layers.shard import (
    ShardedWeights,
    check_tensor_parallel,
    local_heads,
    qkv_spans,
    vocab_range,
)
from engine.models.lora import check_lora_model
from engine.ops import AttentionMetadata, Ops
from engine.ops.cpu import fused as fused_decode
from engine.ops.cpu.fused_spec import FusedLayer, FusedModel
from engine.parallel import SINGLE, TensorParallel

# The norms of a decoder layer, in checkpoint order (Gemma adds two around its MLP).
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def decoder_weight_names(config: ModelConfig, layer_norms: tuple[str, ...] = LAYER_NORMS) -> list[str]:
    """The Hugging Face tensor names of the decoder ``config`` describes, in checkpoint
    order (a vision model's tower comes on top: its family adds it)."""
    names = ["model.embed_tokens.weight"]
    fused = config.architecture == "phi3"  # qkv_proj and gate_up_proj, as Phi-3 ships them
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + norm + ".weight" for norm in layer_norms]
        if config.mamba is not None and i in config.mamba.layers:  # Granite 4's Mamba-2 mixer
            names += mamba_weight_names(config.mamba, p)
        elif fused:
            names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"]
        else:
            names += [
                p + f"self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
            ]
        if config.attention_bias and not (config.mamba is not None and i in config.mamba.layers):
            names += [p + f"self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")]
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config.moe is not None and i in config.moe.sparse_layers:
            names += sparse_layer_weight_names(config.moe, i)
        if config.architecture == "granite_hybrid":  # Granite 4's shared_mlp, gate/up fused (beside any experts)
            names += [p + "shared_mlp.input_linear.weight", p + "shared_mlp.output_linear.weight"]
        elif config.moe is not None and i in config.moe.sparse_layers:
            pass
        elif fused:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
        else:
            names += [p + f"mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
    names.append("model.norm.weight")
    if config.seq_classifier and config.classifier_from_tokens is None:
        names.append("score.weight")  # a *ForSequenceClassification checkpoint has no LM head
    elif not config.tie_word_embeddings and not config.base_model:
        names.append("lm_head.weight")
    return names


@dataclasses.dataclass(slots=True)
class DecoderLayer:
    """One layer's weights: its norms, projections, sliding window and RoPE table."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Any  # Linear | QuantLinear: [(H + 2 * Hkv) * D, hidden], with q/k/v biases if any
    o_proj: Any
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up: Any  # Linear | QuantLinear [2 * intermediate, hidden]; None in a sparse (MoE) layer
    down: Any
    window: int  # sliding window (last N positions), 0 for full attention
    rope: torch.Tensor | None  # this layer's cos/sin table (shared by layers with the same RoPE); None: no RoPE
    # The routed-expert MLP of a sparse layer (keyword-only, so subclasses may add fields).
    moe: SparseMoeBlock | None = dataclasses.field(default=None, kw_only=True)


class Decoder:
    """The decoder stack plus LM head, over weights given under Hugging Face names.

    With ``tp`` of ``N > 1`` ranks this is rank ``tp.rank``'s slice of every layer (see
    :mod:`engine.models.layers.shard`): its query and KV heads, its share of the MLP and of
    the vocabulary; :meth:`forward` all-reduces after o and down (the residual stream is
    whole on every rank) and :meth:`compute_logits` returns the gathered full-vocabulary
    logits.
    """

    # The fused CPU decode step's plans over the KV pools this model has run over (made on
    # the first small step; see plan_fused_step).
    _fused: fused_decode.Planner | None = None
    # LoRA adapter slots beside the projections (enable_lora); None: the base model only.
    lora: LoraSlots | None = None

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        """The checkpoint tensors a model of ``config`` reads, in checkpoint order."""
        return decoder_weight_names(config)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A stored tensor's name under the names :meth:`weight_names` gives (a vision
        model's checkpoints nest the decoder; a text decoder's are those already)."""
        return name

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
        # Gemma 2 soft-caps attention scores; the Llama family does not.
        self._init_common(config, ops, dtype, device, tp, scale=config.attention_multiplier or config.head_dim**-0.5)
        self.cos_sin_cache = rope_cos_sin_cache(config, dtype, self.device)
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: get("model.norm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _init_common(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device | str,
                     tp: TensorParallel, *, scale: float, softcap: float = 0.0) -> None:
        """What every family's constructor sets alike: the config, op set, dtype and device,
        this rank's share (:meth:`_init_parallel`), the attention scale and soft-cap, the
        norms' eps."""
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        self._init_parallel(config, tp)
        self.head_dim = config.head_dim
        self.scale = scale
        self.attn_softcap = softcap
        self.eps = config.rms_norm_eps

    def _init_rope_tables(self) -> None:
        """The cos/sin table of the full-attention layers and, where the config gives the
        sliding layers a base of their own (Gemma 3, OLMo 3), theirs (else the same one)."""
        config = self.config
        self.cos_sin_cache = rope_cos_sin_cache(config, self.dtype, self.device)
        self.local_cos_sin_cache = (
            rope_cos_sin_cache(config, self.dtype, self.device, local=True)
            if config.rope_local_theta is not None
            else self.cos_sin_cache
        )

    def _hidden_stream_in(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          scale: torch.Tensor | None = None,
                          mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Where a step of a family whose stream is the hidden states alone (Gemma, OLMo)
        starts: the token embeddings (times ``scale``; ``mm_embeds`` ``(rows, embeddings)``
        in place of those rows, as :meth:`forward` takes them) on the first pipeline stage,
        the previous stage's hidden states on a later one."""
        stage = self.tp.stage
        if stage.first:
            hidden = self._embed(input_ids)
            hidden = hidden if scale is None else hidden * scale
            if mm_embeds is not None:
                rows, values = mm_embeds
                hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
            return hidden
        (hidden,) = stage.recv(1, (positions.shape[-1], self.config.hidden_size), self.dtype, self.device)
        return hidden

    def _run_stream(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    block: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                    final: Callable[[torch.Tensor], torch.Tensor],
                    fused: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """A step of a family whose stream is the hidden states alone (OLMo, gpt-oss,
        DeepSeek, GLM-4, Cohere, the LayerNorm families): :meth:`_hidden_stream_in` (with
        ``mm_embeds``: prompt_embeds' rows), then ``fused(hidden)`` where it answers (the
        fused CPU step; not over pipeline stages, nor with ``mm_embeds``, as
        :meth:`forward`), else ``hidden = block(layer, hidden, k_cache, v_cache)`` for each
        of this stage's layers, then ``final(hidden)`` on the last stage; a stage before
        it sends its hidden states on and returns None."""
        stage = self.tp.stage
        hidden = self._hidden_stream_in(input_ids, positions, mm_embeds=mm_embeds)
        if fused is not None and not stage.enabled and mm_embeds is None:
            out = fused(hidden)
            if out is not None:
                return out
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = block(layer, hidden, k_cache, v_cache)
        if not stage.last:
            stage.send([hidden])
            return None
        return final(hidden)

    def _plain_layer_parts(self, get: ShardedWeights, i: int) -> dict[str, Any]:
        """Layer ``i``'s projections with no bias (q/k/v fused, gate/up fused, this rank's
        share of each), its window and RoPE table (a sliding layer's own where the config
        gives one): the fields Gemma's and OLMo's layers take as they are."""
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        _, spans = qkv_spans(self.config, self.tp)
        window = self.config.layer_windows[i]
        return dict(
            qkv=make_linear([get.rows(attn + f"{n}_proj.weight", spans=[span]) for n, span in zip("qkv", spans, strict=True)]),
            o_proj=get.row_parallel(attn + "o_proj.weight"),
            gate_up=make_linear([get.rows(mlp + "gate_proj.weight"), get.rows(mlp + "up_proj.weight")]),
            down=get.row_parallel(mlp + "down_proj.weight"),
            window=window,
            rope=self.local_cos_sin_cache if window else self.cos_sin_cache,
        )

    def _build_ends(self, get: ShardedWeights, weights: Any, final_norm: Any) -> None:
        """The embedding (first pipeline stage), the final norm and the LM head (last
        stage; a tied head reads the embedding there too). A stage reads nothing else of
        the checkpoint but its layers. A quantized table stays one copy: rows read for the
        embedding, the same blocks multiplied for a tied head."""
        stage = self.tp.stage
        tied = self.config.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed = (get.rows("model.embed_tokens.weight")
                      if stage.first or (stage.last and tied) else None)
        self.norm = final_norm() if stage.last else None
        self.lm_head = None
        if stage.last:
            self.lm_head = make_linear([self.embed] if tied else [get.rows("lm_head.weight")])
        self.score = self._score_head(get, tied) if self.config.seq_classifier and stage.last else None

    def _score_head(self, get: ShardedWeights, tied: bool) -> Linear:
        """A sequence classifier's head [num_labels, hidden], whole on every rank: the
        checkpoint's ``score``, or for a causal LM converted by its two tokens the true
        token's LM-head row less the false one's (in the dtype, as vLLM builds it)."""
        ids = self.config.classifier_token_ids
        if self.config.classifier_from_tokens is None:
            return Linear(get("score.weight"))
        assert ids is not None  # the loader reads them from the tokenizer
        table = get("model.embed_tokens.weight" if tied else "lm_head.weight")
        if not isinstance(table, torch.Tensor):
            raise UnsupportedModelError("classifier_from_token needs the LM head's rows dense; "
                                        "this one is kept in quantized blocks (--quantization none)")
        false, true = ids
        return Linear((table[true] - table[false]).unsqueeze(0).contiguous())

    def enable_lora(self, *, max_loras: int, max_rank: int, dtype: torch.dtype) -> LoraSlots:
        """Wrap every projection adapters may target (engine.models.lora) with ``max_loras``
        preallocated adapter slots of rank up to ``max_rank`` in ``dtype``; returns them."""
        check_lora_model(self.config)
        # A tensor-parallel rank's slots hold its cut of each adapter, a pipeline stage's
        # its layers' (engine.models.layers.lora).
        self.lora = LoraSlots(self.config, self.layers, self.ops, max_loras=max_loras, max_rank=max_rank,
                              dtype=dtype, device=self.device, tp=self.tp)
        self._fused = None  # planned again, with the slots
        return self.lora

    def _init_parallel(self, config: ModelConfig, tp: TensorParallel) -> None:
        """This rank's head counts and vocabulary slice; refuses a model that does not
        split over ``tp.world_size`` ranks."""
        check_tensor_parallel(config, tp)
        self.tp = tp
        self.num_heads, self.num_kv_heads = local_heads(config, tp)
        self.vocab_start, self.vocab_end = vocab_range(config, tp)

    def _layer(self, get: ShardedWeights, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        bias = None
        moe = self.config.moe
        sparse = moe is not None and i in moe.sparse_layers
        sizes, spans = qkv_spans(self.config, self.tp)
        if self.config.attention_bias:
            bias = torch.cat([get.rows(attn + f"{n}_proj.bias", spans=[span]) for n, span in zip("qkv", spans, strict=True)])
        gate_up: list | None = None
        inter = self.config.intermediate_size
        if self.config.architecture == "phi3":
            # Phi-3 ships q/k/v and gate/up already fused, in the order used here; each
            # part is cut to this rank's share and the cuts are fused again.
            qkv = [get.rows(attn + "qkv_proj.weight", sizes, spans)]
            gate_up = [get.rows(mlp + "gate_up_proj.weight", (inter, inter))]
        else:
            qkv = [get.rows(attn + f"{n}_proj.weight", spans=[span]) for n, span in zip("qkv", spans, strict=True)]
            if self.config.architecture == "granite_hybrid":  # [gate; up] in one, as Phi-3's
                gate_up = [get.rows(p + "shared_mlp.input_linear.weight", (inter, inter))]
            elif self.config.architecture == "glm4":  # GLM-4's gate_up_proj, as Phi-3's
                gate_up = [get.rows(mlp + "gate_up_proj.weight", (inter, inter))]
            elif not sparse:
                gate_up = [get.rows(mlp + "gate_proj.weight"), get.rows(mlp + "up_proj.weight")]
        # make_linear: a dense Linear over the parts concatenated, or a QuantLinear over
        # weights kept in their GGUF blocks.
        return DecoderLayer(
            input_norm=get(p + "input_layernorm.weight"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            qkv=make_linear(qkv, bias),
            o_proj=get.row_parallel(attn + "o_proj.weight"),
            q_norm=get(attn + "q_norm.weight") if self.config.qk_norm else None,
            k_norm=get(attn + "k_norm.weight") if self.config.qk_norm else None,
            gate_up=None if gate_up is None else make_linear(gate_up),
            down=None if sparse else get.row_parallel(
                p + "shared_mlp.output_linear.weight" if self.config.architecture == "granite_hybrid"
                else mlp + "down_proj.weight"),
            window=self.config.layer_windows[i],
            rope=None if i in self.config.nope_layers else self.cos_sin_cache,
            moe=SparseMoeBlock(self.config, i, get, Linear, self.tp) if sparse else None,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V.

        ``mm_embeds`` ``(rows [R] int64, embeddings [R, hidden])`` replace the token
        embeddings of those rows (a vision model's image placeholders)."""
        stage = self.tp.stage
        if stage.first:
            hidden = self._embed(input_ids)
            if self.config.embedding_multiplier != 1.0:  # Granite's, in the dtype as transformers
                hidden = hidden * self.config.embedding_multiplier
            return self._decode(hidden, positions, meta, kv_caches, mm_embeds)
        # A later pipeline stage: the previous stage's hidden states and residual stream.
        hidden, residual = stage.recv(2, (positions.shape[-1], self.config.hidden_size),
                                      self.dtype, self.device)
        return self._decode(hidden, positions, meta, kv_caches, residual=residual)

    def _decode(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        layer_adds: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor | None:
        """:meth:`forward` from the token embeddings ``hidden`` [T, hidden]. ``rope``: a
        table every layer rotates by this step instead of its own (row ``positions[i]`` for
        token ``i``; Qwen-VL's per-token M-RoPE rows). ``layer_adds[i]``: ``(rows,
        values)`` added to those rows of the hidden states after layer ``i`` (Qwen3-VL's
        DeepStack). A later pipeline stage passes the ``residual`` stream it received; a
        stage before the last sends its hidden states and residual on and returns None."""
        ops = self.ops
        stage = self.tp.stage
        if mm_embeds is not None:
            rows, values = mm_embeds
            hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
        elif not stage.enabled:
            # The fused step runs every layer and the final norm in one call: a stage's
            # share of the layers is not a step it knows.
            out = self._run_fused(hidden, positions, meta, kv_caches, rope)
            if out is not None:
                return out
        scaled = self._scaled_block_output
        adds = layer_adds or ()
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, self.eps)
            else:
                x, residual = ops.fused_add_rms_norm(scaled(hidden), residual, layer.input_norm, self.eps)
            attn = self._attention(layer, x, positions, meta, k_cache, v_cache, rope)
            x, residual = ops.fused_add_rms_norm(scaled(attn), residual, layer.post_norm, self.eps)
            hidden = self._mlp(layer, x)
            if i < len(adds):  # the layer's output is hidden + residual: add to either
                rows, values = adds[i]
                hidden = hidden.index_add(0, rows, values.to(hidden.dtype))
        assert residual is not None  # num_hidden_layers >= 1 is checked at build time
        if not stage.last:
            stage.send([hidden, residual])
            return None
        out, _ = ops.fused_add_rms_norm(scaled(hidden), residual, self.norm, self.eps)
        return out

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """A layer's MLP (its routed experts in a sparse layer), whole on every rank."""
        if layer.moe is not None:
            return self.tp.all_reduce(layer.moe(x, self.ops))  # the experts' row-parallel downs
        assert layer.gate_up is not None and layer.down is not None
        return layer.down(self.ops.silu_and_mul(layer.gate_up(x)))  # row-parallel: whole

    def _scaled_block_output(self, x: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream: times Granite's
        residual_multiplier (rounded to the dtype first, as transformers), else as it is."""
        m = self.config.residual_multiplier
        return x if m == 1.0 else x * m

    def _attention(
        self,
        layer: DecoderLayer,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ops = self.ops
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = self._head_norm(q, layer.q_norm)
            k = self._head_norm(k, layer.k_norm)
        table = layer.rope if rope is None else rope
        if table is not None:  # None: positions are learned embeddings (layers/absolute.py)
            q, k = ops.rotary_embedding(positions, q, k, table)
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = self._attend(layer, q, k_cache, v_cache, meta)
        return layer.o_proj(o.reshape(t, h * d))  # row-parallel: the whole output on every rank

    def _attend(self, layer: DecoderLayer, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention of this step's queries [T, heads, D] over the paged cache (their
        own K/V written already): causal, within the layer's window."""
        if meta.decode_only:
            return self.ops.paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                meta.seq_lens_host, window=layer.window, softcap=self.attn_softcap,
            )
        return self.ops.paged_attention_prefill(
            q, k_cache, v_cache, meta, self.scale, window=layer.window, softcap=self.attn_softcap
        )

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return head_norm(self.ops, x, weight, self.eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden]. Vocab-parallel: each rank looks up the ids of
        its slice (the others read row 0 and are zeroed), and the ranks' rows are summed."""
        if not self.tp.enabled:
            return embed(self.embed, input_ids, self.dtype)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_end - self.vocab_start)
        rows = embed(self.embed, torch.where(mine, local, 0), self.dtype)
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        return self.tp.all_reduce(rows)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [N, vocab] in the model dtype: this rank's slice of the
        LM head, gathered from every rank in vocabulary order."""
        return self.tp.all_gather_last(self.lm_head(hidden))

    @torch.inference_mode()
    def classify(self, last_rows: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's logits [B, num_labels] (fp32) from each sequence's last
        final-norm row (transformers' *ForSequenceClassification pools the same row)."""
        assert self.score is not None  # config.seq_classifier only
        return self.score(last_rows).float()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for the rows of ``hidden`` [N, hidden] (Granite's
        divided by its logits_scaling in the model dtype, as transformers)."""
        if self.config.logits_scaling != 1.0:
            return (self._logits(hidden) / self.config.logits_scaling).float()
        if not self.tp.enabled:
            # A quantized head on CPU writes the widened logits itself (the same values as
            # its bf16 output then ``.float()``, without a second pass over the vocabulary).
            widened = getattr(self.lm_head, "widened", None)
            logits = None if widened is None else widened(hidden)
            if logits is not None:
                return logits
        return self._logits(hidden).float()

    # -- the fused CPU decode step -------------------------------------------------------

    def _run_fused(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Small steps on CPU (decode rows, speculative verification chunks): every layer
        in one C call (ops/cpu/fused.py says which models and steps it covers); None where
        the step is not the fused step's, and the layers run one by one."""
        if hidden.shape[0] > fused_decode.MAX_TOKENS:
            return None
        step = self.plan_fused_step(kv_caches)
        if step is None:
            return None
        # A step with adapter tokens: their deltas go on inside the step, after each
        # targeted projection.
        return step.run(hidden, positions, meta, rope=rope, lora=None if self.lora is None else self.lora.segments)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> fused_decode.FusedDecode | None:
        """The fused CPU decode step of this model over ``kv_caches`` (planned once per KV
        pool), or None where it does not apply."""
        if self._fused is None:
            self._fused = fused_decode.Planner(self.fused_description())
        return self._fused.plan(kv_caches)

    @property
    def fused_step(self) -> fused_decode.FusedDecode | None:
        """The fused step last planned (its ``steps`` count the steps it ran), or None."""
        return None if self._fused is None else self._fused.step

    def fused_description(self) -> FusedModel:
        """This decoder as the fused CPU decode step reads it (engine/ops/cpu/fused_spec.py)."""
        return FusedModel(
            dtype=self.dtype, device=self.device, ops=self.ops, tensor_parallel=self.tp.enabled,
            hidden=self.config.hidden_size, heads=self.num_heads, kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, eps=self.eps, scale=self.scale, softcap=self.attn_softcap,
            gemma=False, final_norm=self.norm, layers=tuple(map(self._fused_layer, self.layers)),
            residual_scale=self.config.residual_multiplier,
        )

    def _fused_layer(self, layer: DecoderLayer) -> FusedLayer:
        def describe(lin):
            return None if lin is None else lin.describe()

        def adapter(lin):  # a LoraLinear's slots (with --enable-lora), else None
            return lin.describe_lora() if isinstance(lin, LoraLinear) else None

        return FusedLayer(
            input_norm=layer.input_norm, post_norm=layer.post_norm, q_norm=layer.q_norm, k_norm=layer.k_norm,
            qkv=describe(layer.qkv), o=describe(layer.o_proj), gate_up=describe(layer.gate_up),
            down=describe(layer.down), rope=layer.rope, window=layer.window,
            external_mlp=None if layer.moe is None else functools.partial(layer.moe, ops=self.ops),
            lora_qkv=adapter(layer.qkv), lora_o=adapter(layer.o_proj), lora_gate_up=adapter(layer.gate_up),
            lora_down=adapter(layer.down),
        )


__all__ = ["LAYER_NORMS", "Decoder", "DecoderLayer", "decoder_weight_names"]
