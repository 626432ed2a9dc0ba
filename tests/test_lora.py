"""LoRA adapters in the model and the runner, against peft's ``PeftModel`` (unmerged).

For tiny random Llama, Qwen2, Gemma, Gemma 2, Granite and Qwen2-MoE models, two adapters per model are
written by peft itself (``save_pretrained``) with random A and B: rank 8 (alpha 16) and
rank 16 with rsLoRA scaling (alpha 32), on every target the model has: q/k/v/o and the
dense MLP's gate/up/down (the MoE's sparse layers have no dense MLP; their experts and
shared expert are tests/test_lora_moe.py's). Each adapter and the base model then run in one step of the engine's runner:

* fp32 logits at every prompt position within 1e-5 of peft's: both sides compute in fp32
  and differ in summation order only (fused q/k/v and gate/up, the scale folded into B,
  paged attention); measured at most ~4e-6 on logits up to ~10. The tiny Qwen2-MoE is held
  to 5e-5: its logits reach 17 (fp32 spacing 2e-6 there) and its routed experts sum in
  their own order; its base model alone is 8e-6 from transformers, and with the rank-16
  adapter up to 3.2e-5 was measured (C kernels). peft's own fp32 logits are 1.3e-5 from
  its float64 ones on this model, so 1e-5 is below what fp32 can hold here
  (tests/test_lora_moe.py measures both against float64). A missed slice, a wrong scale
  (alpha / r against alpha / sqrt(r)) or another slot's weights move logits by O(0.1);
* the same 32 greedy tokens as peft's ``generate``.

A step of four adapters and the base gives each request the logits it gets alone; a GGUF
base with an adapter matches peft over the dequantized model within the GGUF tests'
tolerances (tests/test_quant_models.py); bad adapters are refused with their reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import types
from pathlib import Path

import pytest
import torch
import trio
from greedy_driver import run_greedy
from safetensors.torch import load_file, save_file
from test_parity import LOGIT_ATOL_FP32
from test_quant_models import KERNEL_LOGIT_SPAN, write_quantized
from text_fixtures import hf_causal_lm

import engine
from engine.cli.args import add_engine_arguments, config_from_args
from engine.config import EngineConfig
from engine.core import BlockPool, Scheduler, SchedulerConfig, run_with_pool
from engine.core.admission import prefix_salt
from engine.errors import ConfigError, InvalidParamError, LoraAdapterError, UnsupportedModelError
from engine.messages import (
    AdmittedRequest,
    LoraAdapter,
    NewRequest,
    ScheduledChunk,
    SchedulerRequest,
    StepPlan,
)
from engine.models.config import ModelConfig
from engine.models.layers.linear import QuantLinear
from engine.models.loader import load_model
from engine.models.lora import check_lora_model, read_lora_adapter
from engine.models.testing import write_tiny_model
from engine.ops import get_ops
from engine.ops.cpu import qmatmul as cq
from engine.params import SamplingParams
from engine.process.cores import CorePool, CoreState
from engine.runner.lora import LoraSettings
from engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")

LOGIT_ATOL = 1e-5  # see the module docstring
LOGIT_ATOL_MOE = 5e-5
# The MoE model's and the tiny Gemma 1's (its q/k/v twice as wide, head_dim 32) random A
# and B (and, in tests/test_lora_parallel.py, Phi-3's) are drawn at half the others' 0.1: there the rank-16 rsLoRA adapter (scale 8) at 0.1 outweighs the base
# weights about fourfold, and the model amplifies any change in the order of fp32 sums (the
# AVX-512 shrink's lane tree against the portable loop's) to ~5e-5 in logits of ~17; at 0.05
# the adapters still move logits by O(1) (the checks below).
SMALL_ADAPTER_STD = 0.05
NEW_TOKENS = 32
ARCHS = ("llama", "qwen2", "gemma", "gemma2", "granite", "qwen2_moe")
# Every projection an adapter may target, as a regex peft matches against full module
# names: the MLP's only where it sits right under ``mlp`` (a dense layer), so a MoE's
# experts and shared expert are left out.
TARGETS = r".*\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
ADAPTERS = {"r8": dict(r=8, lora_alpha=16), "r16": dict(r=16, lora_alpha=32, use_rslora=True)}


def _hf(folder: Path):
    model = hf_causal_lm(folder)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_peft_adapters(base: Path, out: Path, specs: dict[str, dict], seed: int = 0, targets: str = TARGETS,
                        std: float = 0.1):
    """peft adapters over the transformers model in ``base``, with random A and B of
    standard deviation ``std`` (peft starts B at zero: an adapter that changes nothing),
    saved to ``out/<name>``; returns the PeftModel holding them all."""
    from peft import LoraConfig, get_peft_model

    model = None
    g = torch.Generator().manual_seed(seed)
    for name, spec in specs.items():
        config = LoraConfig(target_modules=targets, lora_dropout=0.0, **spec)
        if model is None:
            model = get_peft_model(_hf(base), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".lora_" in pname:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    for name in specs:
        model.save_pretrained(out / "tmp", selected_adapters=[name])
        saved = out / "tmp" / name if (out / "tmp" / name).is_dir() else out / "tmp"
        shutil.move(str(saved), str(out / name))
        shutil.rmtree(out / "tmp", ignore_errors=True)
    return model.eval()


def _loaded(folder: Path, dtype: torch.dtype = torch.float32):
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return types.SimpleNamespace(config=config, weights=load_file(str(folder / "model.safetensors")), dtype=dtype)


def _runner(loaded, ops: str, *, max_loras: int = 4, max_rank: int = 16) -> ModelRunner:
    return ModelRunner(loaded, device="cpu", ops=get_ops(ops), num_blocks=128, block_size=4,
                       max_num_batched_tokens=512, max_num_seqs=16,
                       lora=LoraSettings(max_loras, max_rank, max_loras + 1, loaded.dtype))


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4321)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 9, 23)]


def prefill_logits(runner: ModelRunner, prompts: list[list[int]], loras: list) -> list[torch.Tensor]:
    """fp32 logits at every position of each prompt, all prompts prefilled whole in one
    step, each with its adapter: the runner's own batch and LoRA table."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    ids = [f"p{i}" for i in range(len(prompts))]
    runner.execute(StepPlan(0, tuple(NewRequest(r, tuple(p), params, (), lora=a)
                                     for r, p, a in zip(ids, prompts, loras, strict=True)), (), ()))
    chunks, start = [], 0
    for r, p in zip(ids, prompts, strict=True):
        n = -(-len(p) // runner.block_size)
        chunks.append(ScheduledChunk(r, 0, len(p), tuple(range(start, start + n)), False))
        start += n
    states = [runner._state(c) for c in chunks]
    input_ids, positions, meta, _ = runner._batch.prepare(chunks, states)
    with runner._lora_step(chunks, states):
        hidden = runner.model.forward(input_ids, positions, meta, runner.kv_caches)
    logits = runner.model.compute_logits(hidden).split([len(p) for p in prompts])
    runner.execute(StepPlan(1, (), (), tuple(ids)))
    return list(logits)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = write_tiny_model(root / "base", request.param)
    std = SMALL_ADAPTER_STD if request.param in ("qwen2_moe", "gemma") else 0.1
    peft_model = write_peft_adapters(folder, root, ADAPTERS, std=std)
    adapters = {name: LoraAdapter(name, str(root / name), i + 1) for i, name in enumerate(ADAPTERS)}
    loaded = _loaded(folder)
    prompts = _prompts(loaded.config.vocab_size)
    want: dict[str | None, list[torch.Tensor]] = {}
    tokens: dict[str | None, list[list[int]]] = {}
    with torch.inference_mode():
        for name in (None, *ADAPTERS):
            if name is None:
                with peft_model.disable_adapter():
                    want[None] = [peft_model(torch.tensor([p])).logits[0] for p in prompts]
                    tokens[None] = [_generate(peft_model, p) for p in prompts]
            else:
                peft_model.set_adapter(name)
                want[name] = [peft_model(torch.tensor([p])).logits[0] for p in prompts]
                tokens[name] = [_generate(peft_model, p) for p in prompts]
    return types.SimpleNamespace(loaded=loaded, adapters=adapters, prompts=prompts, want=want, tokens=tokens)


def _generate(model, prompt: list[int]) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_logits_at_every_position_match_peft(tiny, ops) -> None:
    runner = _runner(tiny.loaded, ops)
    # The base and both adapters in one step: each prompt runs under each of them.
    names = [None, "r8", "r16"]
    prompts = [p for p in tiny.prompts for _ in names]
    loras = [None if n is None else tiny.adapters[n] for _ in tiny.prompts for n in names]
    got = prefill_logits(runner, prompts, loras)
    for i, g in enumerate(got):
        name, p = names[i % len(names)], i // len(names)
        atol = LOGIT_ATOL_MOE if tiny.loaded.config.moe is not None else LOGIT_ATOL
        torch.testing.assert_close(g, tiny.want[name][p], atol=atol, rtol=0,
                                   msg=lambda m, n=name: f"adapter {n}: {m}")
    # The adapters change the model (else the check above could not fail).
    for name in ADAPTERS:
        # O(0.1) before Granite's division of its logits by logits_scaling (8 here).
        assert (tiny.want[name][2] - tiny.want[None][2]).abs().max() > 0.1 / tiny.loaded.config.logits_scaling


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
    assert runner.lora.loads == len(ADAPTERS)  # read once each, then held


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    folder = write_tiny_model(root / "base", "llama")
    specs = {f"a{i}": dict(r=8 if i % 2 else 16, lora_alpha=16) for i in range(4)}
    write_peft_adapters(folder, root, specs, seed=7)
    return _loaded(folder), [LoraAdapter(n, str(root / n), i + 1) for i, n in enumerate(specs)]


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_a_step_of_four_adapters_and_the_base_gives_each_request_its_solo_logits(four, ops) -> None:
    loaded, adapters = four
    prompts = _prompts(loaded.config.vocab_size)
    prompts = [prompts[i % 3] for i in range(5)]
    loras = [*adapters, None]
    runner = _runner(loaded, ops, max_loras=4)
    mixed = prefill_logits(runner, prompts, loras)
    for p, a, m in zip(prompts, loras, mixed, strict=True):
        solo = prefill_logits(_runner(loaded, ops, max_loras=4), [p], [a])[0]
        torch.testing.assert_close(m, solo, atol=1e-6, rtol=0)
    # Four adapters and the base give five different answers.
    tails = [m[-1] for m in mixed]
    assert all((tails[i] - tails[j]).abs().max() > 0.01 for i in range(5) for j in range(i) if prompts[i] == prompts[j])
    # The decode steps (the fused C step where no adapter runs) as well: greedy tokens of the
    # mixed batch are each request's solo tokens.
    runs = run_greedy(_runner(loaded, ops), prompts, 8, block_size=4, loras=loras)
    for p, a, run in zip(prompts, loras, runs, strict=True):
        (solo,) = run_greedy(_runner(loaded, ops), [p], 8, block_size=4, loras=[a])
        assert [s.token_id for s in run] == [s.token_id for s in solo]


def test_bf16_slots_hold_b_as_row_pairs_and_give_the_unpaired_logits(four, monkeypatch) -> None:
    """In bf16 on a CPU with AVX512-BF16 the adapter slots hold B as row pairs, which the
    kernel's dot products load as they are; with the pairs turned off, the kernel
    interleaves each two rows itself at every step. The same mixed step (four adapters and
    the base) must give the same logits to the bit either way."""
    loaded, adapters = four
    loaded = types.SimpleNamespace(**{**vars(loaded), "dtype": torch.bfloat16})
    prompts = _prompts(loaded.config.vocab_size)
    prompts = [prompts[i % 3] for i in range(5)]
    loras = [*adapters, None]
    paired = _runner(loaded, "cpu", max_loras=4)
    assert paired.model.lora.pairs  # the dev and CI CPUs have AVX512-BF16
    got = prefill_logits(paired, prompts, loras)
    monkeypatch.setattr(type(get_ops("cpu")), "lora_pairs", lambda self, dtype: False)
    plain = _runner(loaded, "cpu", max_loras=4)
    assert not plain.model.lora.pairs and plain.model.lora.wrappers[0]["qkv"].b.dim() == 3
    want = prefill_logits(plain, prompts, loras)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert (got[1][-1] - got[4][-1]).abs().max() > 0.01  # same prompt: adapter a1 against the base


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_a_step_verifying_proposals_gives_each_request_its_adapter(four, ops) -> None:
    """A chunk verifying a proposal holds it within ``num_tokens`` (the rows past the
    request's known tokens): the step's LoRA table counts the flat batch's rows as the batch
    lays them out, or every later request's rows take a neighbour's slot. Each request's
    logits in a mixed step with proposals are those it gets alone."""
    loaded, adapters = four
    prompts = _prompts(loaded.config.vocab_size)
    loras = [adapters[0], None, adapters[1]]
    proposal = (5, 6)

    def logits(which: list[int]) -> list[torch.Tensor]:
        runner = _runner(loaded, ops, max_loras=4)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        runner.execute(StepPlan(0, tuple(NewRequest(f"p{i}", tuple(prompts[i]), params, (), lora=loras[i])
                                         for i in which), (), ()))
        chunks, start = [], 0
        for i in which:
            rows = len(prompts[i]) + len(proposal)
            n = -(-rows // runner.block_size)
            chunks.append(ScheduledChunk(f"p{i}", 0, rows, tuple(range(start, start + n)), True,
                                         draft_token_ids=proposal))
            start += n
        states = [runner._state(c) for c in chunks]
        input_ids, positions, meta, _ = runner._batch.prepare(chunks, states)
        with runner._lora_step(chunks, states):
            hidden = runner.model.forward(input_ids, positions, meta, runner.kv_caches)
        return list(runner.model.compute_logits(hidden).split([len(prompts[i]) + len(proposal) for i in which]))

    mixed = logits([0, 1, 2])
    for i, m in enumerate(mixed):
        torch.testing.assert_close(m, logits([i])[0], atol=1e-6, rtol=0)


def test_slots_are_reused_least_recently_used_first(four) -> None:
    loaded, adapters = four
    runner = _runner(loaded, "cpu", max_loras=2)
    prompt = _prompts(loaded.config.vocab_size)[1]
    want = {a.name: prefill_logits(_runner(loaded, "cpu"), [prompt], [a])[0] for a in adapters}
    buffers = [w.a.data_ptr() for layer in runner.lora.slots.wrappers for w in layer.values()]
    for a in [*adapters, *adapters[:2]]:  # 6 steps over 2 slots: each adapter evicts one
        (got,) = prefill_logits(runner, [prompt], [a])
        torch.testing.assert_close(got, want[a.name], atol=1e-6, rtol=0)
    # No step reallocated a slot: the same buffers throughout.
    assert buffers == [w.a.data_ptr() for layer in runner.lora.slots.wrappers for w in layer.values()]
    assert runner.lora.slot_writes == 6
    # --max-cpu-loras (3 here): the fourth adapter evicted the least recently used copy.
    assert runner.lora.loads > len(adapters)


# -- refusals ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    folder = write_tiny_model(root / "base", "llama")
    write_peft_adapters(folder, root, {"ok": dict(r=8, lora_alpha=16)}, seed=3)
    return root, _loaded(folder).config


def _variant(root: Path, tmp: Path, name: str, *, config=None, tensors=None, extra=None) -> Path:
    out = tmp / name
    shutil.copytree(root / "ok", out)
    if config is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps(config(cfg)))
    if tensors is not None:
        t = load_file(str(out / "adapter_model.safetensors"))
        save_file(tensors(t), str(out / "adapter_model.safetensors"))
    if extra is not None:
        (out / extra).write_text("{}")
    return out


def _nan(t):
    key = next(k for k in t if k.endswith("q_proj.lora_B.weight"))
    t[key] = t[key].clone()
    t[key][0, 0] = float("nan")
    return t


def _wide(t):
    key = next(k for k in t if k.endswith("v_proj.lora_B.weight"))
    t[key] = torch.zeros(t[key].shape[0] * 2, t[key].shape[1])
    return t


def _lm_head(t):
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    return t


REFUSALS = {
    "missing": (dict(), "is not a folder"),
    "rank": (dict(config=lambda c: c | {"r": 32}), "above --max-lora-rank 16"),
    "nan": (dict(tensors=_nan), "NaN"),
    "shape": (dict(tensors=_wide), "do not fit the base model"),
    "vocab": (dict(extra="added_tokens.json"), "adds vocabulary"),
    "modules_to_save": (dict(config=lambda c: c | {"modules_to_save": ["lm_head"]}), "modules_to_save"),
    "lm_head": (dict(tensors=_lm_head), "extra vocabulary"),
    "dora": (dict(config=lambda c: c | {"use_dora": True}), "DoRA"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_adapters_are_refused_with_their_reason(one, tmp_path, case) -> None:
    root, config = one
    read_lora_adapter(root / "ok", "ok", config, 16)  # the unchanged adapter reads
    options, reason = REFUSALS[case]
    path = tmp_path / "absent" if case == "missing" else _variant(root, tmp_path, case, **options)
    with pytest.raises(LoraAdapterError, match=reason) as info:
        read_lora_adapter(path, case, config, 16)
    assert case in str(info.value)  # the message names the adapter


def test_a_request_whose_adapter_is_gone_fails_alone(one, tmp_path) -> None:
    root, _ = one
    folder = root / "base"
    runner = _runner(_loaded(folder), "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    gone = LoraAdapter("gone", str(tmp_path / "nowhere"), 9)
    result = runner.execute(StepPlan(0, (NewRequest("bad", (5, 6), params, (), lora=gone),
                                         NewRequest("good", (5, 6), params, ())),
                                     (ScheduledChunk("bad", 0, 2, (0,), True),
                                      ScheduledChunk("good", 0, 2, (1,), True)), ()))
    assert [f.sample_id for f in result.failed] == ["bad"] and "gone" in result.failed[0].reason
    assert [s.sample_id for s in result.sampled] == ["good"]


# -- a GGUF base --------------------------------------------------------------------------


def test_a_gguf_base_with_an_adapter_matches_peft_on_the_dequantized_model(tmp_path, monkeypatch) -> None:
    """The base's Q8_0 blocks stay blocks (the adapter runs beside the quantized matmul, in
    the activations' dtype); peft runs over the same file dequantized (the loader's
    converted folder). Tolerances are tests/test_quant_models.py's: over the torch reference
    matmul, fp32 summation order (LOGIT_ATOL_FP32); over the C kernels, which round
    activations to int8 per 32 columns as llama.cpp does, KERNEL_LOGIT_SPAN of each row's
    range."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_quantized(tmp_path, "llama", "Q8_0")
    kept = load_model(path, dtype="float32")
    dense = load_model(path, dtype="float32", quantization="none")
    peft_model = write_peft_adapters(dense.folder, tmp_path, {"ad": dict(r=8, lora_alpha=16)}, seed=5)
    adapter = LoraAdapter("ad", str(tmp_path / "ad"), 1)
    prompts = _prompts(kept.config.vocab_size)
    with torch.inference_mode():
        want = [peft_model(torch.tensor([p])).logits[0] for p in prompts]
        with peft_model.disable_adapter():
            base = [peft_model(torch.tensor([p])).logits[0] for p in prompts]
    assert max((w - b).abs().max() for w, b in zip(want, base, strict=True)) > 0.1
    runner = _runner(kept, "cpu")
    assert all(isinstance(layer.qkv.base, QuantLinear) for layer in runner.model.layers)
    got = prefill_logits(runner, prompts, [adapter] * len(prompts))
    for g, w in zip(got, want, strict=True):
        span = (w.amax(-1) - w.amin(-1)).unsqueeze(-1)
        assert float(((g - w).abs() / span).max()) <= KERNEL_LOGIT_SPAN
    monkeypatch.setattr(cq, "available", lambda: False)  # the torch reference matmul
    got = prefill_logits(_runner(kept, "cpu"), prompts, [adapter] * len(prompts))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=LOGIT_ATOL_FP32, rtol=0)


# The fused CPU decode step with adapters: dense fp32, a GGUF base in bf16 whose q/k/v carry
# biases (the adapter's delta goes on after the quantized matmul's bias, as LoraLinear adds
# it to QuantLinear's output), Gemma 2's layer, and a MoE whose sparse MLPs run between C calls.
FUSED_CASES = [("llama", "dense", "float32"), ("qwen2", "Q4_1", "bfloat16"), ("gemma2", "Q8_0", "bfloat16"),
               ("qwen2_moe", "dense", "float32"), ("qwen2_moe", "Q8_0", "float32")]


@pytest.mark.parametrize(("arch", "quant", "dtype"), FUSED_CASES, ids=["-".join(c) for c in FUSED_CASES])
def test_decode_steps_with_adapters_run_fused_and_match_the_unfused_forward(tmp_path, monkeypatch, arch, quant,
                                                                           dtype) -> None:
    """The fused step adds each targeted projection's delta where LoraLinear does, with the
    same kernel, so a mixed batch of two adapters and the base decodes the same tokens with
    the same logprobs, to the bit, fused and unfused; and the fused step did run."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    if quant == "dense":
        folder = write_tiny_model(tmp_path / "base", arch)
        loaded = _loaded(folder, getattr(torch, dtype))
    else:
        path = write_quantized(tmp_path, arch, quant)
        loaded = load_model(path, dtype=dtype)
        folder = load_model(path, dtype="float32", quantization="none").folder
    specs = {"a0": dict(r=8, lora_alpha=16), "a1": dict(r=16, lora_alpha=32, use_rslora=True)}
    write_peft_adapters(folder, tmp_path, specs, seed=11)
    a0, a1 = (LoraAdapter(n, str(tmp_path / n), i + 1) for i, n in enumerate(specs))
    prompts = [p for p in _prompts(loaded.config.vocab_size) for _ in range(3)]
    loras = [a0, None, a1] * 3
    runs = {}
    for fuse in ("0", "1"):
        monkeypatch.setenv("ENGINE_FUSED_DECODE", fuse)
        runner = _runner(loaded, "cpu")
        runs[fuse] = run_greedy(runner, prompts, 8, block_size=4, loras=loras)
        step = runner.model.fused_step
        assert (step is not None and step.steps >= 7) == (fuse == "1")
    assert [[(s.token_id, s.logprob) for s in r] for r in runs["1"]] == \
        [[(s.token_id, s.logprob) for s in r] for r in runs["0"]]
    # The adapters changed the tokens (else a step that dropped the deltas could pass).
    tokens = [[s.token_id for s in r] for r in runs["1"]]
    assert any(tokens[i] != tokens[i + 1] for i in range(0, 9, 3))
    assert any(tokens[i + 2] != tokens[i + 1] for i in range(0, 9, 3))


# -- the scheduler and the embedded API ----------------------------------------------------


def test_the_scheduler_keeps_the_running_adapters_within_max_loras() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, max_model_len=128,
                                      num_kv_blocks=64, max_loras=2))
    pool = BlockPool(64, 4)
    a, b, c = (LoraAdapter(n, "/nowhere", i) for i, n in enumerate("abc", 1))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for rid, lora in (("r-a", a), ("r-b", b), ("r-c", c), ("r-a2", a), ("r-base", None)):
        sched.add_request(SchedulerRequest(rid, (5, 6, 7), params, (), 4, 0, 0.0, prefix_salt(None, lora), None,
                                           lora=lora))
    plan = run_with_pool(sched.schedule(), pool)
    started = {n.sample_id: n.lora for n in plan.new_requests}
    # c would be a third adapter: it waits; a's second request and the base request start.
    assert set(started) == {"r-a", "r-b", "r-a2", "r-base"}
    assert started["r-a"] == a and started["r-base"] is None
    # The same prompt under a and b shares no prefix-cache block: their keys differ.
    assert prefix_salt(None, a) != prefix_salt(None, b) != prefix_salt(None, None)
    assert prefix_salt("\0l1\x1f", None) != prefix_salt(None, a)  # no client salt spells an adapter's


async def test_the_embedded_api_runs_adapters_and_speculation_keeps_their_tokens(one) -> None:
    root, _ = one
    prompt = "the quick brown fox the quick brown fox the quick"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    answers = []
    for spec in (None, json.dumps({"method": "ngram", "num_speculative_tokens": 3})):
        async with engine.open_engine(root / "base", dtype="float32", enable_lora=True,
                                      lora_modules=[f"ok={root / 'ok'}"], kv_cache_memory=2**24,
                                      speculative_config=spec) as eng:
            got = {}
            for lora in (None, "ok"):
                got[lora] = [t async for out in eng.generate(prompt, params, lora=lora) for t in out.token_ids]
            with pytest.raises(LoraAdapterError, match="no adapter of that name"):
                await eng.submit(prompt, params, lora="missing")
            for lora in (None, "ok"):  # chat turns too
                result = await eng.chat([{"role": "user", "content": prompt}], params, lora=lora)
                got[f"chat-{lora}"] = result.choices[0].message.content
            answers.append(got)
    assert answers[0][None] != answers[0]["ok"]
    assert answers[0]["chat-None"] != answers[0]["chat-ok"]
    assert answers[0] == answers[1]  # prompt lookup verified under the adapter: its own tokens


def test_phi3s_fused_projections_take_adapters_as_peft_does(tmp_path) -> None:
    """Phi-3 stores q/k/v and gate/up fused (qkv_proj, gate_up_proj), and so do its
    adapters: one slice each. Its logits run larger (~20), and transformers' own Phi-3
    parity in tests/test_parity.py holds to LOGIT_ATOL_FP32 (1e-4); measured up to 3.7e-5."""
    folder = write_tiny_model(tmp_path / "base", "phi3")
    targets = r".*\.layers\.\d+\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)"
    peft_model = write_peft_adapters(folder, tmp_path, {"r16": dict(r=16, lora_alpha=32, use_rslora=True)},
                                     seed=2, targets=targets)
    loaded = _loaded(folder)
    prompts = _prompts(loaded.config.vocab_size)
    with torch.inference_mode():
        want = [peft_model(torch.tensor([p])).logits[0] for p in prompts]
        with peft_model.disable_adapter():
            assert max((peft_model(torch.tensor([p])).logits[0] - w).abs().max() for p, w in zip(prompts, want, strict=True)) > 0.1
    adapter = LoraAdapter("r16", str(tmp_path / "r16"), 1)
    for ops in ("torch", "cpu"):
        got = prefill_logits(_runner(loaded, ops), prompts, [adapter] * len(prompts))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=LOGIT_ATOL_FP32, rtol=0)


def test_the_offline_llm_takes_vllms_lora_request(one) -> None:
    root, _ = one
    request = types.SimpleNamespace(lora_name="ok", lora_int_id=1, lora_path=str(root / "ok"))  # vLLM's LoRARequest
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = engine.LLM(str(root / "base"), dtype="float32", enable_lora=True, kv_cache_memory=2**24)
    try:
        both = llm.generate(["hello world", "hello world"], params, lora_request=[request, None], use_tqdm=False)
        alone = llm.generate("hello world", params, lora_request=request, use_tqdm=False)
        with pytest.raises(InvalidParamError, match="lora_request holds 1 values for 2 prompts"):
            llm.generate(["a", "b"], params, lora_request=[request], use_tqdm=False)
    finally:
        llm.close()
    assert both[0].outputs[0].token_ids != both[1].outputs[0].token_ids
    assert both[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_data_parallel_routing_sends_an_adapters_requests_to_the_core_holding_it() -> None:
    send, _ = trio.open_memory_channel(0)
    pool = CorePool(EngineConfig(data_parallel_size=2), to_detokenizer=send, data_parallel_size=2)
    for core in pool._cores:
        core.state = CoreState.SERVING
    a, b = LoraAdapter("a", "/a", 1), LoraAdapter("b", "/b", 2)
    params = SamplingParams(max_tokens=4)
    serial = iter(range(100))

    def request(lora):  # a prompt of its own: no cached prefix to follow
        n = next(serial)
        rid = f"r{n}"
        sample = SchedulerRequest(rid, (n, n + 1), params, (), 4, 0, 0.0, prefix_salt(None, lora), None, lora=lora)
        return AdmittedRequest(rid, (sample,), ())

    def route(lora):
        req = request(lora)
        core = pool._route(req)
        pool._assign(core, req)
        return core.index

    first = route(a)
    assert route(a) == first  # it holds a (one request more is not "much busier")
    assert route(b) != first  # b goes to the least loaded
    for _ in range(6):
        pool._assign(pool._cores[first], request(None))  # now much busier
    assert route(a) != first


def test_a_running_requests_adapter_stays_read_when_its_folder_goes(four, tmp_path) -> None:
    """One slot and one host copy: a's request and b's take turns in the slot; a's folder
    is gone (unloaded and deleted) before a needs the slot again: its copy, held while the
    request lives, is written back, and the request runs on with a's weights."""
    loaded, adapters = four
    folder = tmp_path / "a"
    shutil.copytree(adapters[0].path, folder)
    a, b = LoraAdapter("a", str(folder), 10), adapters[1]
    runner = ModelRunner(loaded, device="cpu", ops=get_ops("cpu"), num_blocks=32, block_size=4,
                         max_num_batched_tokens=64, max_num_seqs=4, lora=LoraSettings(1, 16, 1, loaded.dtype))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = (5, 6, 7)
    steps = [StepPlan(0, (NewRequest("ra", prompt, params, (), lora=a), NewRequest("rb", prompt, params, (), lora=b)),
                      (ScheduledChunk("ra", 0, 3, (0,), True),), ()),
             StepPlan(1, (), (ScheduledChunk("rb", 0, 3, (4,), True),), ())]
    tokens = [runner.execute(plan).sampled[0].token_id for plan in steps]
    shutil.rmtree(folder)
    result = runner.execute(StepPlan(2, (), (ScheduledChunk("ra", 3, 1, (0,), True),), ()))
    assert not result.failed and len(result.sampled) == 1
    # The same token as a fresh runner gives a's request with the folder there.
    shutil.copytree(adapters[0].path, folder)
    fresh = _runner(loaded, "cpu")
    first = fresh.execute(StepPlan(0, (NewRequest("ra", prompt, params, (), lora=a),),
                                   (ScheduledChunk("ra", 0, 3, (0,), True),), ()))
    assert first.sampled[0].token_id == tokens[0]
    second = fresh.execute(StepPlan(1, (), (ScheduledChunk("ra", 3, 1, (0,), True),), ()))
    assert second.sampled[0].token_id == result.sampled[0].token_id


def test_lora_flags_read_as_vllms() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", '
                              '"base_model_name": "llama"}', "--lora-modules", "x=/a/x", "--max-loras", "4",
                              "--max-cpu-loras", "8", "--lora-dtype", "float32"])
    config = config_from_args(args)
    assert [(m.name, m.path, m.base_model_name) for m in config.lora_module_specs] == [
        ("sql", "/a/sql", None), ("chat", "/a/chat", "llama"), ("x", "/a/x", None)]
    # Across the process boundary (an engine core's config) unchanged.
    assert EngineConfig.from_json(config.to_json()).lora_module_specs == config.lora_module_specs
    for bad, field in ((dict(lora_modules=["a=/p"]), "lora_modules"),  # without enable_lora
                       (dict(enable_lora=True, lora_modules=["a=/p", "a=/q"]), "lora_modules"),
                       (dict(enable_lora=True, lora_modules=["nonsense"]), "lora_modules"),
                       (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
                       (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank")):
        with pytest.raises(ConfigError) as info:
            EngineConfig(**bad)
        assert info.value.field == field


def test_a_family_whose_projections_adapters_do_not_name_is_refused_at_startup(one) -> None:
    _, config = one
    check_lora_model(config)  # Llama: served
    for other in (dataclasses.replace(config, architecture="bert"), dataclasses.replace(config, base_model=True)):
        with pytest.raises(UnsupportedModelError, match="LoRA adapters are not supported"):
            check_lora_model(other)
