"""Pipeline parallelism's model math (issue 39): every family split into 2 and 3 stages
(and 2 stages of 2 tensor-parallel ranks each) gives the one-rank model's logits and greedy
tokens, with each stage holding only its layers.

The ranks are four spawned processes joined by gloo (``tp_ranks.run_ranks``), spawned once
for the module; each lays out its place in every layout (``pp_ranks.pipeline_greedy``):
``-pp 2`` on ranks 0-1, ``-pp 3`` on ranks 0-2, ``-tp 2 -pp 2`` on all four. Stages pass
the hidden states and residual stream with gloo sends, so each stage computes exactly what
one rank computes for its layers; the one-rank oracle runs the C fused decode step where a
stage runs the layers one by one, so the logits agree to the fp32 bound of the
tensor-parallel tests (``LOGIT_ATOL`` + ``LOGIT_RTOL``), over a chunked prefill and 32
decode steps, and the greedy tokens are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
from hf_written import write_deepseek_v3, write_glm
from pp_ranks import pipeline_greedy
from test_cohere import write_cohere
from test_glm4 import write_glm4
from test_loader import write_gguf
from tp_ranks import greedy_with_logits, run_ranks

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers.shard import pipeline_parallel_problem
from engine.models.loader import _converted_gguf
from engine.models.testing import (
    TINY_ABSOLUTE_ARCHITECTURES,
    TINY_ARCHITECTURES,
    TINY_MOE_ARCHITECTURES,
    write_tiny_model,
)
from engine.models.testing_gpt_oss import write_gpt_oss
from engine.parallel import SINGLE, PipelineStage, TensorParallel, place_rank, stage_layers

LOGIT_ATOL = 1e-5
LOGIT_RTOL = 1e-6  # as test_tensor_parallel: a part in a million of the logit
# -tp 2 -pp 2: within each stage the all-reduce changes the order of sums, as in
# test_tensor_parallel, but over 4 layers rather than 2; measured on the tiny Mixtral
# 1.04e-5 at a logit of 0.15 (one value of 1152 at one step), so the tensor-parallel
# layouts take twice the bound. The pipeline alone changes no sum.
TP_LOGIT_ATOL = 2e-5
# The mixture-of-experts families under -tp 2 -pp 2: their routers (weights of std 1.0)
# carry the reordered sums into the routing weights, so the split moves their logits by more
# than a dense model's. Measured: the tiny Qwen3-MoE 3.10e-5 at a logit of about 0.5 (one
# value of 1152 at one step) on an AMD EPYC, the same on every run there; the Intel Xeon
# stayed under 2e-5. That is fp32's own grain on these models: peft's fp32 logits of the tiny
# MoE models sit up to 2.8e-5 from the same model in float64 (tests/test_lora_moe.py), so
# the bound is tests/test_lora.py's for MoE models. A wrong shard or a lost all-reduce
# moves logits by orders of magnitude more, and the greedy tokens must still be the same.
TP_MOE_LOGIT_ATOL = 5e-5
LAYERS = 4  # the floor: 2 stages of 2 layers, or 3 stages of 2, 1, 1
FAMILIES = TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES + TINY_ABSOLUTE_ARCHITECTURES
GGUFS = [("llama", "Q4_0"), ("qwen2", "Q8_0")]  # blocks kept: a tied head, q/k/v biases
LAYOUTS = [(1, 2), (1, 3), (2, 2)]  # (tp, pp)
# Written by transformers (engine.models.testing_gpt_oss, hf_written, test_glm4,
# test_cohere); GLM-4 and Cohere2 are dense, held to the MoE models' bound over
# tensor-parallel ranks (GLM-4 for its post-block norms).
WRITTEN_MOE = ("gpt_oss", "glm4_moe", "deepseek_v3", "glm4", "cohere2")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, str, bool]]]:
    root = tmp_path_factory.mktemp("pp-models")
    layers = {"num_hidden_layers": LAYERS}
    # GPT-2 and OPT's tiny models have LAYERS layers already (GPT-2 names the count n_layer).
    out = [(arch, str(write_tiny_model(root / arch, arch, overrides=None if arch in TINY_ABSOLUTE_ARCHITECTURES
                                       else layers)), True) for arch in FAMILIES]
    write_gpt_oss(root / "gpt_oss", config=layers, spread=0.2)  # as test_tensor_parallel's
    out.append(("gpt_oss", str(root / "gpt_oss"), True))
    write_glm(root / "glm4_moe", num_hidden_layers=LAYERS)  # a dense layer, then three MoE
    out.append(("glm4_moe", str(root / "glm4_moe"), True))
    write_deepseek_v3(root / "deepseek_v3", num_hidden_layers=LAYERS)
    out.append(("deepseek_v3", str(root / "deepseek_v3"), True))
    write_glm4(root / "glm4", num_hidden_layers=LAYERS)
    out.append(("glm4", str(root / "glm4"), True))
    write_cohere(root / "cohere2", num_hidden_layers=LAYERS)
    out.append(("cohere2", str(root / "cohere2"), True))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENGINE_CACHE_DIR", str(root / "cache"))  # the ranks inherit it
        for arch, quant in GGUFS:
            path = write_gguf(root / arch, root / f"{arch}-{quant}.gguf", quant=getattr(gguf.GGMLQuantizationType, quant))
            _converted_gguf(path, None)
            out.append((f"{arch}-{quant}-kernels", str(path), True))
        yield out


@pytest.fixture(scope="module")
def ranks(models: list[tuple[str, str, bool]]) -> list[dict]:
    return run_ranks(pipeline_greedy, 4, LAYOUTS, models, LAYERS)


@pytest.fixture(scope="module")
def one_rank(models: list[tuple[str, str, bool]], one_thread: None) -> dict:
    return greedy_with_logits(SINGLE, models)


def _check(key: str, layout: tuple[int, int], ranks: list[dict], one_rank: dict) -> None:
    tp, pp = layout
    want_tokens, want_logits, _ = one_rank[key]
    atol = (LOGIT_ATOL if tp == 1 else TP_MOE_LOGIT_ATOL if key in (*TINY_MOE_ARCHITECTURES, *WRITTEN_MOE)
            else TP_LOGIT_ATOL)
    bounds = stage_layers(LAYERS, pp)
    for rank in range(tp * pp):
        tokens, logits, held = ranks[rank][layout][key]
        stage = rank // tp
        # Each stage holds only its layers and their KV pool; the ends where they belong.
        assert held["layers"] == held["kv_layers"] == bounds[stage][1] - bounds[stage][0]
        assert held["embed"] == (stage == 0 or (stage == pp - 1 and held["tied"]))
        assert held["head"] == (stage == pp - 1)
        assert tokens == want_tokens, f"rank {rank}"
        if stage < pp - 1:
            assert logits == []  # only the last stage computes logits
            continue
        assert len(logits) == len(want_logits)
        for step, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
            torch.testing.assert_close(got, want, atol=atol, rtol=LOGIT_RTOL,
                                       msg=lambda m, rank=rank, step=step: f"rank {rank} step {step}: {m}")


# OLMo over tensor-parallel ranks is refused (its q/k norms span every head).
CASES = [(arch, layout) for arch in (*FAMILIES, *WRITTEN_MOE) for layout in LAYOUTS]


@pytest.mark.parametrize(("arch", "layout"), CASES, ids=[f"{a}-tp{t}-pp{p}" for a, (t, p) in CASES])
def test_stages_give_the_one_rank_logits_and_tokens(arch: str, layout: tuple[int, int], ranks: list[dict],
                                                    one_rank: dict) -> None:
    _check(arch, layout, ranks, one_rank)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
@pytest.mark.parametrize(("arch", "quant"), GGUFS, ids=[f"{a}-{q}" for a, q in GGUFS])
def test_a_gguf_in_its_blocks_split_into_stages(arch: str, quant: str, layout: tuple[int, int],
                                                ranks: list[dict], one_rank: dict) -> None:
    assert one_rank[f"{arch}-{quant}-kernels"][2] == [quant]  # blocks kept
    _check(f"{arch}-{quant}-kernels", layout, ranks, one_rank)


def test_a_stage_reads_only_its_share_of_the_checkpoint(ranks: list[dict], models: list) -> None:
    # The stages of an untied model read every tensor once between them (and each reads
    # the safetensors header): a stage reads its layers and its end, nothing else.
    paths = {key: path for key, path, _ in models}
    for arch in ("llama3", "qwen3"):
        file = Path(paths[arch]) / "model.safetensors"
        header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
        data = file.stat().st_size - header
        for tp, pp in [(1, 2), (1, 3)]:
            held = [ranks[r][(tp, pp)][arch][2] for r in range(pp)]
            assert not held[-1]["tied"]
            reads = [h["read"] - header for h in held]
            assert sum(reads) == data, (arch, pp)
            assert all(0 < r < data for r in reads)


def test_layers_split_evenly_or_by_partition_and_misfits_are_refused() -> None:
    assert stage_layers(4, 2) == [(0, 2), (2, 4)]
    # The remainder goes to the stages before the last (it also holds the head), as vLLM.
    assert stage_layers(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert stage_layers(8, 2, (5, 3)) == [(0, 5), (5, 8)]
    with pytest.raises(ValueError, match="5,2"):
        stage_layers(8, 2, (5, 2))
    with pytest.raises(ValueError, match="each stage needs a layer"):
        stage_layers(2, 3)
    place = place_rank(3, 2, 2, 8)  # -tp 2 -pp 2: rank 3 is stage 1's tensor-parallel rank 1
    assert (place.rank, place.stage.index, place.stage.prev_rank, place.stage.next_rank) == (1, 1, 1, -1)
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 8,
                               "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                               "num_key_value_heads": 1})
    assert "each stage needs a layer" in pipeline_parallel_problem(cfg, 3)
    from engine.models.registry import build_model
    from engine.ops import get_ops

    with pytest.raises(UnsupportedModelError, match="pipeline stages"):
        build_model(cfg, {}, get_ops("torch"), dtype=torch.float32,
                    tp=TensorParallel(stage=PipelineStage(0, 3, 0, 1)))
