"""What an engine's actors are built from: :class:`EngineParts`, the model runner,
tokenizer, limits and pool size that :mod:`engine.process.parts` loads before the actors
start and hands to :func:`engine.actors.system.run_actors`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core.admission import AdmissionLimits


@dataclasses.dataclass(slots=True)
class EngineParts:
    """Everything built before the actors start (in a worker thread: loading is slow)."""

    config: EngineConfig  # resolved: max_model_len and async_scheduling filled in
    model_name: str
    tokenizer: Any  # engine.models.tokenizer.Tokenizer
    limits: AdmissionLimits
    runner: Any  # engine.runner.model_runner.ModelRunner
    num_blocks: int
    grammar: Any = None  # engine.structured.GrammarBackend: compiles structured outputs
    pooler: Any = None  # engine.models.pooling.PoolerConfig of a pooling model, else None
    tokenizer_folder: Path | None = None  # where the tokenizer's files lie
    dtype: str = ""  # the weights' and activations' dtype ("bfloat16")
    quantization: str = "none"  # "gguf" when weights stay in their blocks
    # A vision-language model's engine.multimodal.ImagePreprocessor; None: text only.
    images: Any = None
    # The model's engine.models.config.ModelConfig (LoRA adapters are checked against it);
    # None where the front end could not read it.
    model_config: Any = None
    # The KV store of --kv-transfer-config (engine.runner.kv_store.KVStore); None: off.
    kv_store: Any = None
