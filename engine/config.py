"""One frozen engine configuration, checked once when built and passed explicitly.

It is one room: every field, its flag's help and its check belong together (the flags are made
from this class), with the small parsers of the fields given as text (memory sizes,
speculative and LoRA module specs) beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

from engine.errors import ConfigError, InvalidParamError
from engine.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from engine.params import generation_override

DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto" stores K/V in the model dtype; int8 and fp8 (e4m3) store 8-bit codes plus a scale
# per token and KV head (engine.ops.QuantizedKV).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("auto", "gguf", "none")  # see engine.models.loader
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")  # see engine.structured
OPS_BACKENDS = ("auto", "torch", "cpu", "triton")  # see engine.ops.get_ops
ENGINE_CORE_MODES = ("auto", "inprocess", "process")  # see engine.process.cores
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")  # see engine.process.workers
# How chat message content reaches the chat template (engine.chat.template): "auto" reads
# the template, "string" joins text parts, "openai" gives the parts (vLLM's option).
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")


def parse_mm_limit(value: str) -> int:
    """``--limit-mm-per-prompt``: images (or a Qwen2-Audio's clips) per request, as ``4``
    or vLLM's ``{"image": 4}`` / ``{"audio": 2}`` (other modalities may only be 0: none is
    supported; no model here takes both images and audio)."""
    text = value.strip()
    if not text.startswith("{"):
        return int(text)
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(limits, dict) or any(
            k not in ("image", "audio") and v not in (0, None) for k, v in limits.items()):
        raise ValueError("only the image and audio modalities are supported: {\"image\": N} "
                         "or {\"audio\": N}")
    given = [int(limits[k]) for k in ("image", "audio") if limits.get(k) is not None]
    if len(given) == 2 and 0 not in given:
        raise ValueError("give images or audio a limit, not both: no model here takes both")
    return max(given) if given else 4


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


def parse_bytes(text: str) -> int:
    """Parse a CLI size in bytes: ``1048576``, ``512MiB``, ``2GB`` (no fractions)."""
    value = parse_memory(text)
    if isinstance(value, float):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (1048576, 64MiB)")
    return value


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); :class:`ConfigError` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"data_parallel_address must be HOST:PORT, got {text!r}",
                          field="data_parallel_address")
    return host.strip("[]"), int(port)


SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix")


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative-config``, as vLLM's JSON. ``method`` "ngram" (prompt lookup) proposes
    up to ``num_speculative_tokens`` tokens per step by matching the last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens against the prompt and output;
    "draft_model" has the model at ``model`` (a Hugging Face folder or a GGUF file with the
    target's vocabulary) propose ``num_speculative_tokens`` tokens, one forward each;
    "suffix" proposes what followed the context's longest suffix in the request's own
    context and in earlier requests' answers (engine.core.suffix), by vLLM's
    ``suffix_decoding_*`` keys."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    model: str | None = None  # draft_model: the draft's path
    # draft_model: the draft's dtype ("auto": the target's) and GGUF handling, as --dtype
    # and --quantization are for the target.
    dtype: str | None = None
    quantization: str | None = None
    # suffix (vLLM's keys and defaults): the trees' depth (match and proposal together),
    # the finished requests' answers kept, the proposal's length over the match's at most,
    # and the least estimated probability of a proposed path.
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None

    def to_json(self) -> str:
        """The canonical JSON text: the keys its method reads, those not given left out."""
        fields = dataclasses.asdict(self)
        return json.dumps({k: fields[k] for k in sorted(_SPECULATIVE_KEYS[self.method])
                           if fields[k] is not None})

    def describe(self) -> str:
        if self.method == "draft_model":
            return (f"draft_model {self.model}: {self.num_speculative_tokens} tokens a step "
                    "proposed by the draft, verified by the target in one forward")
        if self.method == "suffix":
            return (f"suffix: up to {self.num_speculative_tokens} tokens a step from the context "
                    f"and the last {self.suffix_decoding_max_cached_requests} answers (depth "
                    f"{self.suffix_decoding_max_tree_depth}, at most "
                    f"{self.suffix_decoding_max_spec_factor}x the match, paths of probability "
                    f">= {self.suffix_decoding_min_token_prob})")
        return (f"{self.method}: up to {self.num_speculative_tokens} tokens a step, matching "
                f"{self.prompt_lookup_max}..{self.prompt_lookup_min}-token suffixes")


# The keys each method reads (vLLM's names); any other key is refused, naming it.
_SPECULATIVE_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"method", "num_speculative_tokens", "model", "dtype", "quantization"},
    "suffix": {"method", "num_speculative_tokens", "suffix_decoding_max_tree_depth",
               "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob"},
}


def _json_object(value: Any, bad: Callable[[str], ConfigError]) -> dict[str, Any]:
    """``value`` (a flag's JSON text, or the dict given in code) as a dict; ``bad`` makes
    the error naming the flag."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise bad(f"must be a JSON object, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ProfilerConfig:
    """``--profiler-config``, as vLLM's JSON (its field names and defaults). ``profiler``
    "torch" traces each step's work on the model thread with ``torch.profiler`` between a
    start and a stop (``POST /start_profile``, ``LLM.start_profile``), writing one trace a
    start to ``torch_profiler_dir`` (engine.runner.profiler); "cuda" brackets the same
    steps with ``cudaProfilerStart``/``Stop`` for Nsight Systems (CUDA devices only)."""

    profiler: str
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    # CUDA only: a table of the ops by self CUDA time beside the trace (no CUDA time on CPU).
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    # vLLM's front end can trace itself too; this server's front end is never traced, so
    # either value leaves the traces as they are.
    ignore_frontend: bool = False
    delay_iterations: int = 0  # steps skipped after a start before the trace begins
    max_iterations: int = 0  # steps traced before the trace ends by itself (0: until stop)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


# vLLM's keys that ask for what is not built here: accepted at their default only.
_PROFILER_REFUSED = {"capture_torch_profiler": False, "detailed_trace_annotation": False,
                     "warmup_iterations": 0, "wait_iterations": 0}
_PROFILER_IGNORED = {"active_iterations"}  # vLLM reads it only with warmup_iterations


def parse_profiler_config(value: str | dict[str, Any]) -> ProfilerConfig | None:
    """A checked :class:`ProfilerConfig` from vLLM's JSON object (text or dict); None when
    it names no profiler. Anything else raises :class:`ConfigError` naming
    ``profiler_config``."""

    def bad(message: str) -> ConfigError:
        return ConfigError(f"profiler_config: {message}", field="profiler_config")

    value = _json_object(value, bad)
    fields = {f.name: f for f in dataclasses.fields(ProfilerConfig)}
    unknown = sorted(set(value) - set(fields) - set(_PROFILER_REFUSED) - _PROFILER_IGNORED)
    if unknown:
        raise bad(f"unknown key(s) {', '.join(unknown)}")
    for key, default in _PROFILER_REFUSED.items():
        if key in value and value[key] != default:
            raise bad(f"{key}={value[key]!r} is not supported by this engine (only {default!r})")
    options = {k: v for k, v in value.items() if k in fields}
    kind = options.get("profiler")
    folder = options.get("torch_profiler_dir", "")
    if kind is None:
        if folder:
            raise bad("torch_profiler_dir is only read with profiler 'torch'")
        return None
    if kind not in ("torch", "cuda"):
        raise bad(f"profiler must be 'torch' or 'cuda', got {kind!r}")
    for name, f in fields.items():
        if name in options and name not in ("profiler", "torch_profiler_dir"):
            ok = (isinstance(options[name], bool) if f.type == "bool"
                  else not isinstance(options[name], bool) and isinstance(options[name], int)
                  and options[name] >= 0)
            if not ok:
                raise bad(f"{name} must be {'true or false' if f.type == 'bool' else 'an integer >= 0'}, "
                          f"got {options[name]!r}")
    if not isinstance(folder, str):
        raise bad(f"torch_profiler_dir must be a path, got {folder!r}")
    if kind == "torch":
        if not folder:
            raise bad("torch_profiler_dir must be set when profiler is 'torch'")
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+://", folder):
            raise bad(f"torch_profiler_dir must be a local folder, got {folder!r}")
        options["torch_profiler_dir"] = os.path.abspath(os.path.expanduser(folder))
    elif folder:
        raise bad("torch_profiler_dir is only read with profiler 'torch'")
    return ProfilerConfig(**options)


def profiler_from_environment(profiler_config: Any) -> Any:
    """``profiler_config``, or where none is given and vLLM's older variable
    ``VLLM_TORCH_PROFILER_DIR`` is set, the torch profiler writing there (as vLLM reads
    it); read at the edges (the command line, ``LLM``)."""
    folder = os.environ.get("VLLM_TORCH_PROFILER_DIR")
    if profiler_config is None and folder:
        return json.dumps({"profiler": "torch", "torch_profiler_dir": folder})
    return profiler_config


# The image processor options --mm-processor-kwargs may set: Qwen-VL's pixel budget.
MM_PROCESSOR_KEYS = ("min_pixels", "max_pixels")


def parse_mm_processor_kwargs(value: str | dict[str, Any]) -> dict[str, int]:
    """The checked image processor options of a JSON object (text or dict): only
    ``min_pixels`` / ``max_pixels``, positive integers, min <= max; anything else raises
    :class:`ConfigError` naming ``mm_processor_kwargs``."""

    def bad(message: str) -> ConfigError:
        return ConfigError(f"mm_processor_kwargs: {message}", field="mm_processor_kwargs")

    value = _json_object(value, bad)
    unknown = sorted(set(value) - set(MM_PROCESSOR_KEYS))
    if unknown:
        raise bad(f"unknown key(s) {', '.join(unknown)} (this engine takes "
                  f"{', '.join(MM_PROCESSOR_KEYS)})")
    out = {}
    for key in MM_PROCESSOR_KEYS:
        if key in value:
            v = value[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{key} must be a positive integer, got {v!r}")
            out[key] = v
    if out.get("min_pixels", 0) > out.get("max_pixels", out.get("min_pixels", 0)):
        raise bad(f"min_pixels {out['min_pixels']} is over max_pixels {out['max_pixels']}")
    return out


def parse_speculative_config(value: str | dict[str, Any]) -> SpeculativeConfig:
    """The checked :class:`SpeculativeConfig` of a JSON object (text or dict); raises
    :class:`ConfigError` naming ``speculative_config`` for anything else."""

    def bad(message: str) -> ConfigError:
        return ConfigError(f"speculative_config: {message}", field="speculative_config")

    value = _json_object(value, bad)
    method = value.get("method")
    if method not in SPECULATIVE_METHODS:
        raise bad(f"method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    known = _SPECULATIVE_KEYS[method]
    unknown = sorted(set(value) - known)
    if unknown:
        raise bad(f"unknown key(s) {', '.join(unknown)} for method {method} (it reads "
                  f"{', '.join(sorted(known))})")
    ints = {}
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64):
            raise bad(f"{key} must be an integer in [1, 64], got {v!r}")
        ints[key] = v
    if method == "suffix":
        return _suffix_config(value, ints["num_speculative_tokens"], bad)
    if ints["num_speculative_tokens"] is None:
        raise bad("num_speculative_tokens is required")
    if method == "draft_model":
        return _draft_model_config(value, ints["num_speculative_tokens"], bad)
    # As vLLM, one bound given sets the other; neither: 4 down to 1.
    hi, lo = ints["prompt_lookup_max"], ints["prompt_lookup_min"]
    if hi is None and lo is None:
        hi, lo = 4, 1
    hi = hi if hi is not None else lo
    lo = lo if lo is not None else hi
    if lo > hi:
        raise bad(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
    return SpeculativeConfig(method, ints["num_speculative_tokens"], hi, lo)


def _draft_model_config(value: dict[str, Any], k: int, bad: Callable[[str], ConfigError]) -> SpeculativeConfig:
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise bad(f"model (the draft's path) is required for draft_model, got {model!r}")
    dtype, quantization = value.get("dtype"), value.get("quantization")
    if dtype is not None and dtype not in DTYPES:
        raise bad(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise bad(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    # The lookup bounds are the ngram method's; kept at their defaults, unused.
    return SpeculativeConfig("draft_model", k, 4, 1, model, dtype, quantization)


def _suffix_config(value: dict[str, Any], k: int | None, bad: Callable[[str], ConfigError]) -> SpeculativeConfig:
    """vLLM's suffix decoding keys, at vLLM's defaults where not given; without
    ``num_speculative_tokens``, the tree's depth (at most 64 here) bounds a proposal."""
    depth = value.get("suffix_decoding_max_tree_depth", 24)
    cached = value.get("suffix_decoding_max_cached_requests", 10000)
    factor = value.get("suffix_decoding_max_spec_factor", 1.0)
    prob = value.get("suffix_decoding_min_token_prob", 0.1)
    for key, v, lo, hi in (("suffix_decoding_max_tree_depth", depth, 2, 1024),
                           ("suffix_decoding_max_cached_requests", cached, 0, 10**7)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise bad(f"{key} must be an integer in [{lo}, {hi}], got {v!r}")
    for key, v, lo, hi in (("suffix_decoding_max_spec_factor", factor, 0.0, 1e6),
                           ("suffix_decoding_min_token_prob", prob, 0.0, 1.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or (
                key.endswith("factor") and v == 0):
            raise bad(f"{key} must be a number in {'(' if key.endswith('factor') else '['}{lo}, {hi}], "
                      f"got {v!r}")
    return SpeculativeConfig("suffix", k if k is not None else min(depth, 64), 4, 1,
                             suffix_decoding_max_tree_depth=depth,
                             suffix_decoding_max_cached_requests=cached,
                             suffix_decoding_max_spec_factor=float(factor),
                             suffix_decoding_min_token_prob=float(prob))


def parse_partition(value: Any) -> tuple[int, ...]:
    """``"4,4"`` (or the counts, through JSON): each pipeline stage's layer count."""
    if isinstance(value, str) and not re.fullmatch(r"\d+(,\d+)*", value.replace(" ", "")):
        raise ConfigError(f"pipeline_layer_partition must be comma-separated layer counts, "
                          f"got {value!r}", field="pipeline_layer_partition")
    return tuple(int(part) for part in (value.split(",") if isinstance(value, str) else value))


@dataclasses.dataclass(frozen=True, slots=True)
class LoraModule:
    """An adapter served from the start (``--lora-modules``): its name, folder and the base
    model it names as its parent in /v1/models (None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(value: Any) -> tuple[LoraModule, ...]:
    """``--lora-modules`` as vLLM takes it: each item ``name=path`` or a JSON object
    ``{"name", "path", "base_model_name"}`` (a list of either, or their canonical JSON)."""
    def bad(message: str) -> ConfigError:
        return ConfigError(f"lora_modules: {message}", field="lora_modules")

    if value is None:
        return ()
    items = json.loads(value) if isinstance(value, str) else list(value)
    modules = []
    for item in items:
        if isinstance(item, str) and not item.lstrip().startswith("{"):
            name, eq, path = item.partition("=")
            item = {"name": name.strip(), "path": path.strip()} if eq else item
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as exc:
                raise bad(f"{item!r} is neither name=path nor JSON ({exc})") from None
        if not isinstance(item, dict) or set(item) - {"name", "path", "base_model_name"}:
            raise bad(f"{item!r}: expected name=path or {{\"name\", \"path\", \"base_model_name\"}}")
        name, path, parent = item.get("name"), item.get("path"), item.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad(f"{item!r}: name and path must be non-empty strings")
        if parent is not None and not isinstance(parent, str):
            raise bad(f"{item!r}: base_model_name must be a string")
        modules.append(LoraModule(name, path, parent))
    if len({m.name for m in modules}) != len(modules):
        raise bad("two adapters share a name")
    return tuple(modules)


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How an :class:`EngineConfig` field appears on the command line (see
    :func:`add_engine_arguments`): its help, parsing and, where the default is ``None``,
    what that default means."""

    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    default_text: str | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # more option strings that set a bool field to False
    nargs: str | None = None  # "+": one or more values, and the flag may repeat (a list)


def _hf_overrides_text(value: Any) -> str:
    """``hf_overrides`` (a dict, or its JSON text from the command line) as canonical JSON
    text; :class:`ConfigError` for anything but an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"hf_overrides is not JSON: {exc}", field="hf_overrides") from None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"hf_overrides must be a non-empty JSON object of config.json keys, "
                          f"got {value!r}", field="hf_overrides")
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"hf_overrides: {exc}", field="hf_overrides") from None


def _served_names(config: Any) -> None:
    """``served_model_name`` as one name (a string) or several (a tuple, the first the one
    answers carry): non-empty and distinct, else :class:`ConfigError`."""
    names = config.served_model_name
    if names is None:
        return
    names = [names] if isinstance(names, str) else list(names)
    if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) < len(names):
        raise ConfigError(f"served_model_name must be one or more distinct non-empty names, "
                          f"got {config.served_model_name!r}", field="served_model_name")
    object.__setattr__(config, "served_model_name", names[0] if len(names) == 1 else tuple(names))


def _field(default: Any, help: str, **flag: Any) -> Any:
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Everything that shapes an engine. Environment variables are read by the CLI only.

    Each field is a flag of ``python -m engine generate`` and ``serve`` (``max_num_seqs``
    is ``--max-num-seqs``) and a keyword of :func:`engine.open_engine`; its help is the
    ``Flag`` in its metadata. Invalid values raise :class:`ConfigError` naming the field.
    """

    model: str | None = _field(
        None, "a Hugging Face folder, a .gguf file, or a Hugging Face Hub id (ORG/NAME; "
        "ORG/NAME-GGUF:Q4_K_M for one quantization of a GGUF repo), fetched into the Hugging "
        "Face cache", metavar="MODEL",
        default_text="the bundled SmolLM2-135M-Instruct GGUF")
    # One name, or several (vLLM's): requests may send any; answers carry the first.
    served_model_name: str | tuple[str, ...] | None = _field(
        None, "the model name clients send and see; several names: requests may use any, "
        "answers carry the first", metavar="NAME", nargs="+",
        default_text="SmolLM2-135M-Instruct for the default model, the Hub id for a model "
        "named by id, else the folder or file name")
    # Hub resolution (engine.models.hub) turns ids into local paths before anything loads;
    # these say which revision and where. After resolution ``model`` and ``tokenizer`` are
    # paths, and the engine cores and tensor-parallel workers see only those.
    revision: str | None = _field(
        None, "the model's Hub revision: a branch, tag or commit", metavar="REV",
        default_text="main")
    tokenizer: str | None = _field(
        None, "read the tokenizer (and its chat template) from this folder or Hub id instead "
        "of the model's", metavar="TOKENIZER", default_text="the model's; a GGUF's own")
    tokenizer_revision: str | None = _field(
        None, "the tokenizer's Hub revision", metavar="REV", default_text="main")
    download_dir: str | None = _field(
        None, "the Hugging Face cache folder models are looked up in and fetched to",
        metavar="DIR", default_text="$HF_HUB_CACHE, else $HF_HOME/hub, else "
        "~/.cache/huggingface/hub")
    dtype: str = _field("auto", "weight and activation dtype", choices=DTYPES)
    quantization: str = _field(
        "auto", "auto/gguf: a GGUF's block-quantized matrices stay in their blocks (CPU; "
        "Q4_0/Q4_1/Q8_0/Q4_K with the triton ops backend; --dtype is then the activations'); "
        "none: dequantize every weight to --dtype at load",
        choices=QUANTIZATIONS)
    device: str = _field("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    ops_backend: str = _field(
        "auto", "kernels: auto picks triton on CUDA, the C kernels on CPU (see engine.ops)",
        choices=OPS_BACKENDS)
    max_model_len: int | None = _field(
        None, "context length", type=int, metavar="N",
        default_text="the model's max_position_embeddings, capped by the KV pool")
    max_num_seqs: int = _field(64, "most requests in one step", type=int, metavar="N")
    max_num_batched_tokens: int = _field(2048, "most tokens in one step", type=int, metavar="N")
    # vLLM V1's encoder budget: a vision model's images encoded in one step, counted in
    # their placeholder tokens. An image is never split; one larger than the budget runs
    # alone in a step.
    max_num_encoder_input_tokens: int | None = _field(
        None, "most image placeholder tokens whose vision encoder runs in one step; a "
        "prefill chunk that would need more stops before the image's placeholders",
        type=int, metavar="N", default_text="--max-num-batched-tokens")
    block_size: int = _field(16, "tokens per KV-cache block (a power of 2)", type=int, metavar="N")
    # 2 GiB default: ample for SmolLM2's 30 layers x 3 KV heads x 64 dims (about 46 KB a
    # token in fp32), i.e. ~46k tokens, without taking a shared CPU machine's memory.
    # An int is bytes, a float in (0, 1] a fraction of the device's free memory (on CPU, of
    # the available system memory).
    # None: 2 GiB on CPU; on CUDA what --gpu-memory-utilization leaves of the device once
    # the weights are loaded and the step's activations are set aside (vLLM's default).
    kv_cache_memory: int | float | None = _field(
        None, "KV pool budget: bytes (2GiB, 512MB) or a fraction of free memory (0.5)",
        type=parse_memory, metavar="SIZE",
        default_text="2GiB on CPU; on CUDA, --gpu-memory-utilization of the device")
    # vLLM's --num-gpu-blocks-override: the pool's size in blocks, whatever the budget
    # would buy (vLLM: "used for testing preemption"); on CPU as on CUDA here.
    num_gpu_blocks_override: int | None = _field(
        None, "exactly this many KV blocks, in place of what --kv-cache-memory would buy "
        "(vLLM's flag; e.g. a small pool to test preemption)", type=int, metavar="N",
        default_text="none")
    gpu_memory_utilization: float = _field(
        0.9, "on CUDA, the share of the device's memory the engine may hold (weights, "
        "activations, CUDA graphs and the KV pool, whose size it sets when --kv-cache-memory "
        "is not given)", type=float, metavar="FRACTION")
    # vLLM's switch: decode steps replay CUDA graphs captured at startup unless this is set.
    enforce_eager: bool = _field(
        False, "on CUDA, capture no CUDA graphs: every step runs its kernels eagerly")
    # vLLM's sleep mode (engine.runner.sleep): Engine.sleep / wake_up, POST /sleep and
    # /wake_up with --server-dev-mode. Levels 1 and 2 need it; on CPU only.
    enable_sleep_mode: bool = _field(
        False, "allow sleep mode: sleep(level=1) gives the KV cache's memory back, level=2 "
        "the weights' too (read again from the checkpoint on waking); CPU only")
    kv_cache_dtype: str = _field(
        "auto", "K/V storage: auto (the model dtype), int8 or fp8 (8-bit codes with a scale "
        "per token and KV head: about half of bf16's memory)", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = _field(
        True, "share the KV blocks of a common prompt prefix between requests",
        aliases=("--no-prefix-caching",))
    # vLLM's: the most tokens one request's prefill chunk takes in a step (0: what the
    # budget leaves), so long prompts arriving leave room for the decodes (planning.prefill_cap).
    long_prefill_token_threshold: int = _field(
        0, "the most prompt tokens one request computes in a step (its prefill is chunked that "
        "finely even where the step's budget has room), so a long prompt arriving stretches the "
        "running requests' steps less; 0: no limit beyond --max-num-batched-tokens",
        type=int, metavar="N", default_text="0")
    # vLLM's switch. Off: a prompt prefills whole in one step (SchedulerConfig.whole_prompts),
    # the step budget raised to hold the longest (engine.process.parts), as vLLM does.
    enable_chunked_prefill: bool = _field(
        True, "split a prompt longer than what is left of a step's budget over several steps; "
        "off, each prompt prefills whole in one step (--max-num-batched-tokens raised to "
        "--max-model-len where it is lower)")
    # vLLM's KV connector (engine.kv_transfer, engine.runner.kv_store): prompt blocks shared
    # through a folder between engines and restarts. Canonical JSON text, as
    # speculative_config; ``kv_transfer`` is the checked form.
    kv_transfer_config: str | None = _field(
        None, "share computed prompt blocks through a folder, as vLLM's JSON: "
        '\'{"kv_connector": "ExampleConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"shared_storage_path": DIR}}\' (kv_producer writes '
        "them, kv_consumer reads a new prompt's leading blocks instead of computing them)",
        metavar="JSON", default_text="off")
    # A hybrid model's prefix cache keeps its recurrent layers' states at block boundaries
    # (engine.core.block_pool, "state checkpoints"), each as large as a request's states.
    state_checkpoints: int | None = _field(
        None, "a model with recurrent layers (Mamba-2, Gated DeltaNet): how many block "
        "boundaries' states the prefix cache keeps, each a request's states in size, out of "
        "the KV budget; 0 turns prefix caching off for such a model", type=int, metavar="N",
        default_text="auto: max_num_seqs, or what a quarter of the KV budget left after "
        "the running requests' states holds")
    scheduling_policy: str = _field(
        "fcfs", "waiting-queue order: arrival, or the request's priority then arrival",
        choices=("fcfs", "priority"))
    max_queued_requests: int = _field(
        1024, "waiting requests beyond which new ones are refused (HTTP 429)", type=int,
        metavar="N")
    # A chat template is code (the model's, or a request's with
    # --trust-request-chat-template) run on the client's messages and tools; a render
    # takes milliseconds, and the worker thread it runs in cannot be killed, so each step
    # of it checks this deadline (engine.models.chat_sandbox).
    chat_template_timeout: float = _field(
        5.0, "seconds one chat template render may take; past it the request is refused "
        "(HTTP 400)", type=float, metavar="S")
    # Plan step N+1 while step N runs. None: on with CUDA, where the GPU runs a step while
    # the host plans; off on CPU, where both share the same cores and the overlap measured
    # no gain while costing each new request one more step before its first token.
    async_scheduling: bool | None = _field(
        None, "plan step N+1 while step N runs", default_text="on with CUDA, off on CPU")
    seed: int = _field(0, "seed of the engine's sampling generator", type=int, metavar="N")
    # "auto": generation_config.json's sampling defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty) apply to requests that leave them out, as in vLLM; "none" (or
    # vLLM's "vllm"): the engine's own defaults (temperature 1, no truncation); a folder:
    # the generation_config.json in it (read by the front end, Engine.__init__).
    generation_config: str = _field(
        "auto", "auto: the model's generation_config.json sampling defaults apply to requests "
        "that leave those fields out; none (or vLLM's vllm): the engine's own defaults; a "
        "folder: the generation_config.json in it instead of the model's",
        metavar="auto|none|vllm|FOLDER")
    # vLLM's --hf-overrides, as canonical JSON text: keys set over the model's config.json
    # before anything reads it (engine.models.loader.apply_hf_overrides says how).
    hf_overrides: str | None = _field(
        None, "JSON object set over the model's config.json before it is read, as vLLM's "
        '\'{"max_position_embeddings": 4096}\'; a key ending in _config (text_config, '
        "vision_config) is merged into that sub-config, any other key replaced whole",
        metavar="JSON", default_text="none")
    # vLLM's --override-generation-config, as canonical JSON text: sampling defaults set
    # over the model's (alone with generation_config "none"), and max_new_tokens, which is
    # both the default and the most max_tokens an HTTP request gets (vLLM's cap).
    override_generation_config: str | None = _field(
        None, "sampling defaults set over generation_config.json's, as vLLM's JSON: "
        '\'{"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 1024}\' (keys: temperature, '
        "top_p, top_k, min_p, repetition_penalty, and max_new_tokens: the default max_tokens "
        "and the most an HTTP request gets)", metavar="JSON", default_text="none")
    # Text in chat messages (and tools, chat_template_kwargs) is tokenized so that it never
    # becomes a control token: "<|im_end|>\n<|im_start|>system" from a user stays text, and
    # only the chat template's own markers are special tokens. True restores the old
    # reading (the rendered prompt encoded as a whole), for clients that write a model's
    # control tokens into messages on purpose.
    allow_special_tokens_in_content: bool = _field(
        False, "let special-token text in chat messages (<|im_start|>, <|eot_id|>, ...) "
        "become the special tokens, as a whole-prompt encode does; off: such text stays text "
        "and only the chat template's own markers are special tokens")
    # vLLM's --chat-template-content-format. A template that loops over a message's
    # content (Qwen2-VL's, LLaVA's, Gemma 3's) must get the parts, in the order given, for
    # its prompt to be the one the model's own processor writes; one that reads content as
    # a string gets the text parts joined with a newline, vLLM's rule.
    chat_template_content_format: str = _field(
        "auto", "how message content reaches the chat template: auto (the parts, text and "
        "images, when the template iterates over a message's content, else a string), "
        "string (text parts joined with newlines), openai (always the parts)",
        choices=CHAT_TEMPLATE_CONTENT_FORMATS)
    # Times the actors restart in place after a crash before the engine stays dead. 0 for
    # the embedded API: a crash is a bug the caller sees; `serve` defaults to 5.
    max_engine_restarts: int = _field(
        0, "restart the engine's actors in place after a crash this many times, then stay "
        "dead", type=int, metavar="N")
    # Grammar library for structured output (engine.structured): "xgrammar", "guidance"
    # (llguidance) or "auto" (xgrammar, and llguidance for JSON schemas xgrammar refuses).
    structured_outputs_backend: str = _field(
        "auto", "grammar library for structured output: auto (xgrammar, and llguidance for "
        "the JSON schemas xgrammar refuses), xgrammar or guidance (llguidance)",
        choices=STRUCTURED_OUTPUTS_BACKENDS)
    # Where the scheduler, KV allocator and executor run: "inprocess" (the embedded API's
    # default: one trio run), "process" (an engine-core process of their own, talking to
    # this front end over a Unix socket; see engine/process/cores.py) or "auto" (serve's
    # default: a process where a model step leaves a CPU free for the front end, decided
    # by engine.process.core.resolve_engine_core when the engine opens).
    engine_core: str = _field(
        "inprocess", "run the scheduler, KV allocator and executor in this process, in an "
        "engine-core process of their own (msgpack frames over a Unix socket), or auto: a "
        "process where a model step leaves a CPU free for the HTTP front end (on CUDA; on "
        "CPU when the torch threads are fewer than the CPUs), else this one",
        choices=ENGINE_CORE_MODES, default_text="auto for serve, else inprocess")
    data_parallel_size: int = _field(
        1, "engine-core processes behind this front end, each with its own KV pool (cuda:i "
           "each on CUDA, an equal share of the CPUs on CPU); above 1 implies "
           "--engine-core process", type=int, metavar="N")
    data_parallel_routing: str = _field(
        "affinity", "how requests are spread over data-parallel cores: affinity (to the core "
        "holding the prompt's leading blocks unless it is much busier, else the least "
        "loaded), least-loaded or round-robin", choices=("affinity", "least-loaded", "round-robin"))
    data_parallel_address: str | None = _field(
        None, "HOST:PORT where this front end listens for engine cores started on other "
        "machines with --headless (and where a --headless server connects); the link is "
        "authenticated with the secret in $ENGINE_DP_SECRET or --data-parallel-secret-file",
        metavar="HOST:PORT", default_text="none: every core is local")
    data_parallel_backend: str = _field(
        "mp", "where the data-parallel engine cores run: mp (processes this front end spawns) "
        "or ray (Ray actors, on the cluster at $RAY_ADDRESS or a local Ray started and "
        "stopped by the engine; they connect back over TCP)", choices=("mp", "ray"))
    data_parallel_size_local: int | None = _field(
        None, "engine cores this machine starts (the rest of --data-parallel-size connect "
        "from other machines)", type=int, metavar="N", default_text="all of them")
    data_parallel_start_rank: int = _field(
        0, "with --headless: the index of this machine's first engine core", type=int,
        metavar="N")
    # Tensor parallelism (engine.parallel): every layer split over N ranks joined by
    # torch.distributed collectives; rank 0 runs where the model runner runs with one rank,
    # ranks 1..N-1 in worker processes (mp) or Ray actors (ray).
    tensor_parallel_size: int = _field(
        1, "split every layer of the model over N ranks (torch.distributed: NCCL on CUDA, "
        "gloo on CPU); rank 0 runs in the engine, ranks 1..N-1 in worker processes",
        type=int, metavar="N")
    # Pipeline parallelism (engine.parallel.PipelineStage): N contiguous stages of layers,
    # each a rank (or tensor-parallel group); rank 0, in the engine, is the first.
    pipeline_parallel_size: int = _field(
        1, "split the model's layers into N pipeline stages, each a process (or Ray actor) "
        "holding only its layers and their KV cache, with up to N batches in flight",
        type=int, metavar="N")
    pipeline_layer_partition: tuple[int, ...] | None = _field(
        None, "each pipeline stage's layer count (vLLM's VLLM_PP_LAYER_PARTITION sets it too)",
        type=parse_partition, metavar="N,N,...", default_text="an even split")
    # Expert parallelism (engine.models.layers.moe): a MoE layer's routed experts dealt out
    # whole over the tensor-parallel ranks rather than each cut over all of them.
    enable_expert_parallel: bool = _field(
        False, "deal a mixture-of-experts model's routed experts out whole over the "
        "tensor-parallel ranks (E / N each) instead of keeping a slice of every expert on "
        "every rank; attention, dense layers and shared experts stay split as tensor "
        "parallelism splits them (vLLM's flag)")
    distributed_executor_backend: str = _field(
        "mp", "where the tensor-parallel and pipeline workers run: mp (processes on this "
        "machine) or ray (Ray actors in a placement group, on the cluster at $RAY_ADDRESS or "
        "a local Ray started and stopped by the engine; always ray with "
        "--data-parallel-backend ray, each core's workers placed with it)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    # engine.process.runtime: files that live as long as their process (the engine cores'
    # socket, a local Ray's temp dir), swept of dead processes' leftovers at each start.
    runtime_dir: str | None = _field(
        None, "folder for the engine's runtime files (the engine cores' Unix socket, a "
        "local Ray's temp dir); leftovers of killed servers are removed at the next start",
        metavar="DIR", default_text="$XDG_RUNTIME_DIR/engine, else /tmp/engine-$UID")

    @property
    def core_in_process(self) -> bool:
        """Whether the engine core runs in the caller's process (``engine_core`` decided:
        "auto" is resolved when the engine opens)."""
        if self.engine_core == "auto":
            raise ValueError("engine_core='auto' is decided by resolve_engine_core first")
        return (self.engine_core == "inprocess" and self.data_parallel_size == 1
                and self.data_parallel_address is None)

    # Pooling models (engine.models.pooling): the task is read from the model's files;
    # these override it, as vLLM's --runner / --convert and pooler config do.
    runner: str = _field(
        "auto", "auto: the model's files decide (BERT and sentence-transformers folders "
        "pool, causal LMs generate); pooling: serve a causal LM as an embedder; generate",
        choices=("auto", "generate", "pooling"))
    convert: str = _field(
        "auto", "embed: run a causal LM as an embedding model (its last hidden states, "
        "pooled); none: never", choices=("auto", "none", "embed"))
    pooling_type: str = _field(
        "auto", "how an embedder pools a prompt's hidden states", choices=("auto", "cls", "mean", "max", "last"),
        default_text="auto: sentence-transformers' 1_Pooling, else cls for BERT and last for a decoder")
    pooling_normalize: bool | None = _field(
        None, "L2-normalise embeddings",
        default_text="the model's files: sentence-transformers' Normalize module, else on")
    # vLLM's default cap: OpenAI allows 20 top logprobs. -1 lets a request ask for the
    # whole vocabulary (logprobs/top_logprobs/prompt_logprobs -1), as vLLM's flag does.
    max_logprobs: int = _field(
        20, "most logprobs, top_logprobs or prompt_logprobs a request may ask for; -1: the "
        "whole vocabulary (and lets requests send -1 for it)", type=int, metavar="N")
    # vLLM's --stream-interval (engine.actors.detokenizer): a sample's outputs are held
    # until this many new tokens have come, its first and last output going at once.
    stream_interval: int = _field(
        1, "hand a sample's new tokens to its caller (a streamed chunk) once this many have "
        "come; its first token and its end go at once (1: every step)", type=int, metavar="N")
    # vLLM's request log: one info line per request as it is queued (its id, the prompt's
    # text and token ids, cut to max_log_len, its sampling parameters, its LoRA adapter).
    # Off by default, as in vLLM: prompts are users' data. --disable-log-requests (vLLM's
    # older flag) is the default here.
    enable_log_requests: bool = _field(
        False, "log each request as it is queued: its id, prompt (text and token ids), "
        "sampling parameters and LoRA adapter", aliases=("--disable-log-requests",))
    enable_log_outputs: bool = _field(
        False, "log each request's generated text and token ids as it finishes (cut to "
        "--max-log-len), as vLLM's flag")
    max_log_len: int | None = _field(
        None, "most prompt characters and token ids a request's log line shows",
        type=int, metavar="N", default_text="all")
    # vLLM's prompt_embeds (engine/api/prompt_embeds.py): off by default, as in vLLM (a
    # request may then send a serialized tensor, read with torch's weights-only loader).
    enable_prompt_embeds: bool = _field(
        False, "take prompt_embeds (a prompt as its input embeddings) on /v1/completions and "
        "in the embedded API")
    # Answer shapes, named as vLLM's serve flags (engine.http.completions.answer.AnswerOptions).
    enable_prompt_tokens_details: bool = _field(
        False, "report usage.prompt_tokens_details.cached_tokens (the prefix-cache hit)")
    enable_force_include_usage: bool = _field(
        False, "usage on every stream, as if it asked stream_options.include_usage and "
        "continuous_usage_stats: on every chunk and in a last usage chunk (as vLLM's flag)")
    return_tokens_as_token_ids: bool = _field(
        False, "write logprob tokens as 'token_id:N' unless a request says otherwise")
    # Off by default, as in vLLM: the tokenizer's configuration (chat template included)
    # is the operator's to publish.
    enable_tokenizer_info_endpoint: bool = _field(
        False, "serve GET /tokenizer_info: the tokenizer's configuration and chat template")
    # The /v1/responses store (store: true, previous_response_id): in the server's memory,
    # lost on restart. 64 MiB of JSON holds thousands of turns of a few thousand tokens;
    # an hour without use is long for an agent loop and short enough not to hoard.
    responses_store_bytes: int = _field(
        64 * 1024**2, "/v1/responses: bytes of stored responses (JSON) kept in memory for "
        "previous_response_id and GET; the least recently used go first",
        type=parse_bytes, metavar="SIZE", default_text="64MiB")
    responses_store_ttl: float = _field(
        3600.0, "/v1/responses: seconds a stored response is kept after its last use",
        type=float, metavar="S")

    # Grammar compiles run in worker processes that can be killed (engine.structured.pool).
    # 10 s: a large real schema compiles in about a second on a 150k vocabulary; minutes
    # mean a pathological one (a pattern repeating 30,000 times).
    grammar_compile_timeout: float = _field(
        10.0, "seconds a structured-output grammar may take to compile; past it the compile "
        "is killed and the request refused (400)", type=float, metavar="SECONDS")
    # serve: 2 (a compile already uses two threads of xgrammar's; more would take the
    # cores the model step needs). The embedded API: 0, threads, as a process would cost
    # every engine opened a Python start and an xgrammar import (seconds of CPU).
    grammar_compile_workers: int = _field(
        0, "worker processes compiling grammars, that a compile past its budget or whose "
        "client left is killed in; the others wait their turn. 0: two threads of the engine "
        "(a compile cannot be stopped, only abandoned)", type=int, metavar="N",
        default_text="2 for serve, 0 for the embedded API")
    # A JSON-schema grammar on a 150k vocabulary is tens of KiB to a few MiB.
    grammar_max_bytes: int = _field(
        64 * 1024**2, "largest compiled grammar (its token-mask cache) a request may make; "
        "larger is refused (400)", type=parse_memory, metavar="SIZE", default_text="64MiB")

    # Speculative decoding (engine/core/spec.py): the JSON object as vLLM's flag takes it.
    # Kept as canonical JSON text (the config stays hashable and crosses to a core process
    # as is); ``speculative`` is the checked form.
    speculative_config: str | None = _field(
        None, "speculative decoding, as vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1}\' (prompt lookup) or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\' (a draft model of the same vocabulary); verified by the '
        "model in one forward, the output distribution unchanged", metavar="JSON", default_text="off")

    # vLLM's --otlp-traces-endpoint (engine.api.tracing): a span per finished request.
    otlp_traces_endpoint: str | None = _field(
        None, "export a span per finished request (vLLM's llm_request, gen_ai.* attributes) "
        "to this OpenTelemetry collector, over $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc, "
        "the default, or http/protobuf); needs opentelemetry-sdk and "
        "opentelemetry-exporter-otlp", metavar="URL", default_text="off")
    # vLLM's --profiler-config (engine.runner.profiler): canonical JSON text, as
    # speculative_config; ``profiler`` is the checked form. Off by default.
    profiler_config: str | None = _field(
        None, "trace the engine's steps between POST /start_profile and /stop_profile "
        "(LLM.start_profile/stop_profile), as vLLM's JSON: '{\"profiler\": \"torch\", "
        "\"torch_profiler_dir\": DIR}' (torch.profiler traces, for Perfetto) or "
        "'{\"profiler\": \"cuda\"}' (Nsight Systems' capture range, CUDA only)",
        metavar="JSON", default_text="off")

    # Server-side logits processors (engine.runner.logits_processors): vLLM V1's
    # batch-level interface, classes imported by name when the engine starts.
    logits_processors: str = _field(
        "", "logits processors every request's sampling runs through: comma-separated "
        "module:Class names (vLLM V1's LogitsProcessor interface; per-request arguments come "
        "as vllm_xargs). Not with --speculative-config", metavar="NAMES", default_text="none")

    # LoRA adapters (vLLM's flags): slots of --max-lora-rank for --max-loras adapters in one
    # step beside the model's projections; adapters read from their folders on first use.
    enable_lora: bool = _field(False, "serve LoRA adapters over the base model: a request whose "
                               "model names one runs with it")
    lora_modules: str | None = _field(
        None, "adapters served from the start: name=path, or JSON {\"name\", \"path\", "
        "\"base_model_name\"}; several may follow", nargs="+", metavar="SPEC", default_text="none")
    max_loras: int = _field(1, "most distinct LoRA adapters in one step", type=int, metavar="N")
    max_lora_rank: int = _field(16, "largest LoRA rank served", type=int, metavar="N")
    max_cpu_loras: int | None = _field(
        None, "LoRA adapters kept in host memory (the least recently used is dropped)", type=int,
        metavar="N", default_text="--max-loras")
    lora_dtype: str = _field("auto", "the LoRA slots' dtype (auto: the activations')", choices=DTYPES)

    @property
    def lora_module_specs(self) -> tuple[LoraModule, ...]:
        return parse_lora_modules(self.lora_modules)

    @property
    def logits_processor_names(self) -> tuple[str, ...]:
        """``logits_processors`` as a tuple of ``module:Class`` names."""
        return tuple(n.strip() for n in self.logits_processors.split(",") if n.strip())

    @property
    def profiler(self) -> ProfilerConfig | None:
        """The checked profiler configuration, or ``None`` when off."""
        if self.profiler_config is None:
            return None
        return parse_profiler_config(self.profiler_config)

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """The checked KV connector configuration, or ``None`` when off."""
        if self.kv_transfer_config is None:
            return None
        return parse_kv_transfer_config(json.loads(self.kv_transfer_config))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The checked speculative configuration, or ``None`` when off."""
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)
    # Image inputs of vision-language models (engine.multimodal).
    limit_mm_per_prompt: int = _field(
        4, "most images in one request (more: HTTP 400): N, or vLLM's JSON '{\"image\": N}'; "
        "0: text only (Gemma 3's vision tower is then not loaded)",
        type=parse_mm_limit, metavar="N")
    max_image_pixels: int = _field(
        4096 * 4096, "most pixels (width x height, read from the header before decoding) of "
        "one image; a larger one, a decompression bomb included, is refused with a 400",
        type=int, metavar="N")
    allowed_media_domains: str = _field(
        "", "comma-separated hosts whose http(s) image URLs are fetched (10 s, 20 MiB, no "
        "redirects); other hosts' URLs are refused (400)",
        metavar="HOSTS", default_text="none")

    # Kept as canonical JSON text, as speculative_config; ``mm_processor_options`` is the
    # checked form.
    mm_processor_kwargs: str | None = _field(
        None, "the image processor's pixel budget per image, as vLLM's JSON: "
        '\'{"min_pixels": 3136, "max_pixels": 200704}\' (Qwen-VL: an image is resized to '
        "fit, fewer pixels are fewer tokens); other keys are refused",
        metavar="JSON", default_text="the model folder's preprocessor_config.json")

    @property
    def mm_processor_options(self) -> dict[str, int]:
        """The checked ``mm_processor_kwargs`` (empty when not given)."""
        if self.mm_processor_kwargs is None:
            return {}
        return parse_mm_processor_kwargs(self.mm_processor_kwargs)

    @property
    def media_domains(self) -> tuple[str, ...]:
        """``allowed_media_domains`` as lower-case host names."""
        return tuple(h.strip().lower() for h in self.allowed_media_domains.split(",") if h.strip())

    def _check_logits_processors(self) -> None:
        names = self.logits_processors
        if isinstance(names, (list, tuple)):  # open_engine(logits_processors=[...])
            names = ",".join(names)
            object.__setattr__(self, "logits_processors", names)
        if not isinstance(names, str):
            raise ConfigError("logits_processors must be module:Class names, comma-separated",
                              field="logits_processors")
        if self.logits_processor_names and self.speculative_config is not None:
            # A processor sees one row per request and step (vLLM V1's interface); a
            # speculative step verifies several. vLLM refuses the pair the same way.
            raise ConfigError("logits_processors cannot be combined with speculative_config: "
                              "a processor sees one row per request and step, and speculative "
                              "verification samples several", field="logits_processors")

    def _check_kv_transfer(self) -> None:
        """The KV store holds one rank's pool and the target model's KV only."""
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("kv_transfer_config: the KV store is built for one rank a core (data "
                              "parallelism shares it), not with tensor or pipeline parallelism",
                              field="kv_transfer_config")
        if self.speculative_config is not None and self.speculative.method == "draft_model":
            raise ConfigError("kv_transfer_config: a draft model keeps a KV cache of its own that "
                              "the KV store does not hold", field="kv_transfer_config")

    def _check_lora(self) -> None:
        modules = parse_lora_modules(self.lora_modules)
        if self.lora_modules is not None:
            # Canonical text: a list given to open_engine() or by the flags becomes JSON too.
            object.__setattr__(self, "lora_modules", json.dumps([dataclasses.asdict(m) for m in modules]))
        if modules and not self.enable_lora:
            raise ConfigError("lora_modules needs --enable-lora", field="lora_modules")
        if self.enable_lora and self.enable_expert_parallel and self.tensor_parallel_size > 1:
            # An adapter's expert deltas are cut as tensor parallelism cuts the experts.
            raise ConfigError("enable_lora cannot be combined with enable_expert_parallel: an "
                              "adapter's expert deltas are split by tensor parallelism only",
                              field="enable_expert_parallel")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
        # The C kernel's stack row holds three slices (fused q/k/v) of the largest rank.
        if self.max_lora_rank > 512:
            raise ConfigError(f"max_lora_rank must be at most 512, got {self.max_lora_rank}", field="max_lora_rank")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ConfigError(f"max_cpu_loras must be an integer of at least max_loras ({self.max_loras}), "
                              f"got {cpu!r}", field="max_cpu_loras")

    def to_json(self) -> str:
        """Every field as JSON: how a config crosses to an engine-core process or a
        tensor-parallel worker (:meth:`from_json` reads it back, checked again)."""
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        return cls(**json.loads(text))

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the model is served under, the first the one answers carry (empty
        when none was given)."""
        name = self.served_model_name
        if name is None:
            return ()
        return (name,) if isinstance(name, str) else tuple(name)

    def __post_init__(self) -> None:
        _served_names(self)
        if self.speculative_config is not None:
            spec = parse_speculative_config(self.speculative_config)
            # Canonical text: a dict given to open_engine() becomes JSON too.
            object.__setattr__(self, "speculative_config", spec.to_json())
        if isinstance(self.kv_transfer_config, KVTransferConfig):  # the checked form, given in code
            object.__setattr__(self, "kv_transfer_config", self.kv_transfer_config.to_json())
        if self.kv_transfer_config is not None:
            kv = parse_kv_transfer_config(_json_object(
                self.kv_transfer_config,
                lambda message: ConfigError(f"kv_transfer_config: {message}", field="kv_transfer_config")))
            object.__setattr__(self, "kv_transfer_config", kv.to_json())
            self._check_kv_transfer()
        if self.profiler_config is not None:
            profiler = parse_profiler_config(self.profiler_config)
            object.__setattr__(self, "profiler_config", profiler.to_json() if profiler else None)
        if self.hf_overrides is not None:
            object.__setattr__(self, "hf_overrides", _hf_overrides_text(self.hf_overrides))
        if self.override_generation_config is not None:
            try:
                override = generation_override(self.override_generation_config)
            except InvalidParamError as exc:
                raise ConfigError(f"{exc.param}: {exc}", field="override_generation_config") from None
            object.__setattr__(self, "override_generation_config", json.dumps(override, sort_keys=True))
        self._check_logits_processors()
        self._check_lora()
        if self.mm_processor_kwargs is not None:
            options = parse_mm_processor_kwargs(self.mm_processor_kwargs)
            object.__setattr__(self, "mm_processor_kwargs", json.dumps(options, sort_keys=True))
        for f in dataclasses.fields(self):
            choices = f.metadata["flag"].choices
            if choices is not None and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(choices)}, got "
                                  f"{getattr(self, f.name)!r}", field=f.name)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}", field="device")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_queued_requests",
                     "data_parallel_size", "max_image_pixels", "stream_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be a non-negative integer, got "
                              f"{threshold!r}", field="long_prefill_token_threshold")
        if threshold and not self.enable_chunked_prefill:
            raise ConfigError("long_prefill_token_threshold chunks prefills: not with "
                              "--no-enable-chunked-prefill", field="long_prefill_token_threshold")
        checkpoints = self.state_checkpoints
        if checkpoints is not None and (isinstance(checkpoints, bool) or not isinstance(checkpoints, int)
                                        or checkpoints < 0):
            raise ConfigError(f"state_checkpoints must be a non-negative integer, got {checkpoints!r}",
                              field="state_checkpoints")
        limit = self.limit_mm_per_prompt  # 0: text only (a vision model's tower not loaded)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(f"limit_mm_per_prompt must be a non-negative integer, got {limit!r}",
                              field="limit_mm_per_prompt")
        budget = self.max_num_encoder_input_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"max_num_encoder_input_tokens must be a positive integer, got "
                              f"{budget!r}", field="max_num_encoder_input_tokens")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}", field="block_size")
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"grammar_compile_timeout must be a positive number of seconds, "
                              f"got {timeout!r}", field="grammar_compile_timeout")
        for name, least in (("grammar_compile_workers", 0), ("grammar_max_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer of at least {least}, got "
                                  f"{value!r}", field=name)
        local = self.data_parallel_size_local
        if local is not None and (isinstance(local, bool) or not isinstance(local, int)
                                  or not 0 <= local <= self.data_parallel_size):
            raise ConfigError(f"data_parallel_size_local must be 0..{self.data_parallel_size}, "
                              f"got {local!r}", field="data_parallel_size_local")
        if local is not None and local < self.data_parallel_size and not self.data_parallel_address:
            raise ConfigError("cores on other machines need --data-parallel-address",
                              field="data_parallel_address")
        if self.data_parallel_address is not None:
            parse_address(self.data_parallel_address)
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}",
                              field="tensor_parallel_size")
        pp, partition = self.pipeline_parallel_size, self.pipeline_layer_partition
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ConfigError(f"pipeline_parallel_size must be a positive integer, got {pp!r}",
                              field="pipeline_parallel_size")
        if partition is not None:  # "4,4" from open_engine, a list through JSON
            object.__setattr__(self, "pipeline_layer_partition", partition := parse_partition(partition))
        if self.profiler_config is not None and (tp > 1 or pp > 1):
            raise ConfigError("profiler_config: tracing the ranks of a tensor- or pipeline-"
                              "parallel model (each in its own process) is not supported",
                              field="profiler_config")
        if partition is not None and (len(partition) != pp or min(partition) < 1):
            raise ConfigError(f"pipeline_layer_partition must give each of the {pp} stages a "
                              f"layer or more, got {partition!r}", field="pipeline_layer_partition")
        if tp * pp > 1 and self.data_parallel_backend == "ray":
            # Ray places each data-parallel core with its workers (one placement group a
            # core: engine.process.ray_cores), so the workers are Ray actors too, as
            # vLLM's Ray data parallelism makes them.
            object.__setattr__(self, "distributed_executor_backend", "ray")
        log_len = self.max_log_len
        if log_len is not None and (isinstance(log_len, bool) or not isinstance(log_len, int)
                                    or log_len < 0):
            raise ConfigError(f"max_log_len must be a non-negative integer, got {log_len!r}",
                              field="max_log_len")
        restarts = self.max_engine_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ConfigError(f"max_engine_restarts must be a non-negative integer, got {restarts!r}", field="max_engine_restarts")
        logprobs = self.max_logprobs
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < -1:
            raise ConfigError(f"max_logprobs must be -1 (the vocabulary) or >= 0, got {logprobs!r}", field="max_logprobs")
        timeout = self.chat_template_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"chat_template_timeout must be a positive number of seconds, "
                              f"got {timeout!r}", field="chat_template_timeout")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}", field="max_model_len")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {util!r}",
                              field="gpu_memory_utilization")
        mem = self.kv_cache_memory
        if mem is None:
            pass
        elif isinstance(mem, bool) or not isinstance(mem, (int, float)):
            raise ConfigError(f"kv_cache_memory must be bytes or a fraction, got {mem!r}", field="kv_cache_memory")
        if isinstance(mem, float) and not 0.0 < mem <= 1.0:
            raise ConfigError(f"kv_cache_memory as a fraction must be in (0, 1], got {mem}", field="kv_cache_memory")
        if isinstance(mem, int) and mem < 1:
            raise ConfigError(f"kv_cache_memory must be positive, got {mem}", field="kv_cache_memory")
        blocks = self.num_gpu_blocks_override
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
            raise ConfigError(f"num_gpu_blocks_override must be a positive number of blocks, got "
                              f"{blocks!r}", field="num_gpu_blocks_override")
        size = self.responses_store_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"responses_store_bytes must be a positive number of bytes, got "
                              f"{size!r}", field="responses_store_bytes")
        ttl = self.responses_store_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0 \
                or ttl == float("inf"):
            raise ConfigError(f"responses_store_ttl must be a positive number of seconds, got "
                              f"{ttl!r}", field="responses_store_ttl")
