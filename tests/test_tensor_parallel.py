"""Tensor parallelism's model math (issue 21): every family split over two ranks gives the
one-rank model's logits and greedy tokens.

The ranks are two spawned processes joined by gloo (``tp_ranks.run_ranks``), spawned once
for the module; each builds every tiny model's :class:`ModelRunner` for its rank (its slice
of each layer, its KV heads) and greedy-decodes the same prompts: chunked prefill, then
32 decode steps. The oracle is the same runner on one rank, in this process. In fp32 the
split changes only the order of sums (o, down and the experts' down summed over ranks by
the all-reduce), so the logits agree to a few fp32 steps and the tokens are the same: within
1e-5 plus 1e-6 of the logit (``LOGIT_ATOL``, ``LOGIT_RTOL``). The untied tiny models' logits
reach 17, where one fp32 step is 1.9e-6: measured 4e-6 to 1.2e-5 apart (Qwen3-MoE the
most), so 1e-5 alone sits on the edge of what the order of sums gives.

GGUF models keep their blocks on every rank. Over the C kernels (the panels) their o and
down are split by output rows and multiply the gathered input (``shard.RowParallel``), so
every value a rank computes is the one rank's: the same bound holds there too, where an
all-reduce's order of summation moved the int8-rounded activations by far more
(``test_tensor_parallel_gguf.py`` holds them to the issue's bound over longer runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
from hf_written import write_deepseek_v3, write_glm
from test_cohere import write_cohere
from test_glm4 import write_glm4
from test_gpt_bigcode import write_bigcode
from test_gpt_neox import write_neox
from test_granite4_mamba import write_hybrid
from test_loader import write_gguf
from test_nemotron_h import write_nemotron_h
from test_olmoe import write_olmoe
from test_phi import write_phi
from test_qwen3_5 import write_qwen3_5, write_qwen3_next
from test_starcoder2 import write_starcoder2
from tp_ranks import BLOCK_SIZE, greedy_with_logits, run_ranks

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers.shard import kv_head_range, tensor_parallel_problem
from engine.models.loader import _converted_gguf
from engine.models.testing import TINY_ARCHITECTURES, TINY_MOE_ARCHITECTURES, write_tiny_model
from engine.models.testing_gpt_oss import write_gpt_oss
from engine.ops.quant import LAYOUT_FORMATS
from engine.parallel import SINGLE, TensorParallel

LOGIT_ATOL = 1e-5
LOGIT_RTOL = 1e-6  # a part in a million of the logit: ~8 fp32 steps (see the docstring)
FAMILIES = TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES
# (tiny family, block format): a tied head (the embedding's blocks, cut by vocabulary), one
# KV head copied to both ranks, q/k/v biases, Phi-3's fused projections.
GGUFS = [("llama", "Q4_0"), ("llama3", "Q8_0"), ("qwen2", "Q4_0"), ("phi3", "Q8_0")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, str, bool]]]:
    root = tmp_path_factory.mktemp("tp-models")
    out = [(arch, str(write_tiny_model(root / arch, arch)), True) for arch in FAMILIES]
    out.append(("exaone4", str(_write_exaone4(root / "exaone4")), True))
    out.append(("granite_moe", str(_write_granite_moe(root / "granite_moe")), True))
    # gpt-oss: sinks cut with the heads, interleaved biased experts, o and down biases added
    # once after the all-reduce.
    write_gpt_oss(root / "gpt_oss", spread=0.2)  # at 0.3 the order of sums moved a logit 1.5e-5
    out.append(("gpt_oss", str(root / "gpt_oss"), True))
    # GLM-4.5: the fp32 router and its selection bias whole on every rank, the ungated
    # shared expert cut as the experts are.
    write_glm(root / "glm4_moe")
    out.append(("glm4_moe", str(root / "glm4_moe"), True))
    # GLM-4: biases and the rotated half of q and k reordered before each rank cuts its
    # heads; gate_up_proj stored fused, cut per part.
    write_glm4(root / "glm4")
    out.append(("glm4", str(root / "glm4"), True))
    # Cohere2: attention and the MLP side by side, both row-parallel outputs whole before
    # they are added; sliding layers and a global one without RoPE.
    write_cohere(root / "cohere2")
    out.append(("cohere2", str(root / "cohere2"), True))
    # OLMoE: q/k norms across all heads, each rank's heads normed by every rank's squares.
    write_olmoe(root / "olmoe")
    out.append(("olmoe", str(root / "olmoe"), True))
    # GPTBigCode: GPT-2's layer with one KV head, copied to both ranks.
    write_bigcode(root / "gpt_bigcode")
    out.append(("gpt_bigcode", str(root / "gpt_bigcode"), True))
    # StarCoder2: biases on every projection, o's and c_proj's added once after the reduce.
    write_starcoder2(root / "starcoder2")
    out.append(("starcoder2", str(root / "starcoder2"), True))
    # GPT-NeoX: q/k/v stored head by head, regrouped before each rank cuts its heads.
    write_neox(root / "gpt_neox")
    out.append(("gpt_neox", str(root / "gpt_neox"), True))
    # Phi-2: the head's bias cut with its vocabulary rows; o's and fc2's added once.
    write_phi(root / "phi")
    out.append(("phi", str(root / "phi"), True))
    # ERNIE 4.5: q and k reordered for its interleaved RoPE before each rank cuts its heads.
    out.append(("ernie4_5", str(_write_ernie(root / "ernie4_5")), True))
    # DeepSeek-V3: each rank its heads of q and kv_b_proj, the latent whole.
    write_deepseek_v3(root / "deepseek_v3")
    out.append(("deepseek_v3", str(root / "deepseek_v3"), True))
    # The hybrid families: each rank its heads of every Mamba / Gated DeltaNet mixer and its
    # slots' states of them. Granite 4.0 H with B and C in two groups (a group a rank), and
    # with one group (copied to both ranks, the gated norm's squares summed over them);
    # Nemotron-H's single-mixer blocks; Qwen3.5's gated attention and DeltaNet heads.
    write_hybrid(root / "granite4h")
    out.append(("granite4h", str(root / "granite4h"), True))
    write_hybrid(root / "granite4h-g1", mamba_n_groups=1)
    out.append(("granite4h-g1", str(root / "granite4h-g1"), True))
    write_nemotron_h(root / "nemotron_h")
    out.append(("nemotron_h", str(root / "nemotron_h"), True))
    write_qwen3_5(root / "qwen3_5")
    out.append(("qwen3_5", str(root / "qwen3_5"), True))
    # Qwen3-Next: each rank its key heads' rows of the grouped in_proj_qkvz / in_proj_ba.
    write_qwen3_next(root / "qwen3_next")
    out.append(("qwen3_next", str(root / "qwen3_next"), True))
    # OLMo's k norm over one KV head copied to both ranks (counted once, not twice).
    out.append(("olmo2-mqa", str(write_tiny_model(root / "olmo2-mqa", "olmo2",
                                                  overrides={"num_key_value_heads": 1})), True))
    with pytest.MonkeyPatch.context() as mp:
        # GGUF conversions go into this module's own cache, made here once; the ranks
        # inherit the variable and only read it.
        mp.setenv("ENGINE_CACHE_DIR", str(root / "cache"))
        for arch, quant in GGUFS:
            path = write_gguf(root / arch, root / f"{arch}-{quant}.gguf", quant=getattr(gguf.GGMLQuantizationType, quant))
            _converted_gguf(path, None)
            out += [(f"{arch}-{quant}", str(path), False), (f"{arch}-{quant}-kernels", str(path), True)]
        yield out


def _write_exaone4(folder: Path) -> Path:
    """EXAONE 4's hybrid layout, written by transformers: sliding layers with RoPE, a
    global one without, per-head q/k norms (tests/test_exaone.py's model)."""
    from hf_written import write_hf_model
    from transformers import Exaone4Config, Exaone4ForCausalLM

    config = Exaone4Config(vocab_size=384, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                           sliding_window=8, sliding_window_pattern=2)
    torch.manual_seed(0)
    write_hf_model(Exaone4ForCausalLM(config), folder, norms=True)
    return folder


def _write_ernie(folder: Path) -> Path:
    """ERNIE 4.5, written by transformers (tests/test_ernie.py's model, its head untied)."""
    from hf_written import write_hf_model
    from test_ernie import TINY
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    torch.manual_seed(0)
    write_hf_model(Ernie4_5ForCausalLM(Ernie4_5Config(**TINY, tie_word_embeddings=False)), folder, norms=True)
    return folder


def _write_granite_moe(folder: Path) -> Path:
    """Granite-MoE, written by transformers: experts stored stacked (``input_linear``,
    ``output_linear``), which each rank cuts (tests/test_moe.py's model)."""
    from hf_written import write_hf_model
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    config = GraniteMoeConfig(
        vocab_size=384, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.3, logits_scaling=4.0,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    write_hf_model(GraniteMoeForCausalLM(config), folder)
    return folder


@pytest.fixture(scope="module")
def two_ranks(models: list[tuple[str, str, bool]]) -> list[dict]:
    return run_ranks(greedy_with_logits, 2, models)


@pytest.fixture(scope="module")
def one_rank(models: list[tuple[str, str, bool]], one_thread: None) -> dict:
    return greedy_with_logits(SINGLE, models)


def _check(key: str, two_ranks: list[dict], one_rank: dict, close) -> None:
    want_tokens, want_logits, want_kept = one_rank[key]
    for rank, result in enumerate(two_ranks):
        tokens, logits, kept = result[key]
        assert kept == want_kept  # each rank keeps the blocks, in the file's format
        assert len(logits) == len(want_logits)
        for step, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
            assert got.shape == want.shape  # the full vocabulary, gathered
            close(got, want, f"rank {rank} step {step}")
        assert tokens == want_tokens
    # Every rank gathers the same logits, so every rank samples the same tokens.
    assert two_ranks[0][key][0] == two_ranks[1][key][0]
    assert all(torch.equal(a, b) for a, b in zip(two_ranks[0][key][1], two_ranks[1][key][1], strict=True))


def _exact(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=LOGIT_RTOL, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("arch", FAMILIES)
def test_two_ranks_give_the_one_rank_logits_and_tokens(arch: str, two_ranks: list[dict], one_rank: dict) -> None:
    assert one_rank[arch][2] == []  # dense
    _check(arch, two_ranks, one_rank, _exact)


# GLM-4.5's and DeepSeek-V3's sigmoid routers scaled by 2.5 carry the reordered sums into
# their routing weights: measured on GLM-4.5 2.05e-5 at a logit of 0.17 (one step of 32, 22
# values of 1152) on an AMD EPYC. test_pipeline_parallel's bound for MoE models under tensor
# parallelism holds it.
MOE_LOGIT_ATOL = 5e-5


def _moe(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(got, want, atol=MOE_LOGIT_ATOL, rtol=LOGIT_RTOL, msg=lambda m: f"{where}: {m}")


# Qwen3-Next carries the reordered sums through its routed experts, the DeltaNet heads'
# norms and its zero-centred norms to logits of up to 20: measured 1e-5 to 4.4e-5 a step over
# 34 steps on an AMD EPYC, and once 9.8e-5, the tokens the same and no drift from step to
# step. A wrong cut moves the logits by orders of magnitude more.
QWEN3_NEXT_LOGIT_ATOL = 2e-4


def _qwen3_next(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(got, want, atol=QWEN3_NEXT_LOGIT_ATOL, rtol=LOGIT_RTOL, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("key", ["exaone4", "granite_moe", "olmo2-mqa", "gpt_oss", "glm4_moe", "deepseek_v3",
                                 "ernie4_5", "glm4", "cohere2", "olmoe", "gpt_bigcode", "starcoder2",
                                 "gpt_neox", "phi", "granite4h", "granite4h-g1", "nemotron_h", "qwen3_5",
                                 "qwen3_next"])
def test_transformers_written_and_copied_kv_head_models_over_two_ranks(
    key: str, two_ranks: list[dict], one_rank: dict,
) -> None:
    # GLM-4 norms each block's output, attention's included: the rms of a small output
    # scales the reordered sums' last bits up with it (measured 1.36e-5 at a logit of 0.04
    # on an AMD EPYC), so it takes the MoE models' bound. So do Nemotron-H (its squared-ReLU
    # MLPs square the reordered sums' differences: 1.45e-5 at a logit of 0.66) and Qwen3.5
    # (each DeltaNet head's output normed before its gate: 1.34e-5 at most).
    bound = (_moe if key in ("glm4_moe", "deepseek_v3", "glm4", "olmoe", "nemotron_h", "qwen3_5")
             else _qwen3_next if key == "qwen3_next" else _exact)
    _check(key, two_ranks, one_rank, bound)


@pytest.mark.parametrize(("arch", "quant"), GGUFS, ids=[f"{a}-{q}" for a, q in GGUFS])
def test_a_gguf_split_in_its_blocks_gives_the_one_rank_logits(arch: str, quant: str, two_ranks: list[dict], one_rank: dict) -> None:
    key = f"{arch}-{quant}"
    assert one_rank[key][2] == [quant]
    _check(key, two_ranks, one_rank, _exact)  # the torch reference matmul
    _check(key + "-kernels", two_ranks, one_rank, _exact)  # the C kernels


def _config(**overrides) -> ModelConfig:
    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    return ModelConfig.from_hf(raw | overrides)


def test_a_model_whose_heads_do_not_divide_is_refused_naming_the_counts() -> None:
    smollm2 = _config()  # SmolLM2-135M's shape: 9 query and 3 KV heads
    problem = tensor_parallel_problem(smollm2, 2)
    assert problem is not None
    assert "num_attention_heads (9)" in problem and "num_key_value_heads (3)" in problem
    assert tensor_parallel_problem(smollm2, 3) is None
    assert tensor_parallel_problem(smollm2, 1) is None
    # Fewer KV heads than ranks: each KV head is copied, so the ranks must be a multiple.
    assert tensor_parallel_problem(_config(num_attention_heads=12, num_key_value_heads=2), 4) is None
    assert "num_key_value_heads (2)" in tensor_parallel_problem(_config(num_attention_heads=12, num_key_value_heads=2), 3)
    assert "intermediate_size (1537)" in tensor_parallel_problem(_config(num_attention_heads=8, num_key_value_heads=2, intermediate_size=1537), 2)
    assert "vocab_size (49153)" in tensor_parallel_problem(_config(num_attention_heads=8, num_key_value_heads=2, vocab_size=49153), 2)
    from engine.models.registry import build_model
    from engine.ops import get_ops

    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \(9\)"):
        build_model(smollm2, {}, get_ops("torch"), dtype=torch.float32, tp=TensorParallel(0, 2))


def test_kv_heads_are_split_or_copied_to_the_ranks_whose_queries_read_them() -> None:
    cfg = _config(num_attention_heads=8, num_key_value_heads=2)
    # 4 ranks, 2 KV heads: ranks 0-1 hold query heads 0-3 (KV head 0), ranks 2-3 heads 4-7.
    assert [kv_head_range(cfg, TensorParallel(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(cfg, TensorParallel(r, 2)) for r in range(2)] == [(0, 1), (1, 2)]
    from engine.runner.kv_cache import allocate_kv_caches, bytes_per_block

    caches = allocate_kv_caches(cfg, 2, BLOCK_SIZE, torch.float32, "cpu", tp=TensorParallel(1, 4))
    assert caches[0][0].shape == (2, BLOCK_SIZE, 1, cfg.head_dim)
    whole = bytes_per_block(cfg, torch.float32, BLOCK_SIZE)
    assert bytes_per_block(cfg, torch.float32, BLOCK_SIZE, tp=TensorParallel(0, 2)) * 2 == whole


def test_the_model_path_is_unchanged_on_one_rank(tmp_path: Path) -> None:
    """``SINGLE`` cuts nothing: the weights are the checkpoint's own tensors."""
    from engine.models.loader import load_model
    from engine.models.registry import build_model
    from engine.ops import get_ops

    loaded = load_model(write_tiny_model(tmp_path / "m", "qwen2"), dtype="float32")
    model = build_model(loaded.config, loaded.weights, get_ops("torch"), dtype=torch.float32)
    assert model.embed.data_ptr() == loaded.weights["model.embed_tokens.weight"].data_ptr()
    assert model.num_heads == loaded.config.num_attention_heads


CUT_FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _blocks(fmt: str, n: int, k: int) -> torch.Tensor:
    """GGUF rows of ``fmt`` for a random [n, k] weight: quantized by the gguf package (or
    the helpers' Q4_K encoder); Q5_K and Q6_K, which neither writes, as random bytes with
    their fp16 scales set to finite values (every bit field random, so a misplaced one shows)."""
    from test_loader import quantize_array

    from engine.ops.quant import format_of

    if fmt not in ("Q5_K", "Q6_K"):
        array = torch.randn(n, k, generator=torch.Generator().manual_seed(7)).numpy()
        return torch.from_numpy(quantize_array(array, getattr(gguf.GGMLQuantizationType, fmt)).copy())
    f = format_of(fmt)
    raw = torch.randint(0, 256, (n, k // f.block, f.block_bytes), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(7))
    scales = (torch.rand(n, k // f.block, 2, generator=torch.Generator().manual_seed(8)) * 0.01).half()
    at = (0, 4) if fmt == "Q5_K" else (208, 210)  # Q5_K: d, dmin; Q6_K: d
    raw[..., at[0] : at[1]] = scales[..., : (at[1] - at[0]) // 2].contiguous().view(torch.uint8).view(n, k // f.block, -1)
    return raw.view(n, -1)


# Every format each layout's kernels read (blocks: the Triton kernel's four).
CUTS = [(fmt, layout) for layout in ("panels", "blocks") for fmt in CUT_FORMATS if fmt in LAYOUT_FORMATS[layout]]


@pytest.mark.parametrize(("fmt", "layout"), CUTS, ids=[f"{f}-{lay}" for f, lay in CUTS])
def test_quantized_cuts_keep_the_blocks_and_their_values(fmt: str, layout: str) -> None:
    """Cuts of a kept weight dequantize to the same cuts of the whole weight, in either
    layout, including row cuts inside a 16-row panel (repacked) and joined spans."""
    from engine.models.layers.shard import take_cols, take_rows
    from engine.ops.quant import QuantizedWeight

    n, k = 56, 512
    w = QuantizedWeight.from_blocks(_blocks(fmt, n, k), fmt, k, layout=layout)
    whole = w.dequantize()
    for spans in ([(16, 48)], [(8, 40)], [(0, 8), (24, 40)], [(40, 56)]):
        cut = take_rows(w, spans)
        assert isinstance(cut, QuantizedWeight) and cut.fmt.name == fmt and cut.layout == layout
        assert torch.equal(cut.dequantize(), torch.cat([whole[a:b] for a, b in spans]))
    for a, b in ((256, 512), (0, 256)) + (((32, 96),) if w.fmt.block == 32 else ()):
        cut = take_cols(w, a, b, "w")
        assert isinstance(cut, QuantizedWeight) and cut.shape == (n, b - a)
        assert torch.equal(cut.dequantize(), whole[:, a:b])
    with pytest.raises(UnsupportedModelError, match=rf"model.layers.3.mlp.down_proj.weight: its {fmt} blocks"):
        take_cols(w, 0, 128 + 16, "model.layers.3.mlp.down_proj.weight")


def test_a_gguf_whose_row_parallel_cut_falls_inside_a_block_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_K's blocks are 256 wide: a 256-wide o_proj in GGUF's block rows (the Triton
    layout, split by input columns) cannot be split in two. The build refuses it, naming
    the tensor, instead of dequantizing it. In the C kernels' panels the same o_proj is
    split by its output rows (gathered), which any row count allows."""
    from engine.models.layers.shard import RowParallel
    from engine.models.loader import load_model
    from engine.models.registry import build_model
    from engine.ops import get_ops

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_tiny_model(tmp_path / "wide", "llama", overrides={"hidden_size": 256})
    path = write_gguf(folder, tmp_path / "wide-Q4_K.gguf", quant=gguf.GGMLQuantizationType.Q4_K)
    blocks = load_model(path, dtype="float32", ops_backend="triton")
    assert blocks.quantization == "gguf"
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: its Q4_K blocks hold 256"):
        build_model(blocks.config, blocks.weights, get_ops("torch"), dtype=torch.float32, tp=TensorParallel(0, 2))
    panels = load_model(path, dtype="float32")
    model = build_model(panels.config, panels.weights, get_ops("cpu"), dtype=torch.float32, tp=TensorParallel(1, 2))
    o = model.layers[0].o_proj
    assert isinstance(o, RowParallel) and o.gathered
    (part,) = o.linear.parts
    assert part.fmt.name == "Q4_K" and part.shape == (128, 256)  # its half of the output rows, every input column


def test_a_rank_built_for_its_device_from_host_weights_receives_only_its_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model larger than one device loads on the host and each rank builds for its own
    device: the weights are cut on the host and only the cut moves (GGUF's block rows
    too: QuantizedWeight.to refuses to change devices). The "meta" device stands in for a
    GPU: it holds shapes, not bytes, so any tensor left on the host shows."""
    from engine.models.layers.linear import QuantLinear
    from engine.models.loader import load_model
    from engine.models.registry import build_model
    from engine.ops import get_ops
    from engine.ops.quant import QuantizedWeight

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_tiny_model(tmp_path / "m", "qwen2")
    path = write_gguf(folder, tmp_path / "m-Q8_0.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(path, dtype="float32", device="cpu", ops_backend="triton")  # GGUF's block rows
    cfg = loaded.config
    model = build_model(cfg, loaded.weights, get_ops("torch"), dtype=torch.float32, device="meta",
                        tp=TensorParallel(1, 2))
    layer = model.layers[0]
    assert isinstance(model.embed, QuantizedWeight) and model.embed.layout == "blocks"
    assert model.embed.device.type == "meta" and model.embed.shape == (cfg.vocab_size // 2, cfg.hidden_size)
    assert not layer.o_proj.gathered  # block rows: split by input columns, all-reduced
    assert isinstance(layer.o_proj.linear, QuantLinear)
    (o,) = layer.o_proj.linear.parts
    assert o.device.type == "meta" and o.shape == (cfg.hidden_size, cfg.hidden_size // 2)
    d = cfg.head_dim
    assert sum(p.shape[0] for p in layer.qkv.parts) == (cfg.num_attention_heads // 2 + 2 * (cfg.num_key_value_heads // 2)) * d
    assert all(p.device.type == "meta" for p in layer.qkv.parts)
    assert layer.qkv.bias.device.type == "meta" and layer.input_norm.device.type == "meta"
