"""What one rank loads and builds: the model (with tensor parallelism, read lazily: the
runner reads the rank's slices), tokenizer, pooler, grammar backend and draft model
(:func:`load_rank`), then its model runner over a KV pool of a given size
(:func:`build_rank_runner`). Rank 0 runs both from
:mod:`engine.process.parts`; every other tensor-parallel rank from
:mod:`engine.process.workers`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.errors import ConfigError, ModelLoadError
from engine.models.loader import load_model, resolve_model
from engine.models.pooling import pooler_config
from engine.models.tokenizer import Tokenizer
from engine.ops import get_ops, resolve_backend
from engine.parallel import SINGLE
from engine.runner.logits_processors import load_logits_processors
from engine.runner.lora import LoraSettings
from engine.runner.model_runner import ModelRunner
from engine.runner.whisper_timestamps import whisper_timestamp_processor
from engine.structured import GrammarBackend

logger = logging.getLogger("engine")


@dataclasses.dataclass(slots=True)
class RankLoad:
    """What one rank loads before its pool is sized: the model (one rank: whole; a
    tensor-parallel rank: lazily, each tensor read in the rank's slice when its runner
    builds the model), the tokenizer, the pooler and the grammar backend."""

    path: Path
    loaded: Any  # engine.models.loader.LoadedModel
    tokenizer: Any
    pooler: Any
    eos_ids: tuple[int, ...]
    grammar: Any
    draft: Any = None  # speculative decoding's draft model (a LoadedModel), or None


def load_rank(config: EngineConfig, device: torch.device) -> RankLoad:
    """Load the model, tokenizer, pooler and grammar backend (blocking: seconds). Every
    tensor-parallel rank runs this, so that each builds the same grammar matchers."""
    t0 = time.perf_counter()
    path = resolve_model(config.model)
    loaded = _load_model(config, device, path)
    load_device = _load_device(config, device)
    t1 = time.perf_counter()
    logger.info("loaded %s (%s, %s) in %.2f s", path, loaded.config.architecture, loaded.dtype, t1 - t0)
    # --tokenizer: another folder's tokenizer and chat template (a GGUF's own otherwise).
    tokenizer = Tokenizer.from_folder(tokenizer_folder(config, loaded),
                                      generation_folder=loaded.folder)
    logger.info("tokenizer ready in %.2f s", time.perf_counter() - t1)
    pooler = pooler_config(loaded.config, loaded.folder, runner=config.runner, convert=config.convert,
                           pooling_type=config.pooling_type, normalize=config.pooling_normalize)
    if pooler is not None and config.logits_processor_names:
        raise ConfigError("logits_processors: a pooling model samples nothing to process",
                          field="logits_processors")
    if pooler is not None and config.enable_lora and loaded.config.is_encoder:
        raise ConfigError("enable_lora: adapters are served for decoder models (generating, or "
                          "embedding with --convert embed), not for a BERT encoder",
                          field="enable_lora")
    draft = _load_draft(config, loaded, tokenizer, pooler, load_device)
    if loaded.config.is_encoder:
        loaded = _with_sep(loaded, tokenizer)
    eos_ids = _eos_ids(loaded, tokenizer)
    # Built once here: the grammar backends read every vocabulary entry's bytes. A pooling
    # model samples nothing, so it needs none.
    grammar = None if pooler is not None else GrammarBackend(
        tokenizer, vocab_size=loaded.config.vocab_size, stop_token_ids=eos_ids,
        backend=config.structured_outputs_backend)
    return RankLoad(path, loaded, tokenizer, pooler, eos_ids, grammar, draft)


def _load_device(config: EngineConfig, device: torch.device) -> torch.device:
    """Where the checkpoint is read to: the rank's device, or the host for a split model on
    CUDA (the whole model may not fit one device; the runner moves only its cut there)."""
    split = config.tensor_parallel_size * config.pipeline_parallel_size > 1
    return torch.device("cpu") if split and device.type == "cuda" else device


def _load_model(config: EngineConfig, device: torch.device, path: Path) -> Any:
    """The checkpoint at ``path`` as this rank builds its model from it."""
    dtype, ops_backend = config.dtype, config.ops_backend
    split = config.tensor_parallel_size * config.pipeline_parallel_size > 1
    if split and device.type == "cuda":
        # Loaded on the host, in the layout and dtype of the rank's device.
        ops_backend = resolve_backend(config.ops_backend, device)
        if dtype == "auto" and path.suffix == ".gguf":
            dtype = "bfloat16"  # what a GGUF loads as on CUDA
    # A tensor-parallel rank reads only its slices of each tensor, and a pipeline stage only
    # its layers, when its runner builds the model (engine/models/checkpoint.py): no rank
    # holds the whole checkpoint.
    return load_model(path, dtype=dtype, device=_load_device(config, device),
                      quantization=config.quantization, ops_backend=ops_backend, lazy=split,
                      hf_overrides=config.hf_overrides,
                      language_model_only=config.limit_mm_per_prompt == 0)


def reload_weights(config: EngineConfig, device: torch.device) -> Any:
    """The checkpoint's tensors read again as :func:`load_rank` read them (sleep mode's
    level 2 wake: ``ModelRunner.wake_up`` rebuilds the model from them)."""
    return _load_model(config, device, resolve_model(config.model)).weights


def _read_draft(config: EngineConfig, device: torch.device) -> Any:
    """The draft model of ``--speculative-config``, as the target is loaded."""
    spec = config.speculative
    return load_model(resolve_model(spec.model), dtype=spec.dtype or config.dtype, device=device,
                      quantization=spec.quantization or config.quantization,
                      ops_backend=config.ops_backend)


def reload_draft_weights(config: EngineConfig, device: torch.device) -> Any:
    """The draft model's tensors read again (sleep mode's level 2 wake-up)."""
    return _read_draft(config, _load_device(config, device)).weights


def tokenizer_folder(config: EngineConfig, loaded: Any) -> Path:
    """Where the tokenizer's files lie: ``--tokenizer`` (a path by now: Hub ids were
    resolved by engine.process.names), else the model's folder."""
    return Path(config.tokenizer) if config.tokenizer else loaded.folder


def build_rank_runner(config: EngineConfig, load: RankLoad, device: torch.device,
                      num_blocks: int, tp: Any = None) -> Any:
    """The rank's :class:`~engine.runner.model_runner.ModelRunner` over ``num_blocks`` KV
    blocks; ``tp`` (engine.parallel.TensorParallel) names its slice of the model."""
    return ModelRunner(
        load.loaded,
        device=device,
        ops=get_ops(config.ops_backend, device),
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        seed=config.seed,
        kv_cache_dtype=config.kv_cache_dtype,
        grammar=load.grammar,
        pooler=load.pooler,
        tp=tp if tp is not None else SINGLE,
        draft=load.draft,
        logits_processors=load_logits_processors(config.logits_processor_names) + _model_processors(load),
        lora=lora_settings(config, load.loaded.dtype),
        decode_graphs=device.type == "cuda" and not config.enforce_eager,
        max_model_len=config.max_model_len,
        state_checkpoints=config.state_checkpoints or 0,
        reload=functools.partial(reload_weights, config, device),
        reload_draft=functools.partial(reload_draft_weights, config, device) if load.draft is not None else None,
    )


def lora_settings(config: EngineConfig, model_dtype: torch.dtype) -> LoraSettings | None:
    """The runner's LoRA limits of ``config`` (None without --enable-lora)."""
    if not config.enable_lora:
        return None
    dtype = model_dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
    return LoraSettings(config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras, dtype)


def _load_draft(config: EngineConfig, loaded: Any, tokenizer: Any, pooler: Any,
                device: torch.device) -> Any:
    """The draft model of ``--speculative-config`` method ``draft_model`` (loaded as the
    target is), or ``None``; :class:`ConfigError` naming ``speculative_config`` for a draft
    the engine cannot pair with the target: another vocabulary (size or any token string),
    a model kind it cannot run as a draft, or a window shorter than what it would read."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    def bad(message: str) -> ConfigError:
        return ConfigError(f"speculative_config: {message}", field="speculative_config")

    target = loaded.config
    if config.tensor_parallel_size > 1:
        raise bad("draft_model is not supported with tensor_parallel_size above 1")
    if pooler is not None or target.is_encoder or target.vision is not None:
        raise bad("draft_model needs a text-generating target (not a pooling, encoder or "
                  "vision model)")
    t0 = time.perf_counter()
    try:
        draft = _read_draft(config, device)
    except (ModelLoadError, ConfigError, ValueError, OSError) as exc:
        raise bad(f"model {spec.model!r} cannot be loaded as the draft: {exc}") from exc
    if draft.config.is_encoder or draft.config.vision is not None:
        raise bad(f"model {spec.model!r} ({draft.config.architecture}) cannot run as a draft: "
                  "it must be a text-only decoder")
    if draft.config.vocab_size != target.vocab_size:
        raise bad(f"model {spec.model!r} has a vocabulary of {draft.config.vocab_size} tokens, "
                  f"the target {target.vocab_size}: a draft must share the target's vocabulary")
    draft_tokenizer = Tokenizer.from_folder(draft.folder)
    ids = range(target.vocab_size)
    mine, theirs = tokenizer.convert_ids_to_tokens(ids), draft_tokenizer.convert_ids_to_tokens(ids)
    differ = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
    if differ is not None:
        raise bad(f"model {spec.model!r}: token {differ} is {theirs[differ]!r} in the draft's "
                  f"tokenizer and {mine[differ]!r} in the target's: a draft must share the "
                  "target's vocabulary")
    # The scheduler gives back blocks before the target's window; a draft layer that sees
    # further back would read them after they are reused.
    window = target.released_window
    if window and not (all(draft.config.layer_windows)
                       and max(draft.config.layer_windows) <= window):
        raise bad(f"model {spec.model!r} attends further back than the target's sliding "
                  f"window of {window} tokens, whose older KV blocks are given back")
    logger.info("draft model %s (%s, %s) loaded in %.2f s; %d tokens proposed a step", spec.model,
                draft.config.architecture, draft.dtype, time.perf_counter() - t0,
                spec.num_speculative_tokens)
    return draft


def _with_sep(loaded: Any, tokenizer: Any) -> Any:
    """The loaded encoder with its [SEP] id, which marks where a pair's segment B starts."""
    sep = tokenizer.token_to_id("[SEP]")
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, sep_token_id=sep))


def _model_processors(load: RankLoad) -> tuple[type, ...]:
    """The logits processors the model's own decoding needs: Whisper's suppressed tokens
    and timestamp rules (applied to the transcriptions, and the timestamp rules to those
    that ask for timestamps; see engine.runner.whisper_timestamps)."""
    if getattr(load.loaded.config.vision, "kind", None) != "whisper":
        return ()
    no_timestamps = load.tokenizer.token_to_id("<|notimestamps|>")
    gen = load.loaded.generation_config
    eos = gen.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else min(load.eos_ids)
    vocab = load.loaded.config.vocab_size

    def ids(key: str) -> tuple[int, ...]:  # ids past the vocabulary suppress nothing, as in transformers
        given = gen.get(key) or ()
        return tuple(sorted({int(t) for t in given if isinstance(t, int) and 0 <= t < vocab}))

    return (whisper_timestamp_processor(no_timestamps, eos, gen.get("max_initial_timestamp_index", 50),
                                        ids("suppress_tokens"), ids("begin_suppress_tokens")),)


def _eos_ids(loaded: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids of the tokenizer, the model config and generation_config.json, merged."""
    ids = set(tokenizer.eos_token_ids) | set(loaded.config.eos_token_ids)
    gen = loaded.generation_config.get("eos_token_id")
    ids |= set(gen) if isinstance(gen, list) else ({gen} if isinstance(gen, int) else set())
    return tuple(sorted(ids))
