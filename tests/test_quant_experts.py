"""Routed experts kept in their GGUF blocks: the stacks (``QuantizedExperts``) and quant.c's
``eng_qmoe`` against a torch emulation of its arithmetic, against the quantized matmul a
dense MLP kept in blocks runs, and against the exact product within the activations'
rounding."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from test_moe import write_moe_gguf
from test_quant import random_blocks

from engine.models.layers.linear import Linear, QuantLinear
from engine.models.layers.moe import SparseMoeBlock, run_experts, stack_experts
from engine.models.layers.shard import ShardedWeights
from engine.models.loader import load_model
from engine.models.testing import write_tiny_model
from engine.ops import get_ops
from engine.ops.cpu import qmatmul as cq
from engine.ops.moe import SquaredRelu, fused_moe_reference
from engine.ops.quant import FORMATS, QuantError, QuantizedExperts, QuantizedWeight
from engine.parallel import SINGLE, TensorParallel

needs_kernels = pytest.mark.skipif(not cq.available(), reason="C kernels not built")


def _weight(fmt: str, n: int, k: int, seed: int) -> QuantizedWeight:
    return QuantizedWeight.from_blocks(random_blocks(fmt, n, k, seed=seed), FORMATS[fmt], k)


def _experts(num: int, hidden: int, inter: int, fmt13: str, fmt2: str, gated: bool = True):
    """Each expert's (gate,) up and down weights, random blocks of the formats given."""
    first = [[_weight(fmt13, inter, hidden, 10 * e + j) for j in range(2 if gated else 1)] for e in range(num)]
    down = [_weight(fmt2, hidden, inter, 10 * e + 5) for e in range(num)]
    return first, down


def _routing(tokens: int, num: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.softmax(torch.randn(tokens, num, generator=g), -1).topk(k, dim=-1)
    return weights.float().contiguous(), ids.contiguous()


def _int8(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: int8 per 32 columns (step amax / 127, half to even)."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xf * inv).clamp(-127, 127) * (amax / 127.0)).reshape(x.shape)


def _emulated(x, first, down, weights, ids, gated):
    """The kernel's arithmetic in torch: each pair's int8 activations times the
    dequantized expert in float64, rounded to the dtype where the kernel rounds."""
    dtype = x.dtype
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xq = _int8(x[t : t + 1]).double()
            h = [(xq @ w.dequantize().double().T).to(dtype) for w in first[e]]
            if gated:
                act = (F.silu(h[0].float()) * h[1].float()).to(dtype)
            else:
                act = torch.square(F.relu(h[0].float())).to(dtype)
            y = (_int8(act).double() @ down[e].dequantize().double().T).to(dtype)
            out[t] += y[0].double() * float(weights[t, j])
    return out


CASES = [  # (first projection's format, down's, hidden, inter): the K-quants need 256 columns
    ("Q8_0", "Q8_0", 64, 96),
    ("Q4_0", "Q4_1", 96, 64),
    ("Q4_K", "Q6_K", 256, 256),
    ("Q5_K", "Q4_K", 256, 256),
    ("Q5_0", "Q5_1", 96, 64),
    ("Q3_K", "Q2_K", 256, 256),
    ("IQ4_XS", "IQ4_NL", 256, 96),
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt13", "fmt2", "hidden", "inter"), CASES, ids=[f"{a}-{b}" for a, b, _, _ in CASES])
def test_the_kernel_matches_a_torch_emulation_of_its_arithmetic(fmt13, fmt2, hidden, inter, dtype) -> None:
    first, down = _experts(5, hidden, inter, fmt13, fmt2)
    w13, w2 = QuantizedExperts.stack(first), QuantizedExperts.stack([[d] for d in down])
    # one token; a verification chunk; more pairs on one expert than a token block (64)
    for tokens, k in ((1, 2), (5, 3), (70, 2)):
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        weights, ids = _routing(tokens, 5, k, tokens)
        want = _emulated(x, first, down, weights, ids, gated=True)
        scale = want.abs().max().item()
        for threads in (1, 2):
            got = cq.qmoe(x, w13, w2, weights, ids, threads=threads)
            assert got.dtype == dtype and got.shape == x.shape
            # fp32: the same products to summation order; bf16: one rounding of each
            # intermediate may land either side, a few bf16 steps of the output's scale.
            atol = 2e-5 * scale if dtype == torch.float32 else 3e-2 * scale
            torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_pair_gets_what_a_dense_mlp_kept_in_blocks_computes(dtype) -> None:
    """Value for value the quantized Linear path: ``qmatmul`` of the gate and up, the
    op set's SiLU-and-mul, ``qmatmul`` of the down, per (token, slot)."""
    hidden, inter, num, k = 256, 256, 4, 2
    first, down = _experts(num, hidden, inter, "Q4_K", "Q6_K")
    w13, w2 = QuantizedExperts.stack(first), QuantizedExperts.stack([[d] for d in down])
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    weights, ids = _routing(6, num, k, 4)
    got = cq.qmoe(x, w13, w2, weights, ids)
    ops = get_ops("cpu")
    want = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(6):
        for j in range(k):
            e = int(ids[t, j])
            h = cq.qmatmul(x[t : t + 1], QuantizedWeight.cat_rows(first[e]))
            y = cq.qmatmul(ops.silu_and_mul(h), down[e])
            want[t] += y[0].float() * weights[t, j]
    assert torch.equal(got, want.to(dtype))


@needs_kernels
def test_ungated_squared_relu_experts() -> None:
    """Nemotron 3's experts: the up rows alone, ``relu(up) ** 2``."""
    first, down = _experts(4, 64, 96, "Q8_0", "Q8_0", gated=False)
    w13, w2 = QuantizedExperts.stack(first), QuantizedExperts.stack([[d] for d in down])
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = _routing(7, 4, 2, 1)
    got = cq.qmoe(x, w13, w2, weights, ids, gated=False)
    want = _emulated(x, first, down, weights, ids, gated=False)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())
    # the layer's dispatch takes the kernel for Nemotron 3's activation too
    assert torch.equal(run_experts(get_ops("cpu"), x, w13, w2, weights, ids, SquaredRelu()), got)


@needs_kernels
def test_within_the_activation_rounding_of_the_dequantized_experts() -> None:
    """Against the exact product (the reference op set over dequantized experts): apart by
    no more than int8 activations move a token (0.4% of a block's largest entry each)."""
    first, down = _experts(6, 64, 96, "Q8_0", "Q8_0")
    w13, w2 = QuantizedExperts.stack(first), QuantizedExperts.stack([[d] for d in down])
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
    weights, ids = _routing(9, 6, 2, 6)
    exact = fused_moe_reference(x, w13, w2, weights, ids)  # each routed expert dequantized
    dense = fused_moe_reference(x, w13.dequantize(), w2.dequantize(), weights, ids)
    assert torch.equal(exact, dense)
    got = cq.qmoe(x, w13, w2, weights, ids)
    rel = float((got - exact).abs().max() / exact.abs().max())
    assert 0 < rel < 0.02


def test_a_stack_keeps_each_experts_blocks() -> None:
    first, down = _experts(3, 64, 96, "Q8_0", "Q4_0")
    w13, w2 = QuantizedExperts.stack(first), QuantizedExperts.stack([[d] for d in down])
    assert w13.shape == (3, 192, 64) and w2.shape == (3, 64, 96)
    assert w13.nbytes == sum(w.nbytes for parts in first for w in parts)
    for e in range(3):
        assert torch.equal(w13.dense(e), torch.cat([w.dequantize() for w in first[e]]))
        assert torch.equal(w2.dense(e, torch.bfloat16), down[e].dequantize().bfloat16())
    assert torch.equal(w13.dequantize()[1], w13.dense(1))


def test_experts_of_mixed_formats_stack_dense() -> None:
    """One expert's down in another format than the rest's (or a dense weight among them):
    the layer's stacks are dense in the model dtype, as before blocks were kept."""
    first, down = _experts(3, 64, 96, "Q8_0", "Q8_0")
    w13, w2 = stack_experts(first, down, torch.float32)
    assert isinstance(w13, QuantizedExperts) and isinstance(w2, QuantizedExperts)
    mixed = down[:2] + [_weight("Q4_0", 64, 96, 99)]
    w13, w2 = stack_experts(first, mixed, torch.bfloat16)
    assert isinstance(w13, torch.Tensor) and w13.dtype == torch.bfloat16 and w13.shape == (3, 192, 64)
    assert torch.equal(w2[2], mixed[2].dequantize().bfloat16())
    w13, w2 = stack_experts(first, down[:2] + [down[2].dequantize()], torch.float32)
    assert isinstance(w2, torch.Tensor) and torch.equal(w2[0], down[0].dequantize())


@needs_kernels
def test_bad_routing_raises_instead_of_reading_out_of_bounds() -> None:
    first, down = _experts(3, 64, 96, "Q8_0", "Q8_0")
    w13, w2 = QuantizedExperts.stack(first), QuantizedExperts.stack([[d] for d in down])
    x = torch.randn(2, 64)
    weights = torch.full((2, 2), 0.5)
    with pytest.raises(QuantError, match="out of range"):
        cq.qmoe(x, w13, w2, weights, torch.tensor([[0, 3], [1, 2]]))
    with pytest.raises(QuantError, match="int64"):
        cq.qmoe(x, w13, w2, weights, torch.tensor([[0, 1], [1, 2]], dtype=torch.int32))
    with pytest.raises(QuantError, match="not one layer's"):
        cq.qmoe(x, w13, w2, weights, torch.tensor([[0, 1], [1, 2]]), gated=False)
    assert cq.qmoe(x[:0], w13, w2, weights[:0], torch.zeros((0, 2), dtype=torch.int64)).shape == (0, 64)


def _qwen2_moe_gguf(root: Path, inter: int) -> Path:
    """A tiny Qwen2-MoE GGUF in Q8_0 whose experts are ``inter`` wide (its shared expert
    128: a rank's half of it is whole blocks)."""
    folder = write_tiny_model(root / f"hf-{inter}", "qwen2_moe",
                              overrides={"moe_intermediate_size": inter, "shared_expert_intermediate_size": 128})
    return write_moe_gguf(folder, root / f"qwen2-moe-{inter}.gguf", quant=gguf.GGMLQuantizationType.Q8_0)


@needs_kernels
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["cut", "whole"])
@pytest.mark.parametrize("inter", [64, 32])
def test_two_ranks_blocks_sum_to_the_one_rank_block(tmp_path, monkeypatch, one_thread, inter, expert_parallel) -> None:
    """Each rank's share of a GGUF's MoE block, built as a tensor-parallel rank builds it:
    the ranks' partial sums (the decoder's all-reduce) give the one-rank block's output.
    Experts 64 wide cut into two 32-column halves of whole Q8_0 blocks and stay in them;
    32 wide, a rank's 16 columns would split the blocks, and the experts are read dense (so
    the ranks then differ from one rank by the int8 rounding of its activations). Under
    expert parallelism every rank's experts are whole and stay in their blocks."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    loaded = load_model(_qwen2_moe_gguf(tmp_path, inter), dtype="float32")
    config, layer = loaded.config, loaded.config.moe.sparse_layers[0]

    def block(tp: TensorParallel) -> SparseMoeBlock:
        get = ShardedWeights(loaded.weights, torch.float32, torch.device("cpu"), tp)
        return SparseMoeBlock(config, layer, get, Linear, tp)

    one = block(SINGLE)
    ranks = [block(TensorParallel(rank=r, world_size=2, expert_parallel=expert_parallel)) for r in range(2)]
    assert isinstance(one.w13, QuantizedExperts)
    assert isinstance(one.shared_gate_up, QuantLinear) and isinstance(one.shared_down, QuantLinear)
    kept = inter == 64 or expert_parallel
    assert all(isinstance(b.w13, QuantizedExperts) == kept and isinstance(b.w2, QuantizedExperts) == kept
               for b in ranks)
    ops = get_ops("cpu")
    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = one(x, ops)
    got = ranks[0](x, ops) + ranks[1](x, ops)
    scale = want.abs().max().item()
    # kept: the same int8 products, summed in another order; dense: no int8 rounding at all
    torch.testing.assert_close(got, want, rtol=0, atol=(1e-5 if kept else 2e-2) * scale)
