"""LoRA adapters as peft writes them: reading, checking against the base model, slot layout.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or the older
``adapter_model.bin``, refused: a pickle). Each targeted linear ``W`` of the base gets
``W x + scale * B (A x)`` with ``A`` [r, in] and ``B`` [out, r], ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). Targets are the attention's q/k/v/o and
the dense MLP's gate/up/down (Phi-3's fused qkv_proj and gate_up_proj as they are stored).

In a mixture-of-experts layer the targets are the routed experts, the shared expert's
gate/up/down and its gate (Qwen2-MoE). transformers keeps each layer's experts as two 3-D
parameters, ``gate_up_proj`` [E, 2 * inter, hidden] and ``down_proj`` [E, hidden, inter],
which peft adapts through ``target_parameters`` (its ``ParamWrapper``): one pair per
parameter with ``A`` [E * r, in] (expert-major rows: expert ``e``'s are ``A[e*r:(e+1)*r]``)
and ``B`` [out, E * r] (rank-major columns: expert ``e``'s are ``B[:, e::E]``), so expert
``e``'s weight becomes ``W_e + scale * B_e A_e``. Both parameters of one module nest, and
their keys read ``mlp.experts.lora_A.weight`` and ``mlp.experts.base_layer.lora_A.weight``;
which is which is told by shape (``A``'s input and ``B``'s output are (hidden, 2 * inter)
for gate_up and (inter, hidden) for down, never equal). Read here as ``A`` [E, r, in] and
``scale * B`` [E, out, r]. Adapters written with transformers 4, an ``nn.Linear`` per expert
(``experts.N.gate_proj``/``up_proj``/``down_proj``, Mixtral's ``block_sparse_moe.experts.N.w1``
/``w3``/``w2``), are read into the same pairs: gate and up, each with its own ``A``, become one
pair of rank ``2r`` (``_per_expert_pairs``), which ``--max-lora-rank`` must hold.

What is refused, with a message naming the adapter and the reason: a folder or file that
is missing; an extra vocabulary (``added_tokens.json``, ``new_embeddings.safetensors``,
``trainable_token_indices``, embedding or LM-head targets); ``modules_to_save``; DoRA,
LoRA biases, per-module ``rank_pattern``/``alpha_pattern``; a target other than the above
(the MoE router); a rank above ``--max-lora-rank`` (twice the rank for transformers 4's
per-expert gate/up); a
tensor whose shape does not fit the base model; NaN or infinite values.

The engine fuses q/k/v and gate/up into one matmul each (``models/layers/decoder.py``); an
adapter's slices of one fused projection are laid side by side in its slot: ``A`` stacks
each slice's rows (``n_slices * R`` rows, each slice's rank padded to ``R`` with zeros) and
``B`` is block diagonal (each slice's rows read only its own columns), so one
shrink-then-expand pair computes every slice's delta. The scale is folded into ``B``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.errors import LoraAdapterError, UnsupportedModelError
from engine.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# A peft key: base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight;
# over a vision-language model the language model's layers nest as transformers 5 saves
# them (model.language_model.layers; Idefics3's and SmolVLM's model.text_model.layers) or
# 4 did (language_model.model.layers). A key of the vision tower or projector matches none
# of these: refused as an unsupported target.
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?(?:language_model\.|text_model\.)?(?:model\.)?layers\.(\d+)\."
                  r"(self_attn|mlp|block_sparse_moe)\.([\w.]+?)\.lora_([AB])\.weight$")
# transformers 4's experts, an nn.Linear each (Qwen's gate/up/down_proj, Mixtral's w1/w3/w2):
# experts.N.<projection>, read into the fused experts' pairs (_per_expert_pairs).
_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
_PER_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# peft's ParamWrapper over a MoE layer's 3-D expert parameters: one pair per parameter,
# nested (the inner one's key has a base_layer per level).
_EXPERTS = re.compile(r"^experts(?:\.base_layer)*$")
EXPERT_GATE_UP = "experts.gate_up_proj"
EXPERT_DOWN = "experts.down_proj"
# Targets that add tokens or replace whole modules: the adapter carries its own vocabulary
# rows, which a shared base model's embedding cannot hold per request.
_VOCAB_TARGETS = ("embed_tokens", "lm_head", "wte", "word_embeddings")


# The families whose layers lora_targets describes (the Llama-like decoder and Gemma's): a
# vision-language model's language model is one of them (LLaVA's, Qwen-VL's Qwen2, Gemma
# 3's), adapted as vLLM adapts it (its tower and projector are not targets).
LORA_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite", "gemma", "gemma2", "gemma3", "mixtral",
                                "qwen2_moe", "qwen3_moe"})


def check_lora_model(config: ModelConfig) -> None:
    """Refuse (:class:`UnsupportedModelError`) a base model adapters cannot be served on."""
    if config.recurrent is not None:
        raise UnsupportedModelError("LoRA adapters are not supported for models with "
                                    "recurrent layers (Mamba-2, Gated DeltaNet)")
    if config.architecture not in LORA_ARCHITECTURES or config.base_model:
        raise UnsupportedModelError(f"LoRA adapters are not supported for {config.architecture} models "
                                    f"(supported: {', '.join(sorted(LORA_ARCHITECTURES))})")


@dataclasses.dataclass(frozen=True, slots=True)
class LoraTarget:
    """One fused projection of a decoder layer as adapters see it: the peft module names of
    its slices (in the order of its output rows) and their output widths."""

    key: str  # the DecoderLayer field: "qkv", "o_proj", "gate_up", "down"
    in_features: int
    slices: tuple[tuple[str, int], ...]  # (peft module name, rows of the output)

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.slices)


def lora_targets(config: ModelConfig, layer: int) -> tuple[LoraTarget, ...]:
    """The projections of ``layer`` an adapter may target (the MLP's only in a dense layer)."""
    h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    phi3 = config.architecture == "phi3"
    qkv = (("qkv_proj", (h + 2 * hkv) * d),) if phi3 else (("q_proj", h * d), ("k_proj", hkv * d), ("v_proj", hkv * d))
    targets = [LoraTarget("qkv", hidden, qkv), LoraTarget("o_proj", h * d, (("o_proj", hidden),))]
    if config.moe is None or layer not in config.moe.sparse_layers:
        gate_up = (("gate_up_proj", 2 * inter),) if phi3 else (("gate_proj", inter), ("up_proj", inter))
        targets += [LoraTarget("gate_up", hidden, gate_up), LoraTarget("down", inter, (("down_proj", hidden),))]
    elif config.moe.shared_expert_intermediate_size:
        # Qwen2-MoE's shared expert (a dense MLP inside the sparse block) and its gate; the
        # keys name SparseMoeBlock's fields.
        shared = config.moe.shared_expert_intermediate_size
        targets += [
            LoraTarget("moe.shared_gate_up", hidden,
                       (("shared_expert.gate_proj", shared), ("shared_expert.up_proj", shared))),
            LoraTarget("moe.shared_down", shared, (("shared_expert.down_proj", hidden),)),
            LoraTarget("moe.shared_gate", hidden, (("shared_expert_gate", 1),)),
        ]
    return tuple(targets)


def lora_expert_targets(config: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """The routed experts' parameters of ``layer`` an adapter may target, with each one's
    (in, out) features per expert; empty for a dense layer."""
    moe = config.moe
    if moe is None or layer not in moe.sparse_layers:
        return {}
    hidden, inter = config.hidden_size, moe.intermediate_size
    return {EXPERT_GATE_UP: (hidden, 2 * inter), EXPERT_DOWN: (inter, hidden)}


def _module_names(config: ModelConfig) -> frozenset[str]:
    return frozenset([name for i in range(config.num_hidden_layers) for t in lora_targets(config, i)
                      for name, _ in t.slices]
                     + [name for i in range(config.num_hidden_layers) for name in lora_expert_targets(config, i)])


@dataclasses.dataclass(frozen=True, slots=True)
class LoraWeights:
    """An adapter read and checked: per ``(layer, peft module)``, ``A`` [r, in] and
    ``scale * B`` [out, r], fp32 on the host (a MoE layer's experts: ``A`` [E, r, in] and
    ``scale * B`` [E, out, r] under ``EXPERT_GATE_UP`` / ``EXPERT_DOWN``)."""

    name: str
    rank: int
    scale: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.modules.values())


def read_lora_adapter(path: str | Path, name: str, config: ModelConfig, max_rank: int) -> LoraWeights:
    """The adapter in folder ``path`` served as ``name``, checked against the base model
    ``config`` and the rank limit; raises :class:`LoraAdapterError`."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraAdapterError(name, f"{folder} is not a folder (an adapter is a local folder "
                               f"holding {CONFIG_FILE} and {WEIGHTS_FILE})")
    cfg = _read_config(folder, name)
    rank, scale = _rank_and_scale(cfg, name, max_rank)
    for extra in ("added_tokens.json", "new_embeddings.safetensors"):
        if (folder / extra).exists():
            raise LoraAdapterError(name, f"it adds vocabulary ({extra}); adapters with extra "
                                   "tokens are not supported")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        hint = " (adapter_model.bin is a pickle: convert it to safetensors)" if (folder / "adapter_model.bin").exists() else ""
        raise LoraAdapterError(name, f"{weights} is missing{hint}")
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # safetensors raises several kinds for a damaged file
        raise LoraAdapterError(name, f"{weights} cannot be read: {exc}") from None
    return LoraWeights(name, rank, scale, _modules(tensors, config, name, rank, scale, max_rank))


def _read_config(folder: Path, name: str) -> dict:
    file = folder / CONFIG_FILE
    try:
        cfg = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoraAdapterError(name, f"{file} is missing") from None
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(name, f"{file} cannot be read: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoraAdapterError(name, f"{file} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraAdapterError(name, f"peft_type is {peft_type!r}; only LORA adapters are served")
    refusals = (
        ("modules_to_save", "it replaces whole modules (modules_to_save)"),
        ("trainable_token_indices", "it trains token embeddings (extra vocabulary)"),
        ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
    )
    for key, why in refusals:
        if cfg.get(key):
            raise LoraAdapterError(name, why)
    if cfg.get("use_dora"):
        raise LoraAdapterError(name, "DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraAdapterError(name, f"LoRA biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise LoraAdapterError(name, "fan_in_fan_out (GPT-2 style Conv1D weights) is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        vocab = [t for t in targets if str(t).split(".")[-1] in _VOCAB_TARGETS]
        if vocab:
            raise LoraAdapterError(name, f"it targets {', '.join(map(str, vocab))} (extra "
                                   "vocabulary); only the attention and MLP projections are supported")
    return cfg


def _rank_and_scale(cfg: dict, name: str, max_rank: int) -> tuple[int, float]:
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(name, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(name, f"its rank {rank} is above --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraAdapterError(name, f"lora_alpha must be a number, got {alpha!r}")
    # peft's scaling: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA.
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _modules(tensors: dict[str, torch.Tensor], config: ModelConfig, name: str, rank: int,
             scale: float, max_rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            what = "extra vocabulary" if any(v in key for v in _VOCAB_TARGETS) else "an unsupported target"
            raise LoraAdapterError(name, f"tensor {key} is {what}; only the attention (q/k/v/o) "
                                   "and MLP (gate/up/down) projections are supported")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if m.group(2) == "block_sparse_moe" and not _PER_EXPERT.match(module):
            raise LoraAdapterError(name, f"tensor {key} is an unsupported target; only the attention "
                                   "(q/k/v/o) and MLP (gate/up/down) projections are supported")
        parts.setdefault((layer, module), {})[ab] = tensor
    if not parts:
        raise LoraAdapterError(name, "it holds no LoRA weights")
    shapes = {(i, n): (t.in_features, rows) for i in range(config.num_hidden_layers)
              for t in lora_targets(config, i) for n, rows in t.slices}
    experts = {i: lora_expert_targets(config, i) for i in range(config.num_hidden_layers)}
    known = _module_names(config)
    modules = {}
    per_expert: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), pair in sorted(parts.items()):
        where = f"layers.{layer}.{module}"
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(name, f"{where}: the base model has {config.num_hidden_layers} layers")
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(name, f"{where} has lora_{'A' if 'A' in pair else 'B'} without its pair")
        m = _PER_EXPERT.match(module)
        if m is not None:
            if not experts[layer]:
                raise LoraAdapterError(name, f"{where} adapts an expert, but layer {layer} of the base "
                                       "model has no experts")
            per_expert.setdefault(layer, {})[(int(m.group(1)), _PER_EXPERT_PART[m.group(2)])] = \
                (pair["A"], pair["B"])
            continue
        if _EXPERTS.match(module) and experts[layer]:
            target, a, b = _expert_pair(pair["A"], pair["B"], experts[layer], config, name, where, rank, scale)
            if (layer, target) in modules:
                raise LoraAdapterError(name, f"{where}: two pairs fit {target}")
            modules[(layer, target)] = (a, b)
            continue
        if (layer, module) not in shapes:
            why = ("a target of another layer kind (dense or mixture-of-experts)" if module in known
                   or _EXPERTS.match(module) else "not a supported target")
            raise LoraAdapterError(name, f"{where} is {why}; supported: {', '.join(sorted(known))}")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[(layer, module)]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraAdapterError(
                name, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model (expected ({rank}, {fan_in}) and ({fan_out}, {rank}))")
        a, b = a.float(), b.float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraAdapterError(name, f"{where} holds NaN or infinite values")
        modules[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    for layer, pairs in per_expert.items():
        if 2 * rank > max_rank and any(part != "down" for _, part in pairs):
            raise LoraAdapterError(name, f"its per-expert gate and up modules (transformers 4's layout) of "
                                   f"rank {rank} take rank {2 * rank} in the fused experts' slots, above "
                                   f"--max-lora-rank {max_rank}")
        for target, (a, b) in _per_expert_pairs(pairs, config, name, layer, rank, scale).items():
            if (layer, target) in modules:
                raise LoraAdapterError(name, f"layers.{layer}: both per-expert modules and a fused pair fit {target}")
            modules[(layer, target)] = (a, b)
    return modules


def _per_expert_pairs(pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], config: ModelConfig,
                      name: str, layer: int, rank: int, scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """transformers 4's per-expert pairs of one layer (``(expert, "gate"|"up"|"down")`` ->
    ``(A [r, in], B [out, r])``) as the fused experts' pairs: ``A`` [E, r', in] and
    ``scale * B`` [E, out, r'].

    The fused gate/up shares one ``A`` between gate and up; separate gate and up adapters
    are the same as one of rank ``2r`` whose ``A`` stacks both (gate's rows, then up's) and
    whose ``B`` is block diagonal (gate's rows read gate's ``A`` rows only), so that is how
    they are kept: the pool's rank (``--max-lora-rank``) must hold ``2r``. An expert or a
    projection the adapter leaves out gets zeros (no delta)."""
    assert config.moe is not None
    e_count, hidden, inter = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
    fits = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    for (expert, part), (a, b) in pairs.items():
        where = f"layers.{layer}.experts.{expert} ({part})"
        if expert >= e_count:
            raise LoraAdapterError(name, f"{where}: the base model has {e_count} experts")
        fan_in, fan_out = fits[part]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraAdapterError(
                name, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model (expected ({rank}, {fan_in}) and ({fan_out}, {rank}))")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraAdapterError(name, f"{where} holds NaN or infinite values")
    out = {}
    parts = {part for _, part in pairs}
    if parts & {"gate", "up"}:
        a13 = torch.zeros((e_count, 2 * rank, hidden))
        b13 = torch.zeros((e_count, 2 * inter, 2 * rank))
        for (expert, part), (a, b) in pairs.items():
            if part == "down":
                continue
            k = 0 if part == "gate" else 1
            a13[expert, k * rank : (k + 1) * rank] = a.float()
            b13[expert, k * inter : (k + 1) * inter, k * rank : (k + 1) * rank] = b.float() * scale
        out[EXPERT_GATE_UP] = (a13, b13)
    if "down" in parts:
        a2, b2 = torch.zeros((e_count, rank, inter)), torch.zeros((e_count, hidden, rank))
        for (expert, part), (a, b) in pairs.items():
            if part == "down":
                a2[expert], b2[expert] = a.float(), b.float() * scale
        out[EXPERT_DOWN] = (a2, b2)
    return out


def _expert_pair(a: torch.Tensor, b: torch.Tensor, targets: dict[str, tuple[int, int]], config: ModelConfig,
                 name: str, where: str, rank: int, scale: float) -> tuple[str, torch.Tensor, torch.Tensor]:
    """One ParamWrapper pair over a layer's fused experts: which parameter it adapts (by
    shape) and its per-expert ``A`` [E, r, in] and ``scale * B`` [E, out, r]."""
    assert config.moe is not None
    e = config.moe.num_experts
    fits = [(t, i, o) for t, (i, o) in targets.items() if tuple(a.shape) == (e * rank, i) and tuple(b.shape) == (o, e * rank)]
    if not fits:
        want = " or ".join(f"({e * rank}, {i}) and ({o}, {e * rank}) for {t}" for t, (i, o) in targets.items())
        raise LoraAdapterError(name, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                               f"base model's {e} experts (expected {want})")
    target, fan_in, fan_out = fits[0]
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoraAdapterError(name, f"{where} ({target}) holds NaN or infinite values")
    # peft's layout (module docstring): A's rows expert-major, B's columns rank-major.
    a_e = a.reshape(e, rank, fan_in)
    b_e = b.reshape(fan_out, rank, e).permute(2, 0, 1)
    return target, a_e.contiguous(), (b_e * scale).contiguous()


__all__ = ["CONFIG_FILE", "EXPERT_DOWN", "EXPERT_GATE_UP", "LORA_ARCHITECTURES", "WEIGHTS_FILE", "LoraAdapterError",
           "check_lora_model", "LoraTarget", "LoraWeights", "lora_expert_targets", "lora_targets", "read_lora_adapter"]
