"""Suite-wide setup: the Triton interpreter switch (before any test module imports triton)
and the fixtures several modules share."""

from __future__ import annotations

import os

# `make test` runs the suite in two pytest-xdist workers, one test file each at a time
# (`-n 2 --dist loadfile`): most tests keep one core busy, so two workers halve the wall
# time on the 2-core CI machine. Each worker then computes on one thread, and so do the
# servers and ranks its tests spawn (they inherit the variable): two workers of two OpenMP
# threads each would meet at barriers held by a descheduled thread. Tests of the 2-thread
# kernel paths set their thread count themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Triton reads TRITON_INTERPRET when it is first imported. Without a GPU, the kernel tests
# run the kernels in its interpreter on CPU tensors; set it here, before any test module
# (or the engine code it imports) can import triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The pooling tests' models and oracle outputs, built once per session (test_pooling.py
# and test_http_pooling.py both use them; sentence-transformers' encode takes seconds).
from pooling_fixtures import classifier, cross_encoder, minilm, st_embeddings, tagger  # noqa: E402, F401

# The files that hold the suite's longest setups and tests (make test's --durations): run
# first, longest first (each file's total of setups and calls, measured with
# --durations=0). `--dist loadfile` hands files out in collection order as the workers free
# up, so with these at the front the last files are short ones and neither worker waits
# long for the other at the end (with them last in alphabetical order, one ran alone for
# minutes).
HEAVY_FIRST = (
    "test_parity.py", "test_core_process.py", "test_http_cli.py", "test_pipeline_workers.py", "test_moe.py",
    "test_engine_e2e.py", "test_data_parallel_groups.py", "test_tensor_parallel_gguf.py",
    "test_tensor_parallel_workers.py", "test_pipeline_parallel.py", "test_sleep_mode.py", "test_gpt2_opt.py",
    "test_lora_moe.py", "test_lora_parallel.py", "test_quant_fidelity.py", "test_cli.py", "test_tensor_parallel.py",
    "test_beam_search.py", "test_grammar_compile_budget.py", "test_hub.py", "test_loader.py",
    "test_data_parallel_ray.py",
)


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001
    """The heavy files first (:data:`HEAVY_FIRST`), every other in collection order."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of tiny shapes (``pytest.mark.usefixtures``).

    Tiny shapes gain nothing from a second thread, and on a shared 2-core machine OpenMP
    regions that wait for a descheduled thread cost ~10 ms each (measured: 10x slower);
    the Triton interpreter runs numpy on tiny arrays, where a second thread only adds waits.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def interpreter_rounds_to_nearest(monkeypatch):
    """Triton's CPU interpreter converts fp32 to bf16 as a GPU does: to nearest, ties to even.

    On a GPU, a downcast with no rounding mode given (``x.to(tl.bfloat16)``, a store of fp32
    into a bf16 tensor) rounds to nearest even (``triton.language.semantic``'s ``cast``);
    the interpreter (triton 3.x ``runtime/interpreter.py``, ``_convert_float``) truncates
    instead, which pushes every bf16 intermediate toward zero and roughly doubles a model's
    bf16 error (the tiny Phi-3: 2.2x transformers' own bf16 error truncated, 1.1x rounded,
    as the torch ops). A model-level bf16 check of the kernels takes this fixture so it
    judges the kernels' arithmetic rather than the emulator's. A no-op where kernels run on
    CUDA; fails loudly (``monkeypatch.setattr``) if a Triton release renames the function.
    """
    if torch.cuda.is_available():
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(values, src, dst, rounding_mode):
        if not (src == tl.float32 and dst == tl.bfloat16 and rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ):
            return truncating(values, src, dst, rounding_mode)
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        # Add just under half a bf16 step, plus one when the kept part is odd (ties to
        # even), then drop the low 16 bits; a carry rolls into the exponent as it should.
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded[(bits & 0x7FFFFFFF) > 0x7F800000] = 0x7FC0  # NaN stays a (quiet) NaN
        return rounded.reshape(np.shape(values))

    monkeypatch.setattr(interpreter, "_convert_float", convert)
