"""Triton kernels of the ``Ops`` protocol, one module per kernel family.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` decorator runs, that is when these
modules are first imported: a process that wants the CPU interpreter (the tests) must set
it before importing anything under ``engine.ops.triton``. Changing it later has no effect
on kernels already decorated.

Modules: ``kv_cache`` (slot-mapped K/V scatter), ``attention_decode`` (flash-decoding
split-K over paged KV plus its reduce), ``attention_prefill`` (varlen online-softmax over
paged KV), ``sampling`` (temperature/top-k/top-p/min-p/greedy with Philox draws),
``norm_rope`` (fused add+RMSNorm, in-place RoPE, SiLU-and-mul), ``fused_moe`` (grouped
expert GEMMs over expert-sorted tokens).
"""
