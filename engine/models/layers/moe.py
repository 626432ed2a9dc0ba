"""The sparse MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, Granite-MoE, GLM-4.5 and DeepSeek-V2/V3: a
router, routed experts and an optional shared expert, replacing the dense MLP in the layers
``MoeConfig.sparse_layers`` names. GLM-4.5 and DeepSeek-V3 route by sigmoid scores with a
selection bias, expert groups and a scale, DeepSeek-V2 by softmax scores with groups
(:func:`select_experts_grouped`), their routers in fp32 and their shared experts ungated.
Nemotron 3 routes as DeepSeek-V3 does; its experts and shared expert have no gate
(``relu(up) ** 2``: ``Ops.fused_moe`` with :class:`~engine.ops.moe.SquaredRelu`, ``w13``
holding the up rows alone), and its larger models run the experts in a latent space
between two dense projections.

Routing, as transformers computes it for each of these models: router logits in the model
dtype, a softmax over all experts in fp32, the ``top_k`` largest probabilities, and (when
``norm_topk_prob``, always for Mixtral) those ``k`` renormalised to sum to 1. Mixtral's
"softmax over the top-k logits" is the same thing: renormalising a subset of a softmax is
the softmax of that subset. The experts run through ``Ops.fused_moe`` (sorted by expert;
only the routed experts' weights are read). Qwen2-MoE adds a dense shared expert whose
output is scaled by ``sigmoid(shared_expert_gate(x))``.

The checkpoint stores each expert's projections apart (Hugging Face hub layout); they are
stacked once at build time into ``w13 [E, 2 * inter, hidden]`` (gate rows, then up rows)
and ``w2 [E, hidden, inter]``, the layout of GGUF's ``ffn_*_exps`` tensors and of the
fused kernels. Granite-MoE's checkpoints hold them stacked so already (``input_linear``,
``output_linear``); they are taken as they are, each rank cutting its share of every
expert from the stacks.

Tensor parallelism splits inside each expert: a rank keeps ``inter / N`` of every expert's
gate and up rows and the matching columns of its down, the shared expert likewise, and the
router and shared-expert gate whole. Every rank routes every token the same way and runs
the same experts on its slice; the block's output is a partial sum the decoder
all-reduces with the attention's (see :mod:`engine.models.layers.shard`).

Expert parallelism (``TensorParallel.expert_parallel``, vLLM's ``--enable-expert-parallel``)
deals the routed experts out whole instead: rank ``r`` keeps experts
``shard_range(E, r, N)`` (:func:`expert_share`). Every rank still routes every token;
each runs only the (token, slot) pairs routed to its own experts (:func:`local_experts`),
and the all-reduce that joins tensor parallelism's partial sums joins these. The shared
expert is cut as under tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.errors import CorruptModelError
from engine.models.config import ModelConfig, MoeConfig
from engine.models.layers.linear import make_linear
from engine.models.layers.shard import ShardedWeights
from engine.ops import Ops
from engine.ops.cpu import qmatmul as cq
from engine.ops.moe import ClampedSwiglu, ExpertActivation, SquaredRelu, expert_weight
from engine.ops.quant import QuantizedExperts, QuantizedWeight
from engine.parallel import SINGLE, TensorParallel, shard_range


def layer_prefix(moe: MoeConfig, layer: int) -> str:
    """Where a sparse layer's MLP weights live: Mixtral says block_sparse_moe, Qwen mlp."""
    block = {"mixtral": "block_sparse_moe", "granite": "block_sparse_moe", "jamba": "feed_forward",
             "nemotron_h": "mixer"}.get(moe.naming, "mlp")
    return f"model.layers.{layer}.{block}."


def _router_name(moe: MoeConfig) -> str:
    return "router.weight" if moe.naming == "jamba" else "gate.weight"


def expert_weight_names(moe: MoeConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The (gate, up, down) weight names of one expert, as the hub checkpoints spell them."""
    p = layer_prefix(moe, layer) + f"experts.{expert}."
    if moe.naming == "mixtral":
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def sparse_layer_weight_names(moe: MoeConfig, layer: int) -> list[str]:
    """Every weight name of a sparse layer's MLP, in checkpoint order."""
    p = layer_prefix(moe, layer)
    if moe.naming == "granite":
        return [p + "router.layer.weight", p + "input_linear.weight", p + "output_linear.weight"]
    if moe.naming == "qwen_stacked":
        return [p + "gate.weight", p + "experts.gate_up_proj", p + "experts.down_proj"]
    names = [p + _router_name(moe)]
    if moe.scoring in ("sigmoid", "softmax_bias"):
        names.append(p + _score_bias_name(moe))
    if moe.latent_size:
        names += [p + "fc1_latent_proj.weight", p + "fc2_latent_proj.weight"]
    for e in range(moe.num_experts):
        names += expert_weight_names(moe, layer, e)[0 if moe.gated else 1:]
    if moe.shared_expert_intermediate_size:
        names += [p + f"{_shared_name(moe)}.{n}_proj.weight" for n in ("gate", "up", "down")[0 if moe.gated else 1:]]
        if moe.naming not in _UNGATED:  # DeepSeek's, GLM's and ERNIE's shared experts are not gated
            names.append(p + "shared_expert_gate.weight")
    return names


_UNGATED = ("deepseek", "ernie", "nemotron_h")


def _shared_name(moe: MoeConfig) -> str:
    return "shared_experts" if moe.naming in _UNGATED else "shared_expert"


def _score_bias_name(moe: MoeConfig) -> str:
    """Where a router's selection bias lives (DeepSeek's / GLM's, or ERNIE's [1, E])."""
    return "moe_statics.e_score_correction_bias" if moe.naming == "ernie" else "gate.e_score_correction_bias"


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, ids [T, k] int64)`` of each token's ``top_k`` experts."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts_grouped(router_logits: torch.Tensor, bias: torch.Tensor | None, moe: MoeConfig
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (``MoeConfig.scoring`` "sigmoid", with the selection ``bias``)
    or DeepSeek-V2's ("softmax_groups", no bias), in fp32 as transformers computes them:
    ``(weights [T, k] fp32, ids [T, k] int64)``."""
    v3 = moe.scoring == "sigmoid"
    scores = router_logits.float().sigmoid() if v3 else router_logits.float().softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    if moe.topk_group < moe.n_group:  # only the best groups' experts may be chosen
        t = choice.shape[0]
        grouped = choice.view(t, moe.n_group, -1)
        # V3 ranks a group by its two best scores, V2 by its best
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if v3 else grouped.amax(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, 1.0)
        dropped = ~keep.bool().unsqueeze(-1).expand_as(grouped).reshape(t, -1)
        choice = choice.masked_fill(dropped, float("-inf") if v3 else 0.0)
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def expert_share(num_experts: int, tp: TensorParallel) -> tuple[int, int]:
    """``[first, stop)`` of the routed experts this rank holds whole: all of them, or under
    expert parallelism its equal share (the count must divide by the ranks:
    :func:`engine.models.layers.shard.tensor_parallel_problem` says so first)."""
    if tp.enabled and tp.expert_parallel:
        return shard_range(num_experts, tp.rank, tp.world_size)
    return 0, num_experts


def run_experts(ops: Ops, x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor,
                activation: ExpertActivation | None = None) -> torch.Tensor:
    """The routed experts' output: ``Ops.fused_moe``, or for experts kept in their blocks
    (:class:`~engine.ops.quant.QuantizedExperts`) quant.c's kernel over the blocks, as a
    projection kept in blocks takes ``qmatmul`` (where the C kernels are not built, the
    reference: each routed expert dequantized)."""
    if (isinstance(w13, QuantizedExperts) and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16)
            and not isinstance(activation, ClampedSwiglu) and cq.available()):
        return cq.qmoe(x, w13, w2, weights, ids, gated=activation is None)
    return ops.fused_moe(x, w13, w2, weights, ids, activation)


def expert_linear(x: torch.Tensor, w, e: int) -> torch.Tensor:
    """``x @ W_e.T`` for expert ``e`` of a stack (the LoRA path's per-expert matmuls): a
    stack kept in blocks through ``qmatmul``, part by part into its output columns (the
    arithmetic ``eng_qmoe`` gives the pairs it runs), else the dense weight (dequantized
    where the C kernels are missing)."""
    if isinstance(w, QuantizedExperts) and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) \
            and cq.available():
        x = x.contiguous()
        out = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype)
        col = 0
        for part in w.expert(e):
            cq.qmatmul(x, part, out=out[:, col : col + part.shape[0]])
            col += part.shape[0]
        return out
    return F.linear(x, expert_weight(w, e, x.dtype))


def stack_experts(gate_up: list[list], down: list, dtype: torch.dtype):
    """``(w13, w2)`` from each expert's weights (``gate_up[e]``: its gate and up, or its up
    alone; ``down[e]``): kept in their blocks (:class:`~engine.ops.quant.QuantizedExperts`)
    where every one of them is panel-packed and each projection's formats agree across the
    experts, else dense stacks in ``dtype`` (a block-kept weight among dense ones is
    dequantized)."""
    weights = [w for parts in gate_up for w in parts] + list(down)
    if all(isinstance(w, QuantizedWeight) and w.layout == "panels" for w in weights):
        columns = [*zip(*gate_up, strict=True), down]
        if all(len({(w.fmt, w.shape) for w in column}) == 1 for column in columns):
            return QuantizedExperts.stack(gate_up), QuantizedExperts.stack([[w] for w in down])

    def dense(w) -> torch.Tensor:
        return w.dequantize().to(dtype) if isinstance(w, QuantizedWeight) else w

    return (torch.stack([torch.cat([dense(w) for w in parts]) for parts in gate_up]),
            torch.stack([dense(w) for w in down]))


def local_experts(ops: Ops, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, first: int, activation: ExpertActivation | None = None) -> torch.Tensor:
    """This rank's part of the routed experts' output under expert parallelism: the
    (token, slot) pairs routed to its experts ``[first, first + len(w13))``, each run as a
    row of its own (one slot) through ``Ops.fused_moe``, their weighted outputs summed
    per token in fp32; a token none of whose experts are here gets zeros."""
    local = ids - first
    pairs = ((local >= 0) & (local < w13.shape[0])).view(-1).nonzero().squeeze(1)  # token * k + slot
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if pairs.numel():
        tokens = pairs // ids.shape[1]
        y = run_experts(ops, x.index_select(0, tokens), w13, w2, weights.reshape(-1, 1)[pairs].contiguous(),
                        local.reshape(-1, 1)[pairs].contiguous(), activation)
        out.index_add_(0, tokens, y.float())
    return out.to(x.dtype)


def _granite_experts(w13: torch.Tensor, w2: torch.Tensor, inter: int,
                     tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """Granite-MoE's stacked experts (``input_linear`` [E, 2 * inter, hidden]: gate rows,
    then up rows; ``output_linear`` [E, hidden, inter]) cut to this rank's share of every
    expert, as the other families' experts are cut when they are stacked, or under expert
    parallelism to this rank's experts, whole."""
    if tp.enabled and tp.expert_parallel:
        a, b = expert_share(w13.shape[0], tp)
        return w13[a:b].contiguous(), w2[a:b].contiguous()
    if not tp.enabled:
        return w13.contiguous(), w2.contiguous()
    a, b = shard_range(inter, tp.rank, tp.world_size)
    gate_up = torch.cat([w13[:, a:b], w13[:, inter + a:inter + b]], dim=1)
    return gate_up.contiguous(), w2[:, :, a:b].contiguous()


def _qwen_stacked_experts(gate_up: torch.Tensor, down: torch.Tensor, moe: MoeConfig,
                          hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL-MoE's stacked experts as the kernels take them (``[E, 2 * inter, hidden]``,
    gate rows then up rows; ``[E, hidden, inter]``). The hub's checkpoints hold them
    transposed (``[E, hidden, 2 * inter]``, ``[E, inter, hidden]``), transformers 5's
    ``save_pretrained`` as the kernels do: the down projection's shape tells them apart
    (the gate/up one's where ``inter == hidden``)."""
    e, inter = moe.num_experts, moe.intermediate_size
    hub = (tuple(down.shape) == (e, inter, hidden) if inter != hidden
           else tuple(gate_up.shape) == (e, hidden, 2 * inter))
    if hub:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if tuple(gate_up.shape) != (e, 2 * inter, hidden) or tuple(down.shape) != (e, hidden, inter):
        raise CorruptModelError(
            f"the stacked experts are {tuple(gate_up.shape)} and {tuple(down.shape)}; the config "
            f"gives {(e, hidden, 2 * inter)} and {(e, inter, hidden)} (or transposed)")
    return gate_up, down


class SparseMoeBlock:
    """One layer's router, stacked expert weights and optional shared expert."""

    __slots__ = ("top_k", "renormalize", "router", "w13", "w2", "shared_gate_up", "shared_down", "shared_gate", "lora",
                 "moe", "score_bias", "first_expert", "activation", "latent_in", "latent_out")

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        get: Callable[[str], torch.Tensor],
        linear: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]],
        tp: TensorParallel = SINGLE,
    ) -> None:
        """``get`` fetches a weight by name; with ``tp`` of several ranks it is a
        :class:`~engine.models.layers.shard.ShardedWeights` whose ``rows``/``cols`` cut this
        rank's slice."""
        moe = config.moe
        assert moe is not None
        self.top_k = moe.top_k
        self.renormalize = moe.norm_topk_prob
        p = layer_prefix(moe, layer)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        # The experts' LoRA deltas (engine.models.layers.lora.LoraExperts), once enabled.
        self.lora = None
        self.moe, self.score_bias = moe, None  # score_bias: DeepSeek-V3's routing's (GLM-4.5's)
        # Under expert parallelism the first of this rank's whole experts, else None.
        self.first_expert = expert_share(moe.num_experts, tp)[0] if tp.enabled and tp.expert_parallel else None
        # Nemotron 3's ungated experts, and its latent projections (whole on every rank:
        # the experts' partial sums go through the second one before they are summed).
        self.activation = None if moe.gated else SquaredRelu()
        self.latent_in = self.latent_out = None
        if moe.latent_size:
            self.latent_in, self.latent_out = (linear(get(p + f"fc{n}_latent_proj.weight")) for n in (1, 2))
        if moe.naming == "granite":  # stacked as the kernels take them
            self.router = linear(get(p + "router.layer.weight"))
            self.w13, self.w2 = _granite_experts(get(p + "input_linear.weight"),
                                                 get(p + "output_linear.weight"),
                                                 moe.intermediate_size, tp)
            return
        if moe.naming == "qwen_stacked":
            self.router = linear(get(p + "gate.weight"))
            stacked = _qwen_stacked_experts(get(p + "experts.gate_up_proj"), get(p + "experts.down_proj"),
                                            moe, config.hidden_size)
            self.w13, self.w2 = _granite_experts(*stacked, moe.intermediate_size, tp)
            return
        if moe.scoring != "softmax":  # DeepSeek's: the router (and its selection bias) in fp32
            fp32 = ShardedWeights(get.weights, torch.float32, get.device)  # type: ignore[attr-defined]
            self.router = _Fp32Router(fp32(p + "gate.weight"))
            if moe.scoring in ("sigmoid", "softmax_bias"):
                self.score_bias = fp32(p + _score_bias_name(moe)).reshape(-1)
        else:
            self.router = linear(get(p + _router_name(moe)))  # [E, hidden]
        # Column-parallel gate/up rows, row-parallel down columns (whole with one rank; dense
        # where a rank's columns would split a GGUF's blocks).
        rows = get.rows if tp.enabled else get  # type: ignore[attr-defined]
        gate_up, down = [], []
        whole = self.first_expert is not None  # expert parallelism: this rank's experts, whole
        for e in range(*expert_share(moe.num_experts, tp)):
            halves = expert_weight_names(moe, layer, e)[0 if moe.gated else 1:]  # (gate,) up, down
            gate_up.append([(get if whole else rows)(n) for n in halves[:-1]])
            down.append(get(halves[-1]) if whole else get.cols_or_dense(halves[-1]))  # type: ignore[attr-defined]
        # A GGUF's experts stay in their blocks (panels, on CPU), else dense stacks.
        self.w13, self.w2 = stack_experts(gate_up, down, get.dtype)  # type: ignore[attr-defined]
        if moe.shared_expert_intermediate_size:
            s = p + _shared_name(moe) + "."
            # (a GGUF's shared expert may be kept in blocks, as a dense MLP is)
            self.shared_gate_up = make_linear([rows(s + f"{n}_proj.weight") for n in ("gate", "up")[0 if moe.gated else 1:]])
            self.shared_down = make_linear([get.cols_or_dense(s + "down_proj.weight")])  # type: ignore[attr-defined]
            if moe.naming not in _UNGATED:
                self.shared_gate = linear(get(p + "shared_expert_gate.weight"))  # [1, hidden]

    def __call__(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        """The block's output; with tensor parallelism this rank's part of it (the gated
        shared expert's too: the gate scales each rank's partial sum alike)."""
        if self.moe.scoring != "softmax":
            weights, ids = select_experts_grouped(self.router(x), self.score_bias, self.moe)
        else:
            weights, ids = select_experts(self.router(x), self.top_k, self.renormalize)
        token_slots = None if self.lora is None else self.lora.active()
        xe = x if self.latent_in is None else self.latent_in(x)
        if self.first_expert is not None:
            out = local_experts(ops, xe, self.w13, self.w2, weights, ids, self.first_expert, self.activation)
        elif token_slots is None:
            out = run_experts(ops, xe, self.w13, self.w2, weights, ids, self.activation)
        else:  # a token's adapter adapts the experts: the deltas go inside each expert's MLP
            out = self.lora(x, self.w13, self.w2, weights, ids, token_slots)
        if self.latent_out is not None:
            out = self.latent_out(out)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None
            up = self.shared_gate_up(x)
            shared = self.shared_down(ops.silu_and_mul(up) if self.activation is None else torch.square(F.relu(up)))
            out = out + (shared if self.shared_gate is None else F.sigmoid(self.shared_gate(x)) * shared)
        return out


class _Fp32Router:
    """A router computed in fp32 (GLM-4.5's: transformers keeps it so): ``x @ w.T``."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


__all__ = [
    "SparseMoeBlock",
    "expert_linear",
    "expert_weight_names",
    "layer_prefix",
    "run_experts",
    "select_experts",
    "select_experts_grouped",
    "sparse_layer_weight_names",
    "stack_experts",
]
