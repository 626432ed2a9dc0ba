"""The sparse MLP of a mixture-of-experts decoder, read from its ``config.json``
(``ModelConfig.moe``; engine.models.layers.moe builds it): Mixtral, Qwen2-MoE, Qwen3-MoE,
Granite-MoE, GLM-4.5, gpt-oss, Nemotron 3 and others."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model, as its config.json describes it."""

    num_experts: int
    top_k: int  # experts each token is routed to
    intermediate_size: int  # of each expert
    # Renormalise the top-k routing probabilities to sum to 1 (Mixtral always does; the
    # Qwen MoE configs say so with norm_topk_prob).
    norm_topk_prob: bool
    # Qwen2-MoE's always-on expert, scaled by sigmoid(shared_expert_gate(x)); 0: none.
    shared_expert_intermediate_size: int
    # Layers whose MLP is the sparse block; the others keep a dense MLP of the model's
    # intermediate_size (Qwen's decoder_sparse_step and mlp_only_layers).
    sparse_layers: tuple[int, ...]
    # Checkpoint naming: Mixtral's block_sparse_moe.experts.N.w1/w3/w2, Qwen's
    # mlp.experts.N.gate_proj/up_proj/down_proj, or Granite's stacked
    # block_sparse_moe.input_linear [E, 2 * inter, hidden] / output_linear / router.layer.
    # gpt-oss's experts (naming "gpt_oss"): stacked and interleaved
    # (mlp.experts.gate_up_proj [E, hidden, 2 * inter], gate and up columns alternating),
    # with biases, the router's too, and the clamped SwiGLU (engine.ops.moe.ClampedSwiglu)
    # of this limit and sigmoid gain; 0: the plain SwiGLU.
    # Qwen3-VL-MoE's (naming "qwen_stacked"): mlp.experts.gate_up_proj / down_proj, stacked
    # (models/layers/moe.py reads either layout) beside Qwen's mlp.gate router.
    # Jamba's (naming "jamba"): feed_forward.router, feed_forward.experts.N.gate_proj/up_proj/down_proj.
    # Nemotron 3's (naming "nemotron_h"): mixer.gate (DeepSeek-V3's routing, below),
    # mixer.experts.N.up_proj/down_proj with no gate (relu(up) ** 2), an ungated shared
    # expert of the same kind (mixer.shared_experts), and with latent_size the experts
    # working in a narrower space (mixer.fc1_latent_proj before them, fc2_latent_proj after).
    naming: str  # "mixtral", "qwen", "qwen_stacked", "granite", "deepseek", "ernie", "gpt_oss", "jamba", "nemotron_h"
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # DeepSeek-V3's routing ("sigmoid", GLM-4.5's too, naming "deepseek"; "softmax": the
    # others'): sigmoid scores, the top-k chosen by score + the router's
    # e_score_correction_bias among the topk_group best of n_group expert groups (a group
    # ranked by its two best), weighted by the scores alone (renormalised with
    # norm_topk_prob), times routed_scaling_factor. DeepSeek-V2's ("softmax_groups"):
    # softmax scores, the groups ranked by their best, no bias, no renormalising. ERNIE
    # 4.5's ("softmax_bias"): softmax scores chosen with a selection bias, renormalised. The
    # shared expert (shared_experts, n_shared_experts of moe_intermediate_size) is added
    # ungated.
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    latent_size: int = 0  # Nemotron 3's moe_latent_size; 0: the experts read the hidden state

    @property
    def gated(self) -> bool:
        """Whether each expert is SiLU-gated (``w13`` gate rows then up rows); Nemotron 3's
        are not (up rows alone, squared ReLU)."""
        return self.naming != "nemotron_h"

    @classmethod
    def from_hf(cls, raw: dict[str, Any], arch: str, num_layers: int) -> MoeConfig | None:
        if arch in ("glm4_moe", "deepseek_v3", "deepseek_v2"):
            # transformers' defaults where the config is silent: (routed experts, groups,
            # groups kept, scale, dense layers first)
            d = {"glm4_moe": (128, 1, 1, 1.0, 1), "deepseek_v3": (256, 8, 4, 2.5, 3),
                 "deepseek_v2": (64, 1, 1, 1.0, 0)}[arch]
            v2 = arch == "deepseek_v2"
            if v2 and raw.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
                raise ValueError(f"DeepSeek-V2 topk_method {raw.get('topk_method')!r} is not greedy or "
                                 "group_limited_greedy")
            experts = int(raw.get("n_routed_experts") or _num_experts(raw, d[0]))
            inter = int(raw["moe_intermediate_size"])
            # DeepSeek-V2 limits the choice to the best groups only with "group_limited_greedy".
            grouped = not v2 or raw.get("topk_method") == "group_limited_greedy"
            groups = int(raw.get("n_group") or d[1]) if grouped else 1
            topk_groups = int(raw.get("topk_group") or d[2]) if grouped else 1
            if experts % groups or not 0 < topk_groups <= groups:
                raise ValueError(f"n_group {groups} / topk_group {topk_groups} do not fit {experts} experts")
            return cls(num_experts=experts, top_k=int(raw.get("num_experts_per_tok", 8 if not v2 else 6)),
                       intermediate_size=inter,
                       # DeepSeek-V2's router never renormalises (transformers reads no flag)
                       norm_topk_prob=not v2 and bool(raw.get("norm_topk_prob", True)),
                       shared_expert_intermediate_size=inter * int(raw.get("n_shared_experts", 2 if v2 else 1) or 0),
                       sparse_layers=tuple(range(int(raw.get("first_k_dense_replace", d[4])), num_layers)),
                       naming="deepseek", scoring="softmax_groups" if v2 else "sigmoid", n_group=groups,
                       topk_group=topk_groups, routed_scaling_factor=float(raw.get("routed_scaling_factor", d[3])))
        if arch == "nemotron_h":  # its "moe" blocks (raw as engine.models.mamba_config.nemotron_h_raw gives it)
            sparse = tuple(i for i, t in enumerate(raw["layer_types"]) if t == "moe")
            if not sparse:
                return None
            experts = int(raw.get("n_routed_experts") or _num_experts(raw, 8))
            groups, topk_groups = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
            if experts % groups or not 0 < topk_groups <= groups:
                raise ValueError(f"n_group {groups} / topk_group {topk_groups} do not fit {experts} experts")
            return cls(num_experts=experts, top_k=int(raw.get("num_experts_per_tok", 2)),
                       intermediate_size=int(raw.get("moe_intermediate_size", 7688)),
                       norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                       shared_expert_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size", 7688) or 0),
                       sparse_layers=sparse, naming="nemotron_h", scoring="sigmoid", n_group=groups,
                       topk_group=topk_groups, routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                       latent_size=int(raw.get("moe_latent_size") or 0))
        if arch == "ernie4_5_moe":
            # ERNIE 4.5's: layers start..end, every interval-th; softmax scores chosen with a
            # selection bias (moe_statics), renormalised; ungated shared experts.
            start, interval = int(raw.get("moe_layer_start_index", 1)), int(raw.get("moe_layer_interval", 1))
            end = int(raw.get("moe_layer_end_index", num_layers - 1))
            inter = int(raw["moe_intermediate_size"])
            return cls(num_experts=int(raw.get("moe_num_experts") or _num_experts(raw, 64)),
                       top_k=int(raw.get("moe_k") or raw.get("num_experts_per_tok") or 6), intermediate_size=inter,
                       norm_topk_prob=True, shared_expert_intermediate_size=inter * int(raw.get("moe_num_shared_experts", 0)),
                       sparse_layers=tuple(i for i in range(num_layers)
                                           if (i + 1) % interval == 0 and start <= i <= end),
                       naming="ernie", scoring="softmax_bias")
        if arch == "gpt_oss":  # softmax over the top-k logits: renormalised top-k
            return cls(num_experts=_num_experts(raw, 128),
                       top_k=int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4),
                       intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
                       shared_expert_intermediate_size=0, sparse_layers=tuple(range(num_layers)),
                       naming="gpt_oss", swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                       swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))
        if arch in ("granite_moe", "granite_hybrid"):  # softmax over the top-k logits: renormalised top-k
            if arch == "granite_hybrid" and not int(raw.get("num_local_experts") or 0):
                return None  # granite-4.0-micro, -h-micro: the shared MLP alone
            return cls(num_experts=_num_experts(raw, 0), top_k=int(raw["num_experts_per_tok"]),
                       intermediate_size=int(raw.get("expert_intermediate_size") or raw["intermediate_size"]),
                       norm_topk_prob=True,
                       shared_expert_intermediate_size=0, sparse_layers=tuple(range(num_layers)),
                       naming="granite")
        if arch == "mixtral":
            experts = _num_experts(raw, 8)
            return cls(
                num_experts=experts,
                top_k=int(raw.get("num_experts_per_tok", 2)),
                intermediate_size=int(raw["intermediate_size"]),
                norm_topk_prob=True,
                shared_expert_intermediate_size=0,
                sparse_layers=tuple(range(num_layers)),
                naming="mixtral",
            )
        if arch == "jamba":  # every expert_layer_period-th layer from the offset; top-k not renormalised
            experts, period = _num_experts(raw, 16), int(raw.get("expert_layer_period", 2))
            offset = int(raw.get("expert_layer_offset", 1))
            sparse = tuple(i for i in range(num_layers) if experts > 1 and i % period == offset)
            if not sparse:
                return None
            return cls(num_experts=experts, top_k=int(raw.get("num_experts_per_tok", 2)),
                       intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=False,
                       shared_expert_intermediate_size=0, sparse_layers=sparse, naming="jamba")
        if arch == "olmoe":  # every layer routed, Qwen's names; renormalised only if asked
            return cls(num_experts=_num_experts(raw, 64), top_k=int(raw.get("num_experts_per_tok", 8)),
                       intermediate_size=int(raw["intermediate_size"]),
                       norm_topk_prob=bool(raw.get("norm_topk_prob", False)), shared_expert_intermediate_size=0,
                       sparse_layers=tuple(range(num_layers)), naming="qwen")
        if arch == "qwen3_5_moe":  # every layer: softmax top-k renormalised, a sigmoid-gated shared expert
            return cls(num_experts=_num_experts(raw, 512), top_k=int(raw.get("num_experts_per_tok", 10)),
                       intermediate_size=int(raw["moe_intermediate_size"]), norm_topk_prob=True,
                       shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                       sparse_layers=tuple(range(num_layers)), naming="qwen")
        if arch not in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
            return None
        experts = _num_experts(raw, 0)
        step = int(raw.get("decoder_sparse_step", 1))
        dense_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
        # transformers: layer i is sparse iff it is not in mlp_only_layers, the model has
        # experts and (i + 1) % decoder_sparse_step == 0.
        sparse = tuple(
            i for i in range(num_layers)
            if i not in dense_only and experts > 0 and step > 0 and (i + 1) % step == 0
        )
        return cls(
            num_experts=experts,
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", arch == "qwen3_next")),
            shared_expert_intermediate_size=(  # Qwen2-MoE's and Qwen3-Next's sigmoid-gated shared expert
                int(raw.get("shared_expert_intermediate_size") or 0) if arch in ("qwen2_moe", "qwen3_next") else 0
            ),
            sparse_layers=sparse,
            naming="qwen",
        )


def _num_experts(raw: dict[str, Any], default: int) -> int:
    """The expert count under either name: transformers 4 wrote ``num_experts`` for the
    Qwen MoE families and ``num_local_experts`` for Mixtral; transformers 5 writes
    ``num_local_experts`` for Qwen3-MoE too (``num_experts`` is an alias there)."""
    for key in ("num_local_experts", "num_experts"):
        if raw.get(key) is not None:
            return int(raw[key])
    return default


__all__ = ["MoeConfig"]
