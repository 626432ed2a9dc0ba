"""Suite-wide setup that must happen before any test module imports triton."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported. Without a GPU, the kernel tests
# run the kernels in its interpreter on CPU tensors; set it here, before any test module
# (or the engine code it imports) can import triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
