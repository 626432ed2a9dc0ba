"""LoRA on a mixture-of-experts model's experts, against peft's ``PeftModel`` (unmerged).

Tiny random Qwen2-MoE (6 experts, top 2, a gated shared expert, every second layer
sparse) and Mixtral (8 experts, top 2, every layer sparse), each with two adapters that
peft writes itself with random A and B: rank 8 (alpha 16) and rank 16 with rsLoRA
(alpha 32), on the attention's q/k/v/o, the dense layers' gate/up/down, Qwen2-MoE's shared
expert and its gate, and the routed experts (peft's ``target_parameters`` over the fused
``experts.gate_up_proj`` and ``experts.down_proj``), A and B drawn at
``SMALL_ADAPTER_STD`` (tests/test_lora.py says why). Both adapters and the base run in one
step of the engine's runner. Each architecture comes in two heads:

* ``:tied``: the embeddings tied to the LM head at std 0.02, as the dense models of
  tests/test_lora.py have them, so logits stay under 1: held to the same 1e-5 of peft's
  fp32 logits at every prompt position (measured: 0.7e-6 on Qwen2-MoE, 1.3e-6 / 3.2e-6 on
  Mixtral with the torch ops / the C kernels);
* untied, an LM head of std 0.5 (``engine.models.testing``'s default for these models):
  logits reach ~17, and with routers of std 1.0 the routing weights follow the last bits of
  their input, so fp32 itself is coarser than 1e-5 there. Measured (largest distance over
  the positions, base / r8 / r16): peft fp32 against peft in float64, 0.6 / 0.7 / 1.3e-5 on
  Qwen2-MoE and 1.8 / 1.2 / 2.8e-5 on Mixtral; transformers' eager attention against its
  SDPA, 0.6 / 0.6 / 0.9e-5 and 2.0 / 0.8 / 2.6e-5; the engine (C kernels) against float64,
  0.6 / 0.8 / 1.7e-5 and 1.1 / 0.8 / 3.0e-5. Held to 5e-5 of peft, the tolerance
  tests/test_lora.py holds its own MoE model to, and to at most twice peft's own fp32
  distance from float64: as accurate as the oracle.

Either way, the same 32 greedy tokens as peft's ``generate``; an adapter's expert deltas
left out moves logits by a thousand times the bound or more, which the test checks it
does, so the bound cannot pass by ignoring the experts.
"""

from __future__ import annotations

import copy
import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from greedy_driver import run_greedy
from lora_ranks import lora_layouts
from safetensors.torch import load_file, save_file
from test_lora import (
    LOGIT_ATOL,
    LOGIT_ATOL_MOE,
    NEW_TOKENS,
    SMALL_ADAPTER_STD,
    _generate,
    _loaded,
    _prompts,
    _runner,
    prefill_logits,
    write_peft_adapters,
)
from text_fixtures import hf_causal_lm
from tp_ranks import run_ranks

from engine.errors import LoraAdapterError
from engine.messages import LoraAdapter
from engine.models.layers.moe import expert_weight_names
from engine.models.lora import EXPERT_DOWN, EXPERT_GATE_UP, read_lora_adapter
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Every linear an adapter may target in these models (the router is not one: transformers
# keeps it as a bare parameter), and the routed experts' two fused parameters.
TARGETS = (r".*\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj"
           r"|mlp\.shared_expert\.(gate|up|down)_proj|mlp\.shared_expert_gate)")
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ADAPTERS = {"r8": dict(r=8, lora_alpha=16, target_parameters=EXPERTS),
            "r16": dict(r=16, lora_alpha=32, use_rslora=True, target_parameters=EXPERTS)}


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral", "qwen2_moe:tied", "mixtral:tied"])
def tiny(request, tmp_path_factory):
    arch, _, head = request.param.partition(":")
    root = tmp_path_factory.mktemp(arch)
    tied = head == "tied"
    folder = write_tiny_model(root / "base", arch, overrides={"tie_word_embeddings": True} if tied else None)
    peft_model = write_peft_adapters(folder, root, ADAPTERS, seed=3, targets=TARGETS, std=SMALL_ADAPTER_STD)
    adapters = {name: LoraAdapter(name, str(root / name), i + 1) for i, name in enumerate(ADAPTERS)}
    loaded = _loaded(folder)
    prompts = _prompts(loaded.config.vocab_size)
    want, tokens = {}, {}
    with torch.inference_mode():
        with peft_model.disable_adapter():
            want[None] = [peft_model(torch.tensor([p])).logits[0] for p in prompts]
            tokens[None] = [_generate(peft_model, p) for p in prompts]
        for name in ADAPTERS:
            peft_model.set_adapter(name)
            want[name] = [peft_model(torch.tensor([p])).logits[0] for p in prompts]
            tokens[name] = [_generate(peft_model, p) for p in prompts]
        want64 = _float64_logits(peft_model, prompts)
    atol = LOGIT_ATOL if tied else LOGIT_ATOL_MOE
    return types.SimpleNamespace(arch=request.param, loaded=loaded, adapters=adapters, prompts=prompts, want=want,
                                 want64=want64, tokens=tokens, root=root, tied=tied, atol=atol, far=1000 * atol)


def _float64_logits(peft_model, prompts: list[list[int]]) -> dict[str | None, list[torch.Tensor]]:
    """peft's logits with every weight and adapter in float64: the reference both fp32
    paths are measured against. transformers' grouped-GEMM experts take no float64, so the
    copy runs its plain per-expert loop."""
    model = copy.deepcopy(peft_model).double()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
    out: dict[str | None, list[torch.Tensor]] = {}
    with model.disable_adapter():
        out[None] = [model(torch.tensor([p])).logits[0] for p in prompts]
    for name in ADAPTERS:
        model.set_adapter(name)
        out[name] = [model(torch.tensor([p])).logits[0] for p in prompts]
    return out


def test_the_adapters_adapt_every_expert_and_the_shared_expert(tiny) -> None:
    config = tiny.loaded.config
    for name in ADAPTERS:
        weights = read_lora_adapter(tiny.adapters[name].path, name, config, 16)
        for layer in config.moe.sparse_layers:
            a, b = weights.modules[(layer, EXPERT_GATE_UP)]
            assert a.shape[0] == b.shape[0] == config.moe.num_experts
            assert (layer, EXPERT_DOWN) in weights.modules
            if config.moe.shared_expert_intermediate_size:
                assert {(layer, "shared_expert.down_proj"), (layer, "shared_expert_gate")} <= weights.modules.keys()


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_logits_at_every_position_match_peft(tiny, ops) -> None:
    runner = _runner(tiny.loaded, ops)
    names = [None, "r8", "r16"]
    prompts = [p for p in tiny.prompts for _ in names]
    loras = [None if n is None else tiny.adapters[n] for _ in tiny.prompts for n in names]
    got = prefill_logits(runner, prompts, loras)
    worst = 0.0
    for i, g in enumerate(got):
        name, p = names[i % len(names)], i // len(names)
        worst = max(worst, (g - tiny.want[name][p]).abs().max().item())
        torch.testing.assert_close(g, tiny.want[name][p], atol=tiny.atol, rtol=0,
                                   msg=lambda m, n=name: f"adapter {n}: {m}")
    print(f"{tiny.arch} {ops}: max |logit - peft| {worst:.2e}")
    # Large logits: as accurate as peft's own fp32, both measured against peft in float64.
    for name in names if not tiny.tied else ():
        ours = max((g - tiny.want64[name][i // len(names)]).abs().max().item()
                   for i, g in enumerate(got) if names[i % len(names)] == name)
        peft_fp32 = max((w - w64).abs().max().item() for w, w64 in zip(tiny.want[name], tiny.want64[name], strict=True))
        assert 0.0 < ours <= 2 * peft_fp32, f"adapter {name}: {ours:.2e} from float64, peft's fp32 {peft_fp32:.2e}"
    for name in ADAPTERS:  # the adapters change the model (else the check above could not fail)
        assert (tiny.want[name][2] - tiny.want[None][2]).abs().max() > tiny.far
    # The experts' deltas matter: the same adapter with its expert pairs zeroed is far off.
    for name in ADAPTERS:
        weights = runner.lora.load(tiny.adapters[name])
        saved = {k: v for k, v in weights.modules.items() if k[1] in (EXPERT_GATE_UP, EXPERT_DOWN)}
        try:
            for key, (a, b) in saved.items():
                weights.modules[key] = (a, torch.zeros_like(b))
            fresh = _runner(tiny.loaded, ops)
            fresh.lora._host[tiny.adapters[name].id] = weights
            (off,) = prefill_logits(fresh, [tiny.prompts[2]], [tiny.adapters[name]])
        finally:
            weights.modules.update(saved)
        assert (off - tiny.want[name][2]).abs().max() > tiny.far


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_match_peft(tiny, ops) -> None:
    runner = _runner(tiny.loaded, ops)
    names = [None, "r8", "r16"]
    prompts = [p for p in tiny.prompts for _ in names]
    loras = [None if n is None else tiny.adapters[n] for _ in tiny.prompts for n in names]
    runs = run_greedy(runner, prompts, NEW_TOKENS, chunk_size=5, block_size=4, loras=loras)
    for i, run in enumerate(runs):
        name, p = names[i % len(names)], i // len(names)
        assert [s.token_id for s in run] == tiny.tokens[name][p], f"adapter {name}, prompt {p}"


PER_EXPERT_RANK = 4  # gate and up take twice that in the fused experts' slots (16)


def _write_per_expert_adapter(tiny, out: Path) -> tuple[Path, float]:
    """An adapter in transformers 4's layout (an nn.Linear per expert: Qwen's
    ``mlp.experts.N.gate_proj/up_proj/down_proj``, Mixtral's ``block_sparse_moe.experts.N.
    w1/w3/w2``) over every expert of every sparse layer, expert 1's up projection left out;
    then the base model with each ``scale * B @ A`` merged into its expert weights, the
    oracle (transformers over merged weights: no peft involved)."""
    config = tiny.loaded.config
    moe, r, alpha = config.moe, PER_EXPERT_RANK, 8
    hidden, inter = config.hidden_size, moe.intermediate_size
    weights = load_file(str(tiny.root / "base" / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in moe.sparse_layers:
        for e in range(moe.num_experts):
            for name, (fan_in, fan_out) in zip(expert_weight_names(moe, layer, e),
                                               ((hidden, inter), (hidden, inter), (inter, hidden)), strict=True):
                if e == 1 and name.endswith(("up_proj.weight", "w3.weight")):
                    continue
                a = torch.randn(r, fan_in, generator=g) * SMALL_ADAPTER_STD
                b = torch.randn(fan_out, r, generator=g) * SMALL_ADAPTER_STD
                stem = "base_model.model." + name.removesuffix(".weight")
                tensors[stem + ".lora_A.weight"], tensors[stem + ".lora_B.weight"] = a, b
                weights[name] = weights[name] + (alpha / r) * b @ a
    (out / "adapter").mkdir(parents=True)
    save_file(tensors, str(out / "adapter" / "adapter_model.safetensors"))
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["gate_proj", "up_proj", "down_proj",
                                                                            "w1", "w3", "w2"]}))
    merged = out / "merged"
    shutil.copytree(tiny.root / "base", merged)
    save_file(weights, str(merged / "model.safetensors"), metadata={"format": "pt"})
    return out / "adapter", merged


def test_per_expert_adapters_of_transformers_4_match_the_merged_experts(tiny, tmp_path) -> None:
    adapter, merged = _write_per_expert_adapter(tiny, tmp_path)
    hf = hf_causal_lm(merged)
    with torch.inference_mode():
        want = [hf(torch.tensor([p])).logits[0] for p in tiny.prompts]
    lora = LoraAdapter("old", str(adapter), 1)
    got = prefill_logits(_runner(tiny.loaded, "cpu"), tiny.prompts, [lora] * len(tiny.prompts))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=tiny.atol, rtol=0, msg=lambda m, i=i: f"prompt {i}: {m}")
    # The adapter changes the model (else the check above could not fail).
    assert (want[2] - tiny.want[None][2]).abs().max() > tiny.far


def test_per_expert_gate_and_up_take_twice_the_rank(tiny, tmp_path) -> None:
    adapter, _ = _write_per_expert_adapter(tiny, tmp_path)
    weights = read_lora_adapter(adapter, "old", tiny.loaded.config, 2 * PER_EXPERT_RANK)
    layer = tiny.loaded.config.moe.sparse_layers[0]
    a, b = weights.modules[(layer, EXPERT_GATE_UP)]
    assert a.shape[1] == b.shape[2] == 2 * PER_EXPERT_RANK
    with pytest.raises(LoraAdapterError, match="max-lora-rank"):
        read_lora_adapter(adapter, "old", tiny.loaded.config, 2 * PER_EXPERT_RANK - 1)


def test_two_tensor_parallel_ranks_match_peft(tiny) -> None:
    """At ``-tp 2`` each rank's expert pools hold its half of every expert's intermediate
    rows (B's gate and up rows, A's down columns) and the shared expert is cut as a dense
    MLP, its gate whole: both ranks' logits and greedy tokens are peft's, for the base and
    both adapters in the same steps."""
    names = [None, "r8", "r16"]
    runs = [(p, None if n is None else tiny.adapters[n]) for p in tiny.prompts for n in names]
    config = tiny.loaded.config
    ranks = run_ranks(lora_layouts, 2, [(2, 1)], [(tiny.arch, str(tiny.root / "base"), runs)],
                      config.num_hidden_layers)
    inter, hidden, experts = config.moe.intermediate_size, config.hidden_size, config.moe.num_experts
    for rank, result in enumerate(ranks):
        logits, tokens, held = result[(2, 1)][tiny.arch]
        a13, b13, a2, b2 = held["experts"]
        assert (a13[0], a13[-1], b13[-1]) == (experts, hidden, inter)  # gate/up: B's rows of half of each
        assert (a2[-1], b2[-1]) == (inter // 2, hidden)  # down: A's columns of half, B whole
        assert tokens == [tiny.tokens[n][i // len(names)] for i, n in enumerate(names * len(tiny.prompts))]
        for i, got in enumerate(logits):
            name = names[i % len(names)]
            torch.testing.assert_close(got, tiny.want[name][i // len(names)], atol=tiny.atol, rtol=0,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, adapter {n}: {m}")


def test_two_pipeline_stages_match_peft(tiny) -> None:
    """At ``-pp 2`` each stage holds its own layers' expert pools (the routed experts' pairs
    kept whole on one rank, ``LoraSlots.cut``): the last stage's logits and every stage's greedy tokens
    are peft's, for the base and both adapters in the same steps."""
    names = [None, "r8", "r16"]
    runs = [(p, None if n is None else tiny.adapters[n]) for p in tiny.prompts for n in names]
    layers = tiny.loaded.config.num_hidden_layers
    ranks = run_ranks(lora_layouts, 2, [(1, 2)], [(tiny.arch, str(tiny.root / "base"), runs)], layers)
    for rank, result in enumerate(ranks):
        logits, tokens, held = result[(1, 2)][tiny.arch]
        assert held["layers"] == list(range(rank * layers // 2, (rank + 1) * layers // 2))
        assert tokens == [tiny.tokens[n][i // len(names)] for i, n in enumerate(names * len(tiny.prompts))]
        if rank == 0:
            assert logits is None
            continue
        for i, got in enumerate(logits):
            name = names[i % len(names)]
            torch.testing.assert_close(got, tiny.want[name][i // len(names)], atol=tiny.atol, rtol=0,
                                       msg=lambda m, n=name: f"adapter {n}: {m}")


def test_a_gguf_base_whose_experts_stay_in_blocks_matches_peft_on_the_dequantized_model(tmp_path, monkeypatch) -> None:
    """A Q8_0 Qwen2-MoE GGUF keeps its experts' blocks (``QuantizedExperts``); an adapter
    over its experts runs beside them (the LoRA path's per-expert matmuls through qmatmul
    on the expert's blocks, the base's pairs through the C kernel), against peft over
    the same file dequantized, as tests/test_lora.py holds a dense GGUF base: over the C
    kernels within KERNEL_LOGIT_SPAN of each row's range (int8 activations), and a base row
    the adapter's expert deltas would move by far more."""
    from test_quant_models import KERNEL_LOGIT_SPAN, write_quantized

    from engine.models.loader import load_model
    from engine.ops.quant import QuantizedExperts

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_quantized(tmp_path, "qwen2_moe", "Q8_0")
    kept = load_model(path, dtype="float32")
    dense = load_model(path, dtype="float32", quantization="none")
    # The routed experts alone (and the shared expert's one-row gate, as peft wants a module),
    # at a std that lets their deltas move the logits well past the bound.
    peft_model = write_peft_adapters(dense.folder, tmp_path, {"r8": ADAPTERS["r8"]}, seed=5,
                                     targets=r".*\.mlp\.shared_expert_gate", std=0.1)
    adapter = LoraAdapter("r8", str(tmp_path / "r8"), 1)
    prompts = _prompts(kept.config.vocab_size)
    with torch.inference_mode():
        want = [peft_model(torch.tensor([p])).logits[0] for p in prompts]
    runner = _runner(kept, "cpu")
    assert all(isinstance(layer.moe.w13, QuantizedExperts) for layer in runner.model.layers if layer.moe is not None)
    got = prefill_logits(runner, prompts + prompts, [adapter] * len(prompts) + [None] * len(prompts))
    moved = 0.0
    for g, base, w in zip(got, got[len(prompts):], want, strict=False):
        span = (w.amax(-1) - w.amin(-1)).unsqueeze(-1)
        assert float(((g - w).abs() / span).max()) <= KERNEL_LOGIT_SPAN
        moved = max(moved, float(((base - w).abs() / span).max()))
    assert moved > 4 * KERNEL_LOGIT_SPAN  # the adapter's deltas are not within the bound
