"""Grammar bitmasks applied to logits: every op set against a plain-torch oracle.

Structured output masks the logits of its constrained rows before sampling
(``Ops.apply_token_bitmask``): the torch reference uses xgrammar's kernel, the CPU op set
its own C loop. Both must forbid exactly the tokens whose bit is clear, only on the rows
named, and leave everything else alone.
"""

from __future__ import annotations

import pytest
import torch

from engine.ops import cpu
from engine.ops.reference import TorchOps


def oracle(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Unpack the bits one token at a time (no shared code with either kernel)."""
    out = logits.clone()
    covered = min(logits.shape[1], 32 * bitmask.shape[1])
    for i, r in enumerate(rows):
        words = bitmask[i].tolist()
        for t in range(covered):
            if not (words[t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def random_mask(n: int, words: int, gen: torch.Generator) -> torch.Tensor:
    """Rows mixing the word shapes a grammar makes: all clear, all set, and scattered."""
    mask = torch.randint(-(2**31), 2**31 - 1, (n, words), dtype=torch.int32, generator=gen)
    kind = torch.randint(0, 3, (n, words), generator=gen)
    mask[kind == 0] = 0
    mask[kind == 1] = -1
    return mask


OPS = [pytest.param(TorchOps(), id="torch-xgrammar")]
if cpu.available():
    OPS.append(pytest.param(cpu.CpuOps(), id="cpu-c"))


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("batch", "vocab", "rows"),
    [
        (1, 64, [0]),  # whole words only
        (3, 1000, [2, 0]),  # vocab not a multiple of 32, rows out of order, row 1 free
        (8, 49152, [1, 3, 4, 6, 7]),  # SmolLM2's vocabulary
        (40, 4101, list(range(40))),  # every row, enough work to go parallel
    ],
)
def test_forbidden_tokens_become_minus_infinity_on_the_named_rows_only(ops, threads, batch, vocab, rows):
    gen = torch.Generator().manual_seed(batch * vocab)
    logits = torch.randn(batch, vocab, generator=gen)
    mask = random_mask(len(rows), (vocab + 31) // 32, gen)
    want = oracle(logits, mask, rows)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops.apply_token_bitmask(logits, mask, rows)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("ops", OPS)
def test_rows_of_a_wider_tensor_keep_their_neighbouring_columns(ops):
    """Logits viewed out of a wider buffer (row stride > vocab): columns past the view stay."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 160, generator=gen)
    logits = wide[:, :100]
    before = wide.clone()
    mask = torch.zeros((2, 4), dtype=torch.int32)  # nothing allowed
    ops.apply_token_bitmask(logits, mask, [3, 1])
    assert torch.isneginf(wide[[3, 1], :100]).all()
    torch.testing.assert_close(wide[[0, 2]], before[[0, 2]], rtol=0, atol=0)
    torch.testing.assert_close(wide[:, 100:], before[:, 100:], rtol=0, atol=0)


@pytest.mark.skipif(not cpu.available(), reason="the C kernels are not built")
def test_a_row_index_outside_the_batch_raises_and_writes_nothing():
    logits = torch.randn(2, 64)
    before = logits.clone()
    mask = torch.zeros((2, 2), dtype=torch.int32)
    with pytest.raises(cpu.CpuKernelError):
        cpu.CpuOps().apply_token_bitmask(logits, mask, [0, 2])
    torch.testing.assert_close(logits, before, rtol=0, atol=0)
