"""Block-quantized weights: the torch reference against gguf's own dequantizer, the CPU
panel layout, and the C kernels (AVX-512 VNNI and portable paths) against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.ops.cpu import qmatmul as cq
from engine.ops.quant import (
    FORMATS,
    QuantError,
    QuantizedWeight,
    decode_blocks,
    dequantize_blocks,
    pack_panels,
    reference_matmul,
    unpack_panels,
)

needs_kernels = pytest.mark.skipif(not cq.available(), reason="C kernels not built")
# portable C, and AVX-512 VNNI / AMX-INT8 where this CPU has them: the int8-activation paths
INT8_PATHS = [p for p in cq.paths() if p != "amx-bf16"]
PATHS = INT8_PATHS


def random_blocks(fmt_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF rows of random codes and scales (fp16 scale fields kept small and finite)."""
    fmt = FORMATS[fmt_name]
    g = np.random.default_rng(seed)
    nb = k // fmt.block
    b = g.integers(0, 256, size=(n, nb, fmt.block_bytes), dtype=np.uint8)
    offsets = {"Q4_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "Q5_0": [0], "Q5_1": [0, 2], "Q3_K": [108], "Q2_K": [80, 82], "IQ4_NL": [0], "IQ4_XS": [0]}
    for off in offsets[fmt_name]:
        scale = g.uniform(-0.02, 0.02, size=(n, nb)).astype(np.float16)
        b[..., off : off + 2] = scale.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(b.reshape(n, nb * fmt.block_bytes))


@pytest.mark.parametrize("name", list(FORMATS))
def test_reference_dequantize_matches_gguf(name):
    raw = random_blocks(name, 7, 512)
    expected = gguf_dequantize(raw.numpy(), GGMLQuantizationType(FORMATS[name].ggml_type))
    assert torch.equal(dequantize_blocks(raw, name, 512), torch.from_numpy(expected).reshape(7, 512))


@pytest.mark.parametrize("name", list(FORMATS))
def test_panels_round_trip_and_keep_the_files_bytes(name):
    fmt = FORMATS[name]
    raw = random_blocks(name, 35, 256, seed=1)  # 35 rows: the last panel padded
    dec = decode_blocks(raw, fmt, 256)
    back = unpack_panels(fmt, pack_panels(dec), 35, 256)
    assert torch.equal(back.codes, dec.codes)
    assert torch.equal(back.dequantize(), dec.dequantize())
    full = QuantizedWeight.from_blocks(random_blocks(name, 64, 512), fmt, 512)
    # The file's bytes, but for Q4_K/Q5_K's scales unpacked to bytes and Q3_K's to int8.
    assert full.nbytes <= 1.04 * 64 * (512 // fmt.block) * fmt.block_bytes


def test_decode_refuses_shapes_that_do_not_fit_the_format():
    with pytest.raises(QuantError, match="multiple of 256"):
        decode_blocks(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K", 96)
    with pytest.raises(QuantError, match="expected uint8"):
        decode_blocks(torch.zeros(2, 17, dtype=torch.uint8), "Q4_0", 32)
    with pytest.raises(QuantError, match="unsupported"):
        decode_blocks(torch.zeros(2, 18, dtype=torch.uint8), "IQ2_XS", 32)


def int8_activation_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The kernels' arithmetic in torch: x quantized per 32 columns to int8 (step amax/127,
    round half to even), then the fp32 product with the dequantized weight."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).clamp(-127, 127)
    xd = (xq * (amax / 127.0)).reshape(x.shape[0], -1)
    return xd.double() @ w.dequantize().double().T


def activation_error_bound(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """|error| of quantizing x to int8 is at most half a step per element, so the product
    moves by at most sum_k |w_k| * step_k / 2."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    half_step = (xf.abs().amax(-1, keepdim=True) / 127.0 / 2).expand_as(xf).reshape(x.shape[0], -1)
    return half_step.double() @ w.dequantize().abs().double().T


SHAPES = [  # (M tokens, N rows, K columns): one row, odd rows, a padded panel, many tokens
    (1, 1, 256), (1, 37, 512), (3, 16, 256), (5, 50, 768), (67, 33, 256),
]


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_qmatmul_matches_the_reference(name, path):
    fmt = FORMATS[name]
    shapes = SHAPES + ([(2, 21, 96), (9, 17, 32)] if fmt.block == 32 else [])  # K not a multiple of 256
    for i, (m, n, k) in enumerate(shapes):
        w = QuantizedWeight.from_blocks(random_blocks(name, n, k, seed=i), fmt, k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        x[0, :32] = 0.0  # an all-zero block: step 0
        exact = reference_matmul(x, w).double()
        emulated = int8_activation_reference(x, w)
        bound = activation_error_bound(x, w)
        for threads in (1, 2):
            got = cq.qmatmul(x, w, path=path, threads=threads).double()
            assert got.shape == (m, n)
            # Same arithmetic as the emulation up to fp32 summation order.
            scale = exact.abs().max().item() + 1e-3
            torch.testing.assert_close(got, emulated, rtol=0, atol=2e-5 * scale)
            # And within the activation rounding bound of the exact product.
            assert bool(((got - exact).abs() <= bound + 2e-5 * scale).all())


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
def test_qmatmul_bf16_activations(path):
    w = QuantizedWeight.from_blocks(random_blocks("Q4_1", 40, 512), "Q4_1", 512)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = cq.qmatmul(x, w, path=path)
    assert got.dtype == torch.bfloat16
    expected = int8_activation_reference(x, w)
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@needs_kernels
@pytest.mark.skipif("amx-bf16" not in cq.paths(), reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("name", list(FORMATS))
def test_amx_bf16_path_matches_the_reference(name):
    """bf16 activations and weights (each rounded once, relative error <= 2**-9) with fp32
    accumulation: the product errs by at most sum |x||w| * 2**-8; allowed 2**-7."""
    fmt = FORMATS[name]
    shapes = [(1, 37, 512), (17, 50, 256), (130, 64, 1024)] + ([(33, 21, 96)] if fmt.block == 32 else [])
    for i, (m, n, k) in enumerate(shapes):
        w = QuantizedWeight.from_blocks(random_blocks(name, n, k, seed=i), fmt, k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        want = reference_matmul(x, w).double()
        bound = (x.abs().double() @ w.dequantize().abs().double().T) * 2**-7 + 1e-6
        for threads in (1, 2):
            got = cq.qmatmul(x, w, path="amx-bf16", threads=threads).double()
            assert bool(((got - want).abs() <= bound).all()), (m, n, k, threads)
        got = cq.qmatmul(x.bfloat16(), w, path="amx-bf16")
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_1", "Q6_K", "Q5_0", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"])
def test_every_int8_path_agrees_on_a_wide_batch(name):
    w = QuantizedWeight.from_blocks(random_blocks(name, 64, 1024), name, 1024)
    x = torch.randn(130, 1024, generator=torch.Generator().manual_seed(4))
    a = cq.qmatmul(x, w, path="portable", threads=2)
    for path in INT8_PATHS[1:]:
        b = cq.qmatmul(x, w, path=path, threads=2)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("name", list(FORMATS))
def test_qrows_reads_embedding_rows(name):
    fmt = FORMATS[name]
    w = QuantizedWeight.from_blocks(random_blocks(name, 45, 256), fmt, 256)
    ids = torch.tensor([[0, 44, 17], [16, 16, 31]])
    dense = w.dequantize()
    got = cq.qrows(w, ids, torch.float32, threads=2)
    assert torch.equal(got, dense[ids])
    assert torch.equal(cq.qrows(w, ids, torch.bfloat16), dense[ids].bfloat16())


@needs_kernels
def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    w = QuantizedWeight.from_blocks(random_blocks("Q8_0", 20, 64), "Q8_0", 64)
    with pytest.raises(QuantError, match="out of range"):
        cq.qrows(w, torch.tensor([20]), torch.float32)
    with pytest.raises(QuantError, match="out of range"):
        cq.qrows(w, torch.tensor([-1]), torch.float32)
    with pytest.raises(QuantError, match="int64"):
        cq.qrows(w, torch.tensor([1], dtype=torch.int32), torch.float32)
    with pytest.raises(QuantError, match="K = 64"):
        cq.qmatmul(torch.randn(2, 32), w)
    with pytest.raises(QuantError, match="float32 or bfloat16"):
        cq.qmatmul(torch.randn(2, 64).half(), w)
    assert cq.qmatmul(torch.randn(0, 64), w).shape == (0, 20)


@needs_kernels
@pytest.mark.parametrize("name", list(FORMATS))
def test_c_repack_equals_the_torch_packing(name):
    fmt = FORMATS[name]
    raw = random_blocks(name, 37, 512, seed=5)
    expected = pack_panels(decode_blocks(raw, fmt, 512))
    got = cq.pack(raw, fmt, 512, threads=2)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize("tokens", [1, 5, 20])  # 20: the AMX-BF16 path where the CPU has it
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1"])
def test_a_widened_head_equals_its_bf16_output_cast_to_fp32(name: str, tokens: int) -> None:
    # A bf16 model's logits: the head writes fp32 holding the bf16-rounded values, in one
    # pass, exactly what qmatmul(x, w).float() gives.
    from engine.models.layers.linear import QuantLinear

    w = QuantizedWeight.from_blocks(random_blocks(name, 96, 256, seed=3), name, 256)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    head = QuantLinear([w], None)
    wide = head.widened(x)
    assert wide is not None and wide.dtype == torch.float32
    assert torch.equal(wide, head(x).float())
    assert head.widened(x.float()) is None  # fp32 activations: nothing to widen
    assert QuantLinear([w], torch.zeros(96, dtype=torch.bfloat16)).widened(x) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_are_quantized_as_defined(dtype: torch.dtype) -> None:
    # Per 32 columns: step = amax / 127, codes = round-half-even(x * (127 / amax)) clamped to
    # +-127, and xs = step * (sum of each 16-column half's codes), in fp32, value for value
    # (the AVX-512 and the compiled-C quantizers both; every matmul path reads them).
    from engine.ops.cpu._kernels import ffi, lib

    g = torch.Generator().manual_seed(9)
    x = (torch.randn(40, 32, generator=g) * torch.logspace(-3, 3, 40).unsqueeze(1)).to(dtype)
    x[3] = 0.0  # an all-zero block: step 0, codes 0
    x[5, :4] = torch.tensor([63.5, -63.5, 0.5, 127.0]).to(dtype) / 127 * x[5].float().abs().max().to(dtype)
    k = x.numel()
    xq = torch.empty(k, dtype=torch.int8)
    dx, xs = torch.empty(k // 32), torch.empty(k // 16)
    lib.eng_q_quantize_row(ffi.cast("void *", x.data_ptr()), int(dtype == torch.bfloat16), k,
                           ffi.cast("int8_t *", xq.data_ptr()), ffi.cast("float *", dx.data_ptr()),
                           ffi.cast("float *", xs.data_ptr()))
    v = x.float().view(-1, 32)
    amax = v.abs().amax(1)
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: IEEE division (127.0 / t is 127 * (1 / t))
    step = amax / c127
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    codes = torch.round(v * inv.unsqueeze(1)).clamp(-127, 127)
    assert torch.equal(xq.view(-1, 32).float(), codes)
    assert torch.equal(dx, step)
    halves = codes.view(-1, 2, 16).sum(-1)
    assert torch.equal(xs.view(-1, 2), step.unsqueeze(1) * halves)
