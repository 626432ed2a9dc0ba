"""The Triton quantized matmul (GGUF blocks dequantized in registers) against the torch
reference, in Triton's interpreter on CPU (on the GPU where one exists)."""

from __future__ import annotations

import pytest
import torch
from test_quant import random_blocks

from engine.ops.quant import FORMATS, QuantError, QuantizedWeight, reference_matmul
from engine.ops.triton.quant_matmul import quant_matmul

pytestmark = pytest.mark.kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def blocks(name: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    raw = random_blocks(name, n, k, seed).to(DEVICE)
    return QuantizedWeight(FORMATS[name], (n, k), "blocks", {"raw": raw})


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 70, 256), (19, 16, 512)])
def test_triton_quant_matmul_matches_the_reference(name, m, n, k):
    w = blocks(name, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    got = quant_matmul(x, w).cpu()
    want = reference_matmul(x.cpu(), QuantizedWeight(w.fmt, w.shape, "blocks", {"raw": w.data["raw"].cpu()}))
    # fp32 in, fp32 accumulate: only summation order differs (tl.dot may use TF32 on a GPU).
    tol = 2e-2 if DEVICE.type == "cuda" else 1e-4
    torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item())


def test_triton_quant_matmul_refuses_what_it_cannot_read():
    with pytest.raises(QuantError, match="Q4_0/Q4_1/Q8_0/Q4_K"):
        quant_matmul(torch.zeros(1, 256, device=DEVICE), blocks("Q6_K", 4, 256))
    with pytest.raises(QuantError, match="K = 256"):
        quant_matmul(torch.zeros(1, 128, device=DEVICE), blocks("Q4_0", 4, 256))


# K an odd number of blocks where the format allows it: 3, 5 and 7 blocks of 32 columns, 3
# Q4_K super-blocks of 256.
ODD_K = {"Q4_0": 96, "Q4_1": 160, "Q8_0": 224, "Q4_K": 768}


def _reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    cpu = QuantizedWeight(w.fmt, w.shape, "blocks", {"raw": w.data["raw"].cpu()})
    return reference_matmul(x.reshape(-1, x.shape[-1]).cpu(), cpu).view(*x.shape[:-1], w.shape[0])


@pytest.mark.parametrize("name", list(ODD_K))
@pytest.mark.parametrize("m", [1, 37])  # one row (decode); three 16-row tiles, the last partial
def test_triton_quant_matmul_on_odd_shapes(name, m):
    """N = 33 (one partial 64-row tile) and K an odd number of blocks, in fp32."""
    k = ODD_K[name]
    w = blocks(name, 33, k, seed=k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    got, want = quant_matmul(x, w).cpu(), _reference(x, w)
    tol = 2e-2 if DEVICE.type == "cuda" else 1e-4  # as above: summation order (TF32 on a GPU)
    torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item())


UNIT_ROUNDOFF_BF16 = 2**-9 if DEVICE.type == "cuda" else 2**-8  # see the test below


@pytest.mark.parametrize("name", list(ODD_K))
def test_triton_quant_matmul_bf16_activations(name):
    """bf16 in and out, weights dequantized to bf16 in registers, fp32 accumulation; rows of
    a [2, 19, K] batch (38 rows) and of a single row. Bound per entry, with ``u`` the unit
    roundoff of a cast to bf16: each weight's rounding errs by at most ``u`` of itself, so
    the sum by ``u * sum|x * w|``, and the result's rounding adds ``u`` of it (5% slack for
    fp32 accumulation order). ``u`` is 2**-9 on a GPU (round to nearest) and 2**-8 in the
    CPU interpreter, which truncates (measured: 1 + 3 * 2**-9 casts to 1.0). Measured
    errors reach 0.55 of the interpreter's bound; a wrong scale or code is off by far more."""
    k = ODD_K[name]
    w = blocks(name, 33, k, seed=k)
    g = torch.Generator().manual_seed(k)
    for x in (torch.randn(2, 19, k, generator=g), torch.randn(1, k, generator=g)):
        x = x.to(torch.bfloat16).to(DEVICE)
        got = quant_matmul(x, w)
        assert got.dtype == torch.bfloat16 and got.shape == (*x.shape[:-1], 33)
        want = _reference(x, w)  # x's bf16 values, exactly, times the fp32 weights
        dense = QuantizedWeight(w.fmt, w.shape, "blocks", {"raw": w.data["raw"].cpu()}).dequantize()
        magnitude = (x.float().cpu().abs().reshape(-1, k) @ dense.abs().T).view(want.shape)
        bound = UNIT_ROUNDOFF_BF16 * (magnitude + want.abs()) * 1.05
        assert bool(((got.float().cpu() - want).abs() <= bound).all()), name


def test_triton_quant_matmul_of_no_rows_is_empty():
    w = blocks("Q8_0", 16, 64)
    assert quant_matmul(torch.zeros(0, 64, device=DEVICE), w).shape == (0, 16)


def test_triton_quant_matmul_writes_column_slices_of_one_output():
    """Parts of two formats side by side in one output, as a fused q/k/v does when v is
    in another format than q/k; columns past the slices stay untouched. An ``out`` whose
    columns are not contiguous is refused."""
    a, b = blocks("Q4_K", 20, 256, seed=1), blocks("Q8_0", 12, 256, seed=2)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = torch.full((3, 40), float("nan"), device=DEVICE)
    quant_matmul(x, a, out=out[:, :20])
    quant_matmul(x, b, out=out[:, 20:32])
    want = torch.cat([_reference(x, a), _reference(x, b)], -1)
    tol = 2e-2 if DEVICE.type == "cuda" else 1e-4  # as above: summation order
    torch.testing.assert_close(out[:, :32].cpu(), want, rtol=0, atol=tol * want.abs().max().item())
    assert bool(out[:, 32:].isnan().all())
    with pytest.raises(QuantError, match="out must be"):
        quant_matmul(x, a, out=torch.empty(20, 3, device=DEVICE).T)
