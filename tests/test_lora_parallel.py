"""LoRA adapters with tensor and pipeline parallelism (issue 36): ``-tp 2``, ``-pp 2`` and
``-tp 2 -pp 2`` against peft's ``PeftModel`` (unmerged), and an adapter loaded, used and
unloaded at runtime through ``python -m engine serve -tp 2`` and the ``openai`` client.

Each rank keeps its cut of every adapter (engine/models/layers/lora.py): A whole and B's
output rows on q/k/v and gate/up, A's input columns and B whole on o and down (the partial
deltas summed by the base layer's all-reduce); a stage keeps only its layers'. The ranks
are four spawned processes joined by gloo (``tp_ranks.run_ranks``), spawned once; each runs
every layout (``lora_ranks.lora_layouts``) with every prompt under the base model and two
adapters in the same steps: a whole-prompt prefill (logits at every position), then 32
greedy tokens with chunked prefill.

Bounds: the one-rank engine is within 1e-5 of peft (tests/test_lora.py). A stage alone
changes no sum; tensor parallelism reorders the o/down sums and adds the adapters' partial
deltas in the all-reduce, so the layouts take the tensor-parallel tests' bound (1e-5 plus
1e-6 of the logit, tests/test_tensor_parallel.py): measured at most 6.8e-6 (Qwen2, every
layout; the one-rank engine is 6.8e-6 there too) on logits below 1. A wrong cut (B's rows
of another rank's heads, a scale applied twice, a delta added after the all-reduce on both
ranks) moves the logits by O(0.1): giving both ranks rank 0's q/k/v rows fails every
tensor-parallel layout.

A tiny Llama kept as Q8_0 blocks splits its o and down by output rows over the gathered
input on CPU (``shard.RowParallel``): there each rank keeps A whole and B's rows of its
outputs. The C kernels round activations to int8 per 32 columns, which peft does not, so
its oracle is the one-rank engine over the same file (itself checked against peft in
tests/test_lora.py), to the same bound: each rank computes every value as one rank does.

Models: tiny Llama (four query heads over two KV heads: k/v split by KV head), the same
with one KV head (copied to both ranks; the tiny Llama 3 has one too, but its logits reach
16 and the one-rank engine is already 2e-4 from peft there with the rank-16 adapter over
four layers), Qwen2 (q/k/v biases) and Phi-3 (fused q/k/v and gate/up, each part cut),
four layers each. Phi-3's logits reach 16: it takes tests/test_lora.py's bound for it
(``LOGIT_ATOL_FP32``, 1e-4); the one-rank engine is 9.7e-5 from peft there (the rank-16
adapter, C kernels) and every layout the same or less (6.6e-5 at -tp 2): the split adds
nothing measurable.
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch
from lora_ranks import lora_layouts, one_rank
from test_http_cli import _server
from test_lora import SMALL_ADAPTER_STD, _generate, _prompts, write_peft_adapters
from test_parity import LOGIT_ATOL_FP32
from test_quant_models import write_quantized
from tp_ranks import run_ranks

import engine
from engine.errors import LoraAdapterError
from engine.messages import LoraAdapter
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.models.testing import write_tiny_model
from engine.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 4  # two stages of two layers
LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tp, pp)
# key: (tiny family, config overrides)
MODELS = {"llama": ("llama", {}), "llama-1kv": ("llama", {"num_key_value_heads": 1}), "qwen2": ("qwen2", {}),
          "phi3": ("phi3", {})}
# Phi-3 stores q/k/v and gate/up fused, and so do its adapters (one slice each, cut part by
# part); its logits run to ~20, where tests/test_lora.py holds it to LOGIT_ATOL_FP32, and its
# adapters are drawn small (SMALL_ADAPTER_STD: tests/test_lora.py says why).
PHI3_TARGETS = r".*\.layers\.\d+\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)"
ARCHS = tuple(MODELS)
GGUF = "llama-Q8_0"
ADAPTERS = {"r8": dict(r=8, lora_alpha=16), "r16": dict(r=16, lora_alpha=32, use_rslora=True)}
NAMES = (None, "r8", "r16")
LOGIT_ATOL = 1e-5
LOGIT_RTOL = 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Per family: the model, its adapters as peft writes them, and peft's logits at every
    position and greedy tokens for each (prompt, adapter)."""
    out = {}
    for key, (arch, overrides) in MODELS.items():
        root = tmp_path_factory.mktemp(f"lora-par-{key}")
        folder = write_tiny_model(root / "base", arch, overrides={"num_hidden_layers": LAYERS, **overrides})
        peft_model = write_peft_adapters(folder, root, ADAPTERS, seed=3,
                                         **({"targets": PHI3_TARGETS, "std": SMALL_ADAPTER_STD} if arch == "phi3" else {}))
        adapters = {name: LoraAdapter(name, str(root / name), i + 1) for i, name in enumerate(ADAPTERS)}
        config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        runs = [(p, None if n is None else adapters[n]) for p in _prompts(config.vocab_size) for n in NAMES]
        want, tokens = [], []
        with torch.inference_mode():
            for p, a in runs:
                if a is None:
                    with peft_model.disable_adapter():
                        want.append(peft_model(torch.tensor([p])).logits[0])
                        tokens.append(_generate(peft_model, p))
                else:
                    peft_model.set_adapter(a.name)
                    want.append(peft_model(torch.tensor([p])).logits[0])
                    tokens.append(_generate(peft_model, p))
        out[key] = types.SimpleNamespace(folder=folder, runs=runs, want=want, tokens=tokens)
    return out


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The tiny Llama as a Q8_0 GGUF with adapters written by peft over its dequantized
    weights, and the one-rank engine's logits and tokens under each."""
    root = tmp_path_factory.mktemp("lora-par-gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENGINE_CACHE_DIR", str(root / "cache"))  # the ranks inherit it
        path = write_quantized(root, "llama", "Q8_0", overrides={"num_hidden_layers": LAYERS})
        dense = load_model(path, dtype="float32", quantization="none")
        write_peft_adapters(dense.folder, root, ADAPTERS, seed=3)
        adapters = {name: LoraAdapter(name, str(root / name), i + 1) for i, name in enumerate(ADAPTERS)}
        runs = [(p, None if n is None else adapters[n]) for p in _prompts(dense.config.vocab_size) for n in NAMES]
        want, tokens = one_rank(str(path), runs)
        yield types.SimpleNamespace(folder=dense.folder, path=path, runs=runs, want=want, tokens=tokens)


@pytest.fixture(scope="module")
def ranks(tiny, quantized) -> list[dict]:
    models = [(arch, str(t.folder), t.runs) for arch, t in tiny.items()]
    models.append((GGUF, str(quantized.path), quantized.runs))
    return run_ranks(lora_layouts, 4, LAYOUTS, models, LAYERS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
@pytest.mark.parametrize("arch", [*ARCHS, GGUF])
def test_split_adapters_give_peft_logits_and_tokens(arch, layout, tiny, quantized, ranks) -> None:
    tp, pp = layout
    t = quantized if arch == GGUF else tiny[arch]
    for rank in range(tp * pp):
        logits, tokens, held = ranks[rank][layout][arch]
        stage = rank // tp
        # Each stage's slots and host copies hold its layers only.
        layers = list(range(stage * LAYERS // pp, (stage + 1) * LAYERS // pp))
        assert held["layers"] == held["modules"] == layers, f"rank {rank}"
        assert held["loads"] == len(ADAPTERS)
        if tp > 1:  # the slots hold the rank's cut: q/k/v and gate/up's B rows, o/down's A columns
            (qkv_a, qkv_b), (o_a, o_b) = held["shapes"]["qkv"], held["shapes"]["o_proj"]
            (_, up_b), (down_a, _) = held["shapes"]["gate_up"], held["shapes"]["down"]
            config = ModelConfig.from_hf(json.loads((t.folder / "config.json").read_text()))
            h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
            assert qkv_b[2] == (h // tp + 2 * max(hkv // tp, 1)) * d and qkv_a[2] == config.hidden_size
            if arch == GGUF:  # o and down gathered: A whole, B's rows of the rank's outputs
                assert o_a[2] == h * d and o_b[2] == config.hidden_size // tp
            else:
                assert o_a[2] == h * d // tp and o_b[2] == config.hidden_size
            assert up_b[2] == 2 * config.intermediate_size // tp
            assert down_a[2] == config.intermediate_size // (1 if arch == GGUF else tp)
        assert tokens == t.tokens, f"rank {rank}"
        if stage < pp - 1:
            assert logits is None
            continue
        for i, (got, want) in enumerate(zip(logits, t.want, strict=True)):
            name = t.runs[i][1].name if t.runs[i][1] else None
            torch.testing.assert_close(got, want, atol=LOGIT_ATOL_FP32 if arch == "phi3" else LOGIT_ATOL, rtol=LOGIT_RTOL,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank}, adapter {name}: {m}")
    # The adapters change the model (else the checks above could not fail).
    assert all((t.want[i] - t.want[i - i % 3]).abs().max() > 0.1 for i in range(len(t.runs)) if i % 3)


# --- runtime adapters through the server at -tp 2 -------------------------------------------

KEY = "lora-tp-key"
PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores keys"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A tiny Llama in ``base`` and two adapters, ``aa`` and ``cc``."""
    root = tmp_path_factory.mktemp("runtime-lora")
    folder = write_tiny_model(root / "base", "llama")
    write_peft_adapters(folder, root, {"aa": dict(r=8, lora_alpha=16), "cc": dict(r=8, lora_alpha=32)}, seed=11)
    return root


@pytest.fixture(scope="module")
def served(files):
    root = files
    with _server(root / "base", "--dtype", "float32", "-tp", "2", "--enable-lora", "--lora-modules", f"a={root / 'aa'}",
                 "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
                 "--api-key", KEY, "--served-model-name", "tiny") as (proc, url, log):
        yield url, root, proc
        proc.terminate()


def _complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_an_adapter_loads_serves_and_unloads_at_runtime_on_two_ranks(served, tmp_path) -> None:
    url, root, proc = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    headers = {"Authorization": f"Bearer {KEY}"}
    base, started = _complete(client, "tiny"), _complete(client, "a")
    # Loaded at runtime, it reaches both ranks: its answer is its own, and the same again
    # once it sits in a slot.
    reply = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(root / "cc")},
                       headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert "c" in [m.id for m in client.models.list().data]
    first = _complete(client, "c")
    assert len({base, started, first}) == 3
    assert _complete(client, "c") == first
    # A bad adapter is a 400 naming it, and the server goes on serving on both ranks.
    bad = tmp_path / "bad"
    shutil.copytree(root / "cc", bad)
    (bad / "adapter_config.json").write_text(json.dumps({**json.loads((bad / "adapter_config.json").read_text()),
                                                         "r": 64}))
    refused = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)},
                         headers=headers, timeout=60)
    assert refused.status_code == 400 and "bad" in refused.text and "rank" in refused.text
    # Unloaded: the name is gone; the base and the other adapter answer as before.
    reply = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=headers)
    assert reply.status_code == 200, reply.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "c")
    assert (_complete(client, "tiny"), _complete(client, "a")) == (base, started)
    # An adapter whose folder is gone when its first request reaches the ranks fails that
    # request on every rank alike (the group is not torn down) and the server serves on.
    gone = tmp_path / "gone"
    shutil.copytree(root / "cc", gone)
    reply = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(gone)},
                       headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    shutil.rmtree(gone)
    ranks = _processes(proc.pid)
    with pytest.raises(openai.APIError) as failed:
        _complete(client, "gone")
    assert isinstance(failed.value, openai.InternalServerError) and "'gone'" in str(failed.value)
    assert (_complete(client, "tiny"), _complete(client, "a")) == (base, started)
    assert _processes(proc.pid) == ranks  # the same worker rank: no restart


def _processes(pid: int) -> set[int]:
    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


async def test_two_stages_serve_startup_and_runtime_adapters_as_one_rank(files) -> None:
    """``--lora-modules`` and an adapter loaded at runtime through the embedded API at
    ``-pp 2``: the same greedy tokens as the one-rank engine (itself checked against peft)."""
    root = files
    folder = root / "base"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = []
    for pp in (1, 2):
        async with engine.open_engine(str(folder), dtype="float32", kv_cache_memory=2**22, enable_lora=True,
                                      lora_modules=[f"a={root / 'aa'}"], pipeline_parallel_size=pp) as eng:
            await eng.loras.load("c", str(root / "cc"))
            answers = {}
            for lora in (None, "a", "c"):
                answers[lora] = [t async for out in eng.generate(PROMPT, params, lora=lora) for t in out.token_ids]
            eng.loras.unload("c")
            with pytest.raises(LoraAdapterError, match="no adapter of that name"):
                await eng.submit(PROMPT, params, lora="c")
            answers["again"] = [t async for out in eng.generate(PROMPT, params, lora="a") for t in out.token_ids]
            got.append(answers)
    assert got[1] == got[0]
    assert len({tuple(got[0][k]) for k in (None, "a", "c")}) == 3
    assert got[0]["again"] == got[0]["a"]
  # the greedy run length
