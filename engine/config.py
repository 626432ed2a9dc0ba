"""One frozen engine configuration, checked once when built and passed explicitly."""

from __future__ import annotations

import argparse
import dataclasses

from engine.errors import InvalidParamError

DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto" stores K/V in the model dtype; int8 and fp8 (e4m3) store 8-bit codes plus a scale
# per token and KV head (engine.ops.QuantizedKV).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("auto", "gguf", "none")  # see engine.models.loader
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")  # see engine.structured


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Everything that shapes an engine. Environment variables are read by the CLI only.

    ``kv_cache_memory`` is the KV pool's budget: an int is bytes, a float in (0, 1] is a
    fraction of the device's free memory (on CPU, of the available system memory).
    ``max_model_len`` of ``None`` takes the model's ``max_position_embeddings``.
    """

    model: str | None = None  # a HF folder or a .gguf file; None is the default SmolLM2
    served_model_name: str | None = None
    dtype: str = "auto"
    # "auto"/"gguf": a GGUF's block-quantized matrices stay in their blocks (CPU); "none":
    # dequantize every weight to dtype at load.
    quantization: str = "auto"
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    ops_backend: str = "auto"  # "auto", "torch", "cpu" or "triton"; see engine.ops.get_ops
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # 2 GiB default: ample for SmolLM2's 30 layers x 3 KV heads x 64 dims (about 46 KB a
    # token in fp32), i.e. ~46k tokens, without taking a shared CPU machine's memory.
    kv_cache_memory: int | float = 2 * 1024**3
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority"
    max_queued_requests: int = 1024
    # Plan step N+1 while step N runs. None: on with CUDA, where the GPU runs a step while
    # the host plans; off on CPU, where both share the same cores and the overlap measured
    # no gain while costing each new request one more step before its first token.
    async_scheduling: bool | None = None
    seed: int = 0
    # "auto": generation_config.json's sampling defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty) apply to requests that leave them out, as in vLLM; "none": the
    # engine's own defaults (temperature 1, no truncation).
    generation_config: str = "auto"
    # Times the actors restart in place after a crash before the engine stays dead. 0 for
    # the embedded API: a crash is a bug the caller sees; `serve` defaults to 5.
    max_engine_restarts: int = 0
    # Grammar library for structured output (engine.structured): "xgrammar", "guidance"
    # (llguidance) or "auto" (xgrammar, and llguidance for JSON schemas xgrammar refuses).
    structured_outputs_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidParamError(f"dtype must be one of {DTYPES}, got {self.dtype!r}", param="dtype")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidParamError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}", param="quantization")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidParamError(f"device must be auto, cpu or cuda[:N], got {self.device!r}", param="device")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParamError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
                param="kv_cache_dtype",
            )
        if self.ops_backend not in ("auto", "torch", "cpu", "triton"):
            raise InvalidParamError(f"ops_backend must be auto, torch, cpu or triton, got {self.ops_backend!r}", param="ops_backend")
        if self.generation_config not in ("auto", "none"):
            raise InvalidParamError(f"generation_config must be auto or none, got {self.generation_config!r}", param="generation_config")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise InvalidParamError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}", param="scheduling_policy")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_queued_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParamError(f"{name} must be a positive integer, got {value!r}", param=name)
        if self.block_size & (self.block_size - 1):
            raise InvalidParamError(f"block_size must be a power of two, got {self.block_size}", param="block_size")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise InvalidParamError(
                f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, "
                f"got {self.structured_outputs_backend!r}", param="structured_outputs_backend")
        restarts = self.max_engine_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise InvalidParamError(f"max_engine_restarts must be a non-negative integer, got {restarts!r}", param="max_engine_restarts")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidParamError(f"max_model_len must be positive, got {self.max_model_len}", param="max_model_len")
        mem = self.kv_cache_memory
        if isinstance(mem, bool) or not isinstance(mem, (int, float)):
            raise InvalidParamError(f"kv_cache_memory must be bytes or a fraction, got {mem!r}", param="kv_cache_memory")
        if isinstance(mem, float) and not 0.0 < mem <= 1.0:
            raise InvalidParamError(f"kv_cache_memory as a fraction must be in (0, 1], got {mem}", param="kv_cache_memory")
        if isinstance(mem, int) and mem < 1:
            raise InvalidParamError(f"kv_cache_memory must be positive, got {mem}", param="kv_cache_memory")


def parse_memory(text: str) -> int | float:
    """Parse a CLI memory budget: ``0.5`` (fraction), ``1073741824``, ``512MiB``, ``2GB``.

    Raises ``argparse.ArgumentTypeError`` (so argparse prints the message as is) for text
    that is neither, and for a decimal above 1, which is no fraction and, without a unit,
    no byte count either.
    """
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    s = text.strip().lower().removesuffix("b")
    try:
        for suffix in sorted(units, key=len, reverse=True):
            if s.endswith(suffix):
                return int(float(s[: -len(suffix)]) * units[suffix])
        value = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size: give bytes (1073741824, 512MiB, 2GB) or a "
            "fraction of free memory (0.5)"
        ) from None
    if "." not in s:
        return int(value)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a fraction of free memory must be in (0, 1]; give bytes as an "
            "integer or with a unit (512MiB, 2GB)"
        )
    return value
