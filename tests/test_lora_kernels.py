"""The LoRA kernels (the CPU path's C kernel, Triton) against the torch reference.

The reference (``engine.ops.reference.lora_add_reference``) shrinks and expands each run
of a slot's tokens with two fp32 matmuls; the kernels take the step's tokens grouped by
slot (SGMV: ``LoraSegments.order`` and its groups), in blocks of a few tokens. Both accumulate
in fp32 and round once into the output's dtype, so they differ by summation order only:
fp32 within 1e-5 on O(1) outputs (a wrong slot, a transposed B or a missed token moves
them by O(0.1)); bf16 within one rounding step of the output (2 ** -7 relative), since a
last-bit difference in the fp32 sum can flip the rounding.

Triton runs on CUDA where there is one, else interpreted on CPU (conftest sets
``TRITON_INTERPRET`` before triton is imported).
"""

from __future__ import annotations

import pytest
import torch

from engine.ops import LoraSegments, get_ops, lora_rows_paired, lora_rows_unpaired
from engine.ops.reference import lora_add_reference

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _segments(slots: list[int], device: str) -> LoraSegments:
    runs: list[tuple[int, int, int]] = []
    for t, s in enumerate(slots):
        if s < 0:
            continue
        if runs and runs[-1][2] == s and runs[-1][1] == t:
            runs[-1] = (runs[-1][0], t + 1, s)
        else:
            runs.append((t, t + 1, s))
    return LoraSegments(tuple(runs), torch.tensor(slots, dtype=torch.int32, device=device))


# Edges: one token; an all-base step; a mixed step with runs of four slots, base rows
# between them and a slot repeated after another; a prefill-sized run; ranks that are not
# a power of two (padded ranks) and an input width that is not a multiple of the blocks.
# Then decode-shaped steps, one token per request, the slots interleaved (so a group
# gathers tokens from all over the step): 32 tokens over 4 slots, over 16 slots beside base
# tokens, and groups of 1, 2, 3, 5 and 9 tokens in a shuffled order (every short block of
# the kernels' 4-token blocks), at ranks 8 and 16, with output widths off the column tiles.
_SHUFFLED = [3, -1, 0, 2, 4, 1, 4, 3, -1, 2, 4, 3, 1, 4, 0, 3, 4, 2, -1, 4, 3, 4, 1, 4, 3]
CASES = [
    ([2], 64, 96, 16),
    ([-1, -1, -1], 64, 96, 16),
    ([0, 0, -1, 1, 1, 1, 3, -1, 2, 0], 72, 40, 24),
    ([1] * 37 + [-1] * 3 + [2] * 5, 64, 200, 48),
    ([t % 4 for t in range(32)], 96, 160, 16),
    ([t % 17 - 1 for t in range(34)], 80, 136, 8),
    (_SHUFFLED, 88, 72, 16),
    (_SHUFFLED, 40, 264, 8),
    ([0, 1, -1, 1, 2], 64, 48, 9),  # an odd rank: no bf16 row pairs (the dot-product expand's)
]
def _case(slots, k, n, r, dtype, device):
    g = torch.Generator().manual_seed(len(slots) * 1000 + r)
    s = max(4, max(slots) + 1)
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    out = torch.randn(len(slots), n, generator=g).to(dtype)
    a = (torch.randn(s, r, k, generator=g) * 0.2).to(dtype)
    b = (torch.randn(s, r, n, generator=g) * 0.2).to(dtype)
    return [t.to(device) for t in (x, out, a, b)]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("slots", "k", "n", "r"), CASES)
def test_lora_add_matches_reference(backend, dtype, slots, k, n, r):
    device = _DEVICE if backend == "triton" else "cpu"
    x, out, a, b = _case(slots, k, n, r, dtype, device)
    segments = _segments(slots, device)
    expected = out.clone()
    lora_add_reference(expected, x, a, b, segments)
    got = out.clone()
    get_ops(backend).lora_add(got, x, a, b, segments)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    # Base-model rows are left bit for bit as they were.
    assert torch.equal(got[base_rows], out[base_rows])
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2**-7)
    # Each adapter row took its own slot: the delta is not zero where the slot is used.
    lora_rows = [t for t, s in enumerate(slots) if s >= 0]
    if lora_rows:
        assert (got[lora_rows].float() - out[lora_rows].float()).abs().max() > 0.05


@pytest.mark.parametrize(("slots", "k", "n", "r"), [c for c in CASES if c[3] % 2 == 0])
def test_lora_add_cpu_takes_b_as_row_pairs(slots, k, n, r):
    """B held as row pairs (``lora_rows_paired``: what the adapter slots hold where
    ``lora_pairs`` asks for it) gives the reference's result on the unpaired B."""
    ops = get_ops("cpu")
    x, out, a, b = _case(slots, k, n, r, torch.bfloat16, "cpu")
    segments = _segments(slots, "cpu")
    expected, got = out.clone(), out.clone()
    lora_add_reference(expected, x, a, b, segments)
    paired = lora_rows_paired(b).contiguous()
    assert paired.shape == (b.shape[0], r // 2, n, 2) and torch.equal(lora_rows_unpaired(paired), b)
    ops.lora_add(got, x, a, paired, segments)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2**-7)
    lora_rows = [t for t, s in enumerate(slots) if s >= 0]
    if lora_rows:
        assert (got[lora_rows].float() - out[lora_rows].float()).abs().max() > 0.05
    # The reference takes the pairs too (the CPU op's fallback for what its kernel refuses).
    again = out.clone()
    lora_add_reference(again, x, a, paired, segments)
    assert torch.equal(again, expected)


def test_lora_add_cpu_mixed_dtypes():
    # fp32 adapters (--lora-dtype float32) beside bf16 activations.
    slots = [0, 1, -1, 1]
    x, out, _, _ = _case(slots, 64, 48, 8, torch.bfloat16, "cpu")
    _, _, a, b = _case(slots, 64, 48, 8, torch.float32, "cpu")
    segments = _segments(slots, "cpu")
    expected, got = out.clone(), out.clone()
    lora_add_reference(expected, x, a, b, segments)
    get_ops("cpu").lora_add(got, x, a, b, segments)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2**-7)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_over_a_fused_projection_skips_only_zeros(backend, dtype) -> None:
    """A fused q/k/v slot: B's rows in three groups, each zero outside its slice's columns
    (block diagonal, as the slots hold them); ``slices`` lets a kernel skip the zeros. The
    result must be the reference's over the whole B."""
    device = _DEVICE if backend == "triton" else "cpu"
    bounds = (0, 40, 56, 72)  # q 40 columns, k and v 16 each; the tile edge inside none
    slots = [0, 1, -1, 1, 0, 2]
    x, out, a, _ = _case(slots, 64, 72, 24, torch.float32, "cpu")
    b = torch.zeros(4, 24, 72)
    g = torch.Generator().manual_seed(5)
    for j in range(3):
        b[:, j * 8 : (j + 1) * 8, bounds[j] : bounds[j + 1]] = torch.randn(4, 8, bounds[j + 1] - bounds[j], generator=g) * 0.2
    a[:, 5:8] = 0  # a padded rank inside the first slice
    x, out, a, b = (t.to(device=device, dtype=dtype) for t in (x, out, a, b))
    segments = _segments(slots, device)
    expected, got = out.clone(), out.clone()
    lora_add_reference(expected, x, a, b, segments)
    get_ops(backend).lora_add(got, x, a, b, segments, bounds)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # bf16: one rounding step of the output, as above
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2**-7)
    assert (got.float() - out.float()).abs().max() > 0.05


def test_segments_group_tokens_by_slot() -> None:
    """The grouped layout the kernels read, against a stable argsort of the per-token
    slots: every adapter token once, sorted by slot, a slot's tokens in step order; one
    group per slot in use, bounded where the slot changes."""
    slots = _SHUFFLED + [5, 5, -1]
    segments = _segments(slots, "cpu")
    table = torch.tensor(slots)
    adapter_tokens = torch.nonzero(table >= 0).flatten()
    expected_order = adapter_tokens[torch.argsort(table[adapter_tokens], stable=True)]
    assert torch.equal(segments.order.long(), expected_order)
    used, counts = torch.unique(table[adapter_tokens], return_counts=True)
    assert torch.equal(segments.group_slots.long(), used)
    assert torch.equal(segments.group_bounds.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    assert [g[2] for g in segments.groups] == used.tolist()
    assert [g[1] for g in segments.groups] == counts.cumsum(0).tolist()


def test_lora_add_cpu_refuses_a_slot_outside_the_pool() -> None:
    from engine.ops.cpu import CpuKernelError

    slots = [0, 4, -1]  # a pool of 4 slots: 4 is outside it
    x, out, a, b = _case(slots, 32, 16, 8, torch.float32, "cpu")
    with pytest.raises(CpuKernelError, match="outside the pool of 4"):
        get_ops("cpu").lora_add(out, x, a[:4], b[:4], _segments(slots, "cpu"))


def test_lora_add_cpu_strided_inputs_and_a_new_b_for_the_same_a() -> None:
    """CpuOps checks a pool's A and B once and keeps their pointers under A: a strided x
    or out must still take the reference (not the pointers of a contiguous layout), and a
    new B for the same A must be read, not the B first seen beside that A."""
    slots = [0, 1, -1, 1, 2, 0]
    x, out, a, b = _case(slots, 64, 48, 8, torch.float32, "cpu")
    ops, segments = get_ops("cpu"), _segments(slots, "cpu")
    wide = torch.randn(len(slots), 128)
    strided_x = wide[:, ::2]  # [T, 64], not contiguous
    strided_x.copy_(x)
    for xs, outs in ((x, out.clone()), (strided_x, out.clone()), (x, torch.randn(48, len(slots)).T.copy_(out))):
        expected = outs.clone()
        lora_add_reference(expected, xs, a, b, segments)
        ops.lora_add(outs, xs, a, b, segments)
        torch.testing.assert_close(outs, expected, atol=1e-5, rtol=1e-5)
    other_b = b.flip(0).clone()  # another B beside the same A
    expected, got = out.clone(), out.clone()
    lora_add_reference(expected, x, a, other_b, segments)
    ops.lora_add(got, x, a, other_b, segments)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got - out).abs().max() > 0.05
