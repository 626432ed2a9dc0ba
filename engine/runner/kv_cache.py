"""Sizing and allocating the paged KV pool.

Each layer owns one K and one V tensor of ``[num_blocks, block_size, num_kv_heads,
head_dim]`` (see :mod:`engine.ops` for the slot layout); a block therefore costs
``2 * layers * block_size * kv_heads * head_dim * itemsize`` bytes across the model.
With ``kv_cache_dtype`` int8 or fp8 each is a :class:`engine.ops.QuantizedKV`: one byte
per value plus a 4-byte scale per token and KV head, ``2 * layers * block_size * kv_heads
* (head_dim + 4)`` bytes a block (53% of bf16 at head_dim 64, 52% at 128).

With tensor parallelism (``tp``) each rank's pool holds only its own KV heads
(:func:`engine.models.layers.shard.local_heads`: ``num_kv_heads / N``, or one copied head when
there are fewer KV heads than ranks), so a block costs each rank that share and the same
budget buys each rank ``N`` times the blocks (fewer where heads are copied). Every rank
must run the same block count: the scheduler's pool is one for all of them.

A model with multi-head latent attention (DeepSeek, ``ModelConfig.mla``) caches one
tensor a layer, its one KV head being the latent that serves as both K and V: each
layer's pair is that tensor twice, and a block costs half the formula above.
"""

from __future__ import annotations

import math
import mmap
import weakref
from typing import Any

import torch

from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.models.layers.shard import local_heads
from engine.models.mamba_config import state_bytes_per_slot
from engine.ops import KVCache, QuantizedKV
from engine.parallel import SINGLE, TensorParallel

# EngineConfig.kv_cache_dtype -> the codes' dtype; "auto" stores K/V in the model's dtype.
KV_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_BYTES = 4  # one fp32 scale per token and KV head


def kv_tensors_per_layer(model_config: ModelConfig) -> int:
    """2 (K and V), or 1 where one latent tensor serves as both (``ModelConfig.mla``)."""
    return 1 if getattr(model_config, "mla", None) is not None else 2


def bytes_per_block(
    model_config: ModelConfig, dtype: torch.dtype, block_size: int, *, kv_cache_dtype: str = "auto",
    tp: TensorParallel = SINGLE,
) -> int:
    """Bytes one block takes across every layer, K and V together (scales included), in
    one rank's pool."""
    heads, dim = local_heads(model_config, tp)[1], model_config.head_dim
    if kv_cache_dtype in KV_CODE_DTYPES:
        per_token = heads * (dim * KV_CODE_DTYPES[kv_cache_dtype].itemsize + SCALE_BYTES)
    else:
        per_token = heads * dim * dtype.itemsize
    layers = len(attention_layers(model_config, tp))
    return kv_tensors_per_layer(model_config) * layers * block_size * per_token


def attention_layers(model_config: ModelConfig, tp: TensorParallel = SINGLE) -> list[int]:
    """This pipeline stage's layers that attend (and so keep K/V): all of them but a hybrid
    model's recurrent (Mamba, Gated DeltaNet) layers, which keep states instead (:func:`state_bytes`), and
    Nemotron-H's MLP layers, which keep nothing."""
    m = getattr(model_config, "recurrent", None)
    other = () if m is None else (*m.layers, *m.mlp_layers)
    return [i for i in tp.stage.layer_range(model_config.num_hidden_layers) if i not in other]


def state_bytes(model_config: ModelConfig, dtype: torch.dtype, slots: int, tp: TensorParallel = SINGLE) -> int:
    """The recurrent states of ``slots`` requests over this stage's recurrent layers (0 for a
    model without any): allocated beside the KV pool, out of the same budget."""
    recurrent = getattr(model_config, "recurrent", None)
    if recurrent is None:
        return 0
    layers = [i for i in tp.stage.layer_range(model_config.num_hidden_layers) if i in recurrent.layers]
    return slots * state_bytes_per_slot(recurrent.local(tp.world_size), len(layers), dtype.itemsize)


def free_memory(device: torch.device | str) -> int:
    """Bytes free on ``device``: CUDA's free memory, or MemAvailable on a CPU host."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    raise OSError("/proc/meminfo has no MemAvailable line")


# The pool's budget on CPU when --kv-cache-memory is not given: ample for SmolLM2's 30
# layers x 3 KV heads x 64 dims (about 46 KB a token in fp32), i.e. ~46k tokens, without
# taking a shared CPU machine's memory.
CPU_DEFAULT_BUDGET = 2 * 1024**3
# Set aside on CUDA beside the step's activations: the CUDA graphs' pool, the kernels'
# workspaces and the allocator's fragmentation.
CUDA_HEADROOM = 512 * 1024**2


def activation_bytes(model_config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A bound on one step's transient device memory, counted in fp32: a full step's
    hidden states, MLP and attention projections a few times over, and the logits of
    every sampled row with the sampler's working copies."""
    per_token = (4 * model_config.hidden_size + 3 * model_config.intermediate_size
                 + 2 * (model_config.num_attention_heads + 2 * model_config.num_key_value_heads)
                 * model_config.head_dim)
    return 4 * (max_num_batched_tokens * per_token + 4 * max_num_seqs * model_config.vocab_size)


def default_kv_budget(
    model_config: ModelConfig, device: torch.device | str, *, gpu_memory_utilization: float,
    max_num_batched_tokens: int, max_num_seqs: int,
) -> int:
    """The pool's budget in bytes when --kv-cache-memory is not given: on CPU
    :data:`CPU_DEFAULT_BUDGET`; on CUDA, as vLLM's ``--gpu-memory-utilization``, that
    share of the device's whole memory less what is in use already (the weights, and any
    other process's) and less the step's activations (:func:`activation_bytes`) and
    :data:`CUDA_HEADROOM`. Raises :class:`ConfigError` when that leaves nothing."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_DEFAULT_BUDGET
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserve = activation_bytes(model_config, max_num_batched_tokens, max_num_seqs) + CUDA_HEADROOM
    budget = int(total * gpu_memory_utilization) - (total - free) - reserve
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization {gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves "
            f"no KV cache: {(total - free) / 2**30:.1f} GiB are in use and a step's activations "
            f"take {reserve / 2**30:.1f} GiB. Raise it, or give --kv-cache-memory.",
            field="gpu_memory_utilization")
    return budget


def num_kv_blocks(
    model_config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    kv_cache_memory: int | float,
    device: torch.device | str,
    *,
    max_model_len: int | None = None,
    kv_cache_dtype: str = "auto",
    tp: TensorParallel = SINGLE,
) -> int:
    """How many blocks the budget buys (``kv_cache_memory`` is one rank's budget).

    ``kv_cache_memory`` is bytes (int) or a fraction of the device's free memory (float).
    Raises :class:`ConfigError` (``field="kv_cache_memory"``) when the pool could not
    hold even one request of ``max_model_len`` tokens (default: the model's maximum).
    """
    if isinstance(kv_cache_memory, float):
        budget = int(free_memory(device) * kv_cache_memory)
    else:
        budget = int(kv_cache_memory)
    per_block = bytes_per_block(model_config, dtype, block_size, kv_cache_dtype=kv_cache_dtype, tp=tp)
    blocks = budget // per_block
    max_len = max_model_len or model_config.max_position_embeddings
    needed = -(-max_len // block_size)
    if blocks < needed:
        raise ConfigError(
            f"kv_cache_memory of {budget} bytes gives {blocks} KV blocks of {per_block} bytes; "
            f"one request of {max_len} tokens needs {needed}. Raise kv_cache_memory or lower "
            f"max_model_len.",
            field="kv_cache_memory",
        )
    return int(blocks)


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    kv_cache_dtype: str = "auto",
    tp: TensorParallel = SINGLE,
    state_slots: int = 0,
) -> list[tuple[KVCache, KVCache]]:
    """One zeroed ``(k_cache, v_cache)`` pair per layer: tensors of ``dtype``, or with
    ``kv_cache_dtype`` int8/fp8, :class:`QuantizedKV` codes and scales; with ``tp``, of
    this rank's KV heads only. Under latent attention each pair is one tensor twice
    (:func:`kv_tensors_per_layer`).

    Zeroed, not empty: attention gathers whole blocks and masks the unused tail, and a
    masked weight of 0 times a NaN left in fresh memory would still be NaN.

    On CPU the pool is anonymous memory maps: the kernel hands out its pages zeroed on
    first touch, so a page is resident only once a block on it has been written or read
    (``torch.zeros`` would write every byte at startup and keep the whole budget resident).

    A hybrid model's recurrent layers get their states instead: ``state_slots``
    requests' worth each (engine.models.layers.mamba).
    """
    stage = tp.stage.layer_range(model_config.num_hidden_layers)  # a pipeline stage's own
    attending = attention_layers(model_config, tp)
    layers = len(attending)
    shape = (num_blocks, block_size, local_heads(model_config, tp)[1], model_config.head_dim)
    code_dtype = KV_CODE_DTYPES.get(kv_cache_dtype)
    # Codes (or values) of every layer's K and V first, then the scales: each region is
    # laid out block-major, so low block ids stay on a compact set of pages.
    n = kv_tensors_per_layer(model_config)
    data = _zeros((n * layers, *shape), code_dtype or dtype, device)
    if code_dtype is None:
        caches: list[KVCache] = [data[i] for i in range(n * layers)]
    else:
        scales = _zeros((n * layers, *shape[:-1]), torch.float32, device)
        caches = [QuantizedKV(data[i], scales[i]) for i in range(n * layers)]
    pairs = [(caches[n * i], caches[n * i + n - 1]) for i in range(layers)]
    if layers == len(stage):
        return pairs
    # A hybrid model: its recurrent layers' pairs are their (conv, state) tensors, a slot each;
    # an MLP layer's (Nemotron-H's) two empty tensors.
    recurrent = model_config.recurrent
    states = iter(_state_pairs(recurrent.local(tp.world_size), sum(i in recurrent.layers for i in stage),
                               state_slots, dtype, device))
    kv = iter(pairs)
    empty = torch.empty(0, dtype=dtype, device=device)
    return [next(kv) if i in attending else next(states) if i in recurrent.layers else (empty, empty)
            for i in stage]


def _state_pairs(recurrent: Any, layers: int, slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed ``(conv_state [slots, *conv], state [slots, *ssm] fp32)`` (``recurrent``'s
    ``state_shapes()``: a Mamba layer's window and SSM state, a Gated DeltaNet layer's
    window and key-by-value state) for each of ``layers`` recurrent layers."""
    if layers and slots < 1:
        raise ConfigError("a model with recurrent layers needs a state slot per running "
                          "request (max_num_seqs of them)", field="max_num_seqs")
    conv, ssm = recurrent.state_shapes()
    return [(_zeros((slots, *conv), dtype, device), _zeros((slots, *ssm), torch.float32, device))
            for _ in range(layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return _lazy_zeros(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def _lazy_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes on CPU whose pages become resident only when first touched.

    A private anonymous map is zero-filled by the OS page by page on first access; the
    tensor keeps the map alive. Each layer's slice starts on a whole number of blocks, and
    a block is a few KiB, so a request's blocks touch a handful of pages per layer.
    """
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes]
    _LAZY_MAPS[tensor.untyped_storage().data_ptr()] = buffer
    return tensor


# The maps of _lazy_zeros by their address, while a tensor keeps them (sleep mode's
# release_pages gives back their pages).
_LAZY_MAPS: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()


def release_pages(kv_caches: list[tuple[KVCache, KVCache]]) -> int:
    """Give back to the OS the memory of every tensor of ``kv_caches`` (the KV pool, its
    scales, a hybrid model's state slots): sleep mode's "kv_cache". Each is a private
    anonymous map (:func:`_lazy_zeros`): its address stays, so nothing that points into it
    goes stale (the fused decode step's plan), and its pages read as zeros again when next
    touched, as a fresh pool's do. Returns the bytes of the maps released; a tensor not
    in such a map (a CUDA pool) is left as it is."""
    released = 0
    seen: set[int] = set()
    for layer in kv_caches:
        for cache in layer:
            for t in (cache.data, cache.scale) if isinstance(cache, QuantizedKV) else (cache,):
                address = t.untyped_storage().data_ptr()
                buffer = _LAZY_MAPS.get(address)
                if buffer is None or address in seen:
                    continue
                seen.add(address)
                buffer.madvise(mmap.MADV_DONTNEED)
                released += len(buffer)
    return released


def resident_bytes() -> int:
    """This process's resident set size (``VmRSS``), for logs and tests."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    raise OSError("/proc/self/status has no VmRSS line")


def copy_blocks(kv_caches: list[tuple[KVCache, KVCache]], copies: tuple[tuple[int, int], ...],
                device: torch.device) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's K and V (scales included): beam
    search's copy-on-write of a forked beam's partly filled last block. One indexed copy
    per tensor, so a step's copies cost one pass whatever their number."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for layer in kv_caches:
        for cache in layer[:1] if layer[0] is layer[1] else layer:  # one latent tensor: once
            tensors = (cache.data, cache.scale) if isinstance(cache, QuantizedKV) else (cache,)
            for t in tensors:
                t.index_copy_(0, dst, t.index_select(0, src))
