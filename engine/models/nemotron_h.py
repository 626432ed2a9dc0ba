"""NVIDIA's Nemotron-H (``NemotronHForCausalLM``: Nemotron-H-8B/47B/56B, NVIDIA-Nemotron-Nano-
9B-v2 and -12B-v2): a stack of single-mixer blocks, each ``x + mixer(norm(x))``, whose mixer
is one of

* a Mamba-2 layer ("M" in ``hybrid_override_pattern``; engine.models.layers.mamba, the
  mixer Granite 4's hybrid layers run, here under ``mixer.``);
* attention ("*"): GQA with no positions at all (the Mamba layers carry them), no biases;
* an MLP ("-"): ``down(relu(up(x)) ** 2)``, no gate;
* a mixture of experts ("E", Nemotron 3: NVIDIA-Nemotron-3-Nano-30B-A3B and up): DeepSeek-V3's
  sigmoid routing with its selection bias, groups and scale, experts and a shared expert
  of the MLP's ungated kind, optionally in a latent space (engine.models.layers.moe).

Its RMS norms multiply the fp32 normed row by the weight in fp32 and round once. The
checkpoint's ``backbone.*`` names are read as the decoder's (``checkpoint_name``). The
Mamba layers keep one recurrent state
a request (engine.runner.state_slots), with what that turns off (prefix caching) and
refuses (speculation, beam search, LoRA). Tensor-parallel ranks each keep their heads of
every mixer and their share of every MLP and every expert (or, with expert parallelism,
their experts whole); pipeline stages cut the blocks as any layers.
The fused CPU decode step does not run it.

Mamba-2 alone (``Mamba2ForCausalLM``: Mamba-Codestral-7B, the ``mamba2-*-hf`` conversions)
is the same stack with a Mamba block in every layer and the same ``backbone.*`` names
(:class:`Mamba2Model`); its norms round the normed row before the weight multiplies it, as
Llama's, and with ``residual_in_fp32`` (the default) the residual stream stays fp32
between blocks, as transformers keeps it. Mamba-1 (``MambaForCausalLM``: state-spaces'
mamba-*-hf; ``FalconMambaForCausalLM``: falcon-mamba-7b, Falcon3-Mamba-7B) is that stack
again with the selective-scan mixer (engine.models.layers.mamba1) in its blocks
(:class:`MambaModel`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.deltanet_config import DeltaNetConfig
from engine.models.layers.decoder import Decoder, DecoderLayer
from engine.models.layers.linear import make_linear
from engine.models.layers.mamba import MambaMixer, mamba_weight_names
from engine.models.layers.mamba1 import Mamba1Mixer, mamba1_weight_names
from engine.models.layers.moe import SparseMoeBlock, sparse_layer_weight_names
from engine.models.layers.norm import gemma_rms_norm
from engine.models.layers.shard import ShardedWeights, qkv_spans
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel


@dataclasses.dataclass(slots=True)
class NemotronBlock:
    """One block: its norm (fp32) and exactly one of a Mamba mixer, an attention layer
    (a DecoderLayer's projections), an MLP (``up``, ``down``) or experts (``moe``)."""

    norm: torch.Tensor
    mamba: MambaMixer | None = None
    attention: DecoderLayer | None = None
    up: Any = None
    down: Any = None
    moe: SparseMoeBlock | None = None


class NemotronHModel(Decoder):
    """Nemotron-H's block stack plus LM head (see the module docstring)."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        m = config.mamba
        assert m is not None  # mamba_fields always reads Nemotron-H's layers
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            names.append(p + "norm.weight")
            if i in m.layers:
                names += mamba_weight_names(m, p, "mixer")
            elif config.moe is not None and i in config.moe.sparse_layers:
                names += sparse_layer_weight_names(config.moe, i)
            elif i in m.mlp_layers:
                names += [p + "mixer.up_proj.weight", p + "mixer.down_proj.weight"]
            else:
                names += [p + f"mixer.{n}_proj.weight" for n in "qkvo"]
        names.append("model.norm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The released checkpoints' ``backbone.*`` names as the decoder's."""
        if name == "backbone.embeddings.weight":
            return "model.embed_tokens.weight"
        if name == "backbone.norm_f.weight":
            return "model.norm.weight"
        return "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name

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
        self._init_common(config, ops, dtype, device, tp, scale=config.head_dim**-0.5)
        self.cos_sin_cache = None
        get = ShardedWeights(weights, dtype, self.device, tp)
        norms = ShardedWeights(weights, torch.float32, self.device)  # multiplied in fp32
        self._build_ends(get, weights, lambda: norms("model.norm.weight"))
        self.layers = [self._block(get, norms, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _block(self, get: ShardedWeights, norms: ShardedWeights, i: int) -> NemotronBlock:
        m = self.config.mamba
        assert m is not None
        p = f"model.layers.{i}."
        block = NemotronBlock(norm=norms(p + "norm.weight"))
        mixer = p + "mixer."
        if i in m.layers:
            block.mamba = MambaMixer.build(m, get, p, self.eps, make_linear, self.ops, module="mixer")
        elif self.config.moe is not None and i in self.config.moe.sparse_layers:
            block.moe = SparseMoeBlock(self.config, i, get, lambda w: make_linear([w]), self.tp)  # (GGUF blocks kept)
        elif i in m.mlp_layers:  # over tensor-parallel ranks: up's rows, down's columns
            block.up = make_linear([get.rows(mixer + "up_proj.weight")])
            block.down = get.row_parallel(mixer + "down_proj.weight")
        else:
            _, spans = qkv_spans(self.config, self.tp)  # this rank's heads
            block.attention = DecoderLayer(
                input_norm=block.norm, post_norm=None,  # type: ignore[arg-type]  # one norm a block
                qkv=make_linear([get.rows(mixer + f"{n}_proj.weight", spans=[span])
                                 for n, span in zip("qkv", spans, strict=True)]),
                o_proj=get.row_parallel(mixer + "o_proj.weight"),
                q_norm=None, k_norm=None, gate_up=None, down=None, window=0, rope=None)
        return block

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Nemotron-H's RMS norm: the fp32 weight times the fp32 normed row, rounded once
        (Gemma's arithmetic with the weight as stored: one C call on the CPU kernels)."""
        return gemma_rms_norm(self.ops, x, weight, self.eps)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step runs no Mamba, positionless or single-mixer block."""
        return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V and
        advances the Mamba layers' states."""

        def block(layer: NemotronBlock, hidden: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
            x = self._norm(hidden, layer.norm)
            if layer.mamba is not None:
                out = layer.mamba(x, meta, first, second)  # the layer's conv and SSM states
            elif layer.attention is not None:
                out = self._attention(layer.attention, x, positions, meta, first, second)
            elif layer.moe is not None:  # each rank's experts' partial sums, joined
                out = self.tp.all_reduce(layer.moe(x, self.ops))
            else:
                out = layer.down(torch.square(F.relu(layer.up(x))))
            return hidden + out

        return self._run_stream(input_ids, positions, kv_caches, block,  # type: ignore[return-value]
                                lambda h: self._norm(h, self.norm), mm_embeds=mm_embeds)


class Mamba2Model(NemotronHModel):
    """Mamba-2 alone (see the module docstring): every block a Mamba mixer."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, weights, ops, dtype=dtype, device=device, tp=tp)
        for layer in self.layers:  # Llama's norm: the weight in the model dtype
            layer.norm = layer.norm.to(dtype)
        if self.norm is not None:  # the last norm reads the fp32 stream: the weight as rounded, in fp32
            self.norm = self.norm.to(dtype).float()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; advances every block's states."""
        m = self.config.recurrent
        assert m is not None and not isinstance(m, DeltaNetConfig)
        fp32 = m.residual_in_fp32

        def block(layer: NemotronBlock, hidden: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            assert layer.mamba is not None
            out = layer.mamba(self.ops.rms_norm(hidden.to(self.dtype), layer.norm, self.eps), meta, conv, state)
            return (hidden.float() if fp32 else hidden) + out

        def final(hidden: torch.Tensor) -> torch.Tensor:
            if not fp32:
                return self.ops.rms_norm(hidden, self.norm.to(self.dtype), self.eps)
            h = hidden.float()  # transformers' norm of the fp32 stream: the fp32 weight times the fp32 row
            return (self.norm * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(self.dtype)

        return self._run_stream(input_ids, positions, kv_caches, block, final,  # type: ignore[return-value]
                                mm_embeds=mm_embeds)


class MambaModel(Mamba2Model):
    """Mamba-1 (see the module docstring): Mamba-2's stack with the selective-scan mixer."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        m = config.mamba1
        assert m is not None
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers):
            names += [f"model.layers.{i}.norm.weight", *mamba1_weight_names(m, f"model.layers.{i}.")]
        names.append("model.norm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tp: TensorParallel = SINGLE) -> None:
        m = config.mamba1
        assert m is not None
        self._init_common(config, ops, dtype, device, tp, scale=1.0)
        self.cos_sin_cache = None
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: get("model.norm.weight").float())
        self.layers = [NemotronBlock(norm=get(f"model.layers.{i}.norm.weight"),
                                     mamba=Mamba1Mixer.build(m, get, f"model.layers.{i}.", make_linear, ops))  # type: ignore[arg-type]
                       for i in tp.stage.layer_range(config.num_hidden_layers)]


__all__ = ["Mamba2Model", "MambaModel", "NemotronBlock", "NemotronHModel"]
