"""TII's Falcon-H1 (``FalconH1ForCausalLM``: Falcon-H1-0.5B to -34B, Falcon-H1R): in every
layer, attention and a Mamba-2 mixer read the same normed hidden states side by side and
their outputs are summed into the residual stream, then a SwiGLU MLP follows on a second
norm::

    x = rms_norm(h)
    h = h + mamba(x * ssm_in) * ssm_out + attention(x * attention_in) * attention_out
    h = h + down(up(y) * silu(gate(y) * mlp_gate)) * mlp_down,     y = rms_norm(h)

with muP multipliers (``ModelConfig.falcon_h1``) where transformers applies them:
the embeddings times ``embedding_multiplier``, the logits times ``lm_head_multiplier``,
in_proj's parts by ``ssm_multipliers`` (``MambaConfig.in_multipliers``). ``key_multiplier``
scales K before the scores, which is the attention scale times it.

A layer keeps both a KV cache and the Mamba states, so the runner sees two cache layers
for each (``mamba_config.falcon_h1_raw``): layer ``i``'s attention at ``2 i``, its mixer's
conv and SSM states at ``2 i + 1``. Everything the runner does for a hybrid model (a state
slot a request, their checkpoints for the prefix cache, preemption) then holds as for
Nemotron-H. Tensor-parallel ranks each keep their attention heads, their Mamba heads (and
their rows of in_proj's multipliers) and their share of the MLP; pipeline stages are
refused (a stage boundary could fall between a layer's two halves). The fused CPU decode
step does not run it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer
from engine.models.layers.linear import make_linear
from engine.models.layers.mamba import MambaMixer, mamba_weight_names
from engine.models.layers.shard import ShardedWeights, qkv_spans
from engine.models.mamba_config import FalconH1Multipliers
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel


@dataclasses.dataclass(slots=True)
class FalconH1Layer:
    """One layer: its attention (a DecoderLayer's projections and norms, the MLP's too)
    and its Mamba mixer."""

    attention: DecoderLayer
    mamba: MambaMixer


class FalconH1Model(Decoder):
    """Falcon-H1's decoder stack plus LM head (see the module docstring)."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        m = config.mamba
        assert m is not None  # mamba_fields always reads Falcon-H1's mixers
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers // 2):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "pre_ff_layernorm.weight"]
            names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
            names += [p + f"feed_forward.{n}_proj.weight" for n in ("gate", "up", "down")]
            names += mamba_weight_names(m, p)
        names.append("model.final_layernorm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

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
        assert config.falcon_h1 is not None and config.mamba is not None
        self.multipliers: FalconH1Multipliers = config.falcon_h1
        self._init_common(config, ops, dtype, device, tp, scale=config.head_dim**-0.5 * self.multipliers.key)
        self._init_rope_tables()
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: get("model.final_layernorm.weight"))
        # A pipeline stage holds whole layers (both cache layers of each: the stage's cache
        # layers are [2 a, 2 b), engine.process.parts cuts them so).
        stage = tp.stage.layer_range(config.num_hidden_layers)
        self.layers = [self._hybrid_layer(get, i) for i in range(stage.start // 2, stage.stop // 2)]

    def _hybrid_layer(self, get: ShardedWeights, i: int) -> FalconH1Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "feed_forward."
        _, spans = qkv_spans(self.config, self.tp)
        attention = DecoderLayer(
            input_norm=get(p + "input_layernorm.weight"),
            post_norm=get(p + "pre_ff_layernorm.weight"),
            qkv=make_linear([get.rows(attn + f"{n}_proj.weight", spans=[span])
                             for n, span in zip("qkv", spans, strict=True)]),
            o_proj=get.row_parallel(attn + "o_proj.weight"),
            q_norm=None, k_norm=None,
            gate_up=make_linear([get.rows(mlp + "gate_proj.weight"), get.rows(mlp + "up_proj.weight")]),
            down=get.row_parallel(mlp + "down_proj.weight"),
            window=0, rope=self.cos_sin_cache)
        mamba = self.config.mamba
        assert mamba is not None
        return FalconH1Layer(attention, MambaMixer.build(mamba, get, p, self.eps, make_linear, self.ops))

    def _falcon_mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """``down(up(x) * silu(gate(x) * mlp_gate)) * mlp_down``, as transformers."""
        m = self.multipliers
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        if m.mlp_gate != 1.0:
            gate = gate * m.mlp_gate
        out = layer.down(up * F.silu(gate))
        return out * m.mlp_down if m.mlp_down != 1.0 else out

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step runs no Mamba mixer."""
        return None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32: the head's times lm_head_multiplier in the model dtype."""
        if self.multipliers.lm_head == 1.0:
            return self._logits(hidden).float()
        return (self._logits(hidden) * self.multipliers.lm_head).float()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V and
        advances the Mamba mixers' states. A pipeline stage before the last sends its
        hidden states on and returns None."""
        ops, m, eps = self.ops, self.multipliers, self.eps
        scale = self.config.embedding_multiplier
        hidden = self._hidden_stream_in(input_ids, positions, None if scale == 1.0 else scale, mm_embeds)
        for i, layer in enumerate(self.layers):
            attn = layer.attention
            x = ops.rms_norm(hidden, attn.input_norm, eps)
            (k_cache, v_cache), (conv_state, ssm_state) = kv_caches[2 * i], kv_caches[2 * i + 1]
            mixed = layer.mamba(x * m.ssm_in if m.ssm_in != 1.0 else x, meta, conv_state, ssm_state)
            attended = self._attention(attn, x * m.attention_in if m.attention_in != 1.0 else x,
                                       positions, meta, k_cache, v_cache)
            hidden = hidden + (mixed * m.ssm_out + attended * m.attention_out)
            hidden = hidden + self._falcon_mlp(attn, ops.rms_norm(hidden, attn.post_norm, eps))
        if not self.tp.stage.last:
            self.tp.stage.send([hidden])
            return None
        return ops.rms_norm(hidden, self.norm, eps)


__all__ = ["FalconH1Layer", "FalconH1Model"]
