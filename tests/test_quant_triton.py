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
