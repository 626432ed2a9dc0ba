"""Suite-wide setup: the Triton interpreter switch (before any test module imports triton)
and the fixtures several modules share."""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported. Without a GPU, the kernel tests
# run the kernels in its interpreter on CPU tensors; set it here, before any test module
# (or the engine code it imports) can import triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
