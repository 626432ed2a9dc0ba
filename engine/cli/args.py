"""The engine's flags: one per :class:`~engine.config.EngineConfig` field, shared by
``generate`` and ``serve``, and the table of ``vllm serve`` flags users carry over.

Flags are read here, at the command line's edge, and turned into an ``EngineConfig``
(checked when built); nothing below the command line reads argparse or the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from engine.config import EngineConfig, Flag, profiler_from_environment


def add_engine_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add one flag per :class:`EngineConfig` field to ``parser`` (in an "engine" group):
    ``--max-num-seqs`` for ``max_num_seqs``, ``--name/--no-name`` for a bool. ``defaults``
    replace the config's own (``serve`` restarts a crashed engine 5 times; the embedded API
    does not); :func:`config_from_args` reads the values back."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag: Flag = f.metadata["flag"]
        option = "--" + f.name.replace("_", "-")
        help = flag.help if flag.default_text is None else f"{flag.help} (default: {flag.default_text})"
        if str(f.type).startswith("bool"):  # "bool" or "bool | None" (string annotations)
            group.add_argument(option, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help)
            for alias in flag.aliases:
                # default=SUPPRESS: the flag above already set the field's default.
                group.add_argument(alias, dest=f.name, action="store_false",
                                   default=argparse.SUPPRESS, help=f"same as --no-{option[2:]}")
        elif flag.nargs is not None:  # a list; the flag may repeat (vLLM's --lora-modules)
            group.add_argument(option, dest=f.name, nargs=flag.nargs, action="extend",
                               default=f.default, metavar=flag.metavar, help=help)
        else:
            group.add_argument(option, dest=f.name, type=flag.type or str, choices=flag.choices,
                               default=f.default, metavar=flag.metavar, help=help)
    # Not a config field: a secret that must not travel in the config's JSON to engine
    # cores or appear in its log lines; config_from_args hands it to huggingface_hub.
    group.add_argument("--hf-token", dest="hf_token", default=None, metavar="TOKEN",
                       help="the Hugging Face token for gated or private repos (default: "
                       "$HF_TOKEN, else the token `hf auth login` saved)")
    parser.set_defaults(**defaults)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of parsed :func:`add_engine_arguments` flags; raises
    :class:`ConfigError` for a bad value, before anything loads.

    ``--hf-token`` becomes ``HF_TOKEN`` in this process's environment, where
    huggingface_hub reads it at each request (this is the command line's edge, where the
    environment is the engine's to read and write)."""
    token = getattr(args, "hf_token", None)
    if token:
        os.environ["HF_TOKEN"] = token
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    if values["pipeline_layer_partition"] is None and os.environ.get("VLLM_PP_LAYER_PARTITION"):
        # vLLM's variable for the stages' layer counts, read here at the edge.
        values["pipeline_layer_partition"] = os.environ["VLLM_PP_LAYER_PARTITION"]
    values["profiler_config"] = profiler_from_environment(values["profiler_config"])
    return EngineConfig(**values)



# -- vLLM's serve flags ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class VllmFlag:
    """A flag of ``vllm serve`` that users carry over, and what ``serve`` does with it.

    ``alias``: the same meaning as this server's ``target`` flag, taken under vLLM's name.
    ``no_op``: accepted, with nothing to do here (``reason`` says why; it is logged), at
    any value or, with ``allowed``, only at those. ``refuse``: a usage error naming the
    flag and ``reason`` (it would change what the server does, and it is not built).
    """

    action: str  # "alias", "no_op" or "refuse"
    reason: str = ""
    target: str | None = None
    takes_value: bool = True
    allowed: tuple[str, ...] | None = None


# The ``vllm serve`` flags users are likely to pass that this server does not define under
# the same name (those it shares, --max-model-len, --max-num-seqs, --dtype, ..., are its
# own flags and mean the same). docs/serving.md ("Coming from vLLM") lists them all.
VLLM_SERVE_FLAGS: dict[str, VllmFlag] = {
    "--guided-decoding-backend": VllmFlag("alias", target="--structured-outputs-backend"),
    "--uvicorn-log-level": VllmFlag("alias", target="--log-level"),
    "-tp": VllmFlag("alias", target="--tensor-parallel-size"),
    "-pp": VllmFlag("alias", target="--pipeline-parallel-size"),
    "-dp": VllmFlag("alias", target="--data-parallel-size"),
    "--trust-remote-code": VllmFlag(
        "no_op", "this server never runs a model's own Python code", takes_value=False),
    "--disable-uvicorn-access-log": VllmFlag("no_op", "there is no access log here",
                                             takes_value=False),
    "--disable-fastapi-docs": VllmFlag("no_op", "there are no docs pages here (only "
                                       "/openapi.json)", takes_value=False),
    "--disable-frontend-multiprocessing": VllmFlag(
        "no_op", "the HTTP front end always runs in serve's own process here; "
        "--engine-core decides where the engine core runs",
        takes_value=False),
    "--enable-server-load-tracking": VllmFlag("no_op", "GET /load is always served",
                                              takes_value=False),
    "--exclude-tools-when-tool-choice-none": VllmFlag(
        "no_op", 'tool_choice "none" always keeps the tools out of the prompt here',
        takes_value=False),
    "--swap-space": VllmFlag("no_op", "preempted requests are recomputed here, as in vLLM V1, "
                             "which ignored this flag and has since removed it"),
    "--cpu-offload-gb": VllmFlag("refuse", "weights are not offloaded to the CPU here"),
    "--load-format": VllmFlag("no_op", "the format follows --model: a folder of "
                              "safetensors, or a .gguf file", allowed=("auto",)),
    "--tokenizer-mode": VllmFlag("no_op", "the tokenizer is always the fast one "
                                 "(tokenizer.json, or a GGUF's own)", allowed=("auto",)),
    "--rope-scaling": VllmFlag("refuse", "give it as --hf-overrides "
                               "'{\"rope_scaling\": {...}}', as vLLM now does"),
    "--quantization-param-path": VllmFlag("refuse", "not supported"),
    "--compilation-config": VllmFlag("refuse", "there is no torch.compile step here"),
    "-O": VllmFlag("refuse", "there is no torch.compile step here"),
    "--api-server-count": VllmFlag("no_op", "one HTTP server process serves here",
                                   allowed=("1",)),
    "--logits-processor-pattern": VllmFlag("refuse", "request logits processors are refused"),
    "--tool-parser-plugin": VllmFlag("refuse", "tool parsers are built in (--tool-call-parser)"),
    "--max-seq-len-to-capture": VllmFlag("refuse", "the decode graphs are captured for "
                                         "--max-model-len"),
    "--task": VllmFlag("refuse", "give --runner (generate, pooling) and --convert instead"),
    "--calculate-kv-scales": VllmFlag("no_op", "--kv-cache-dtype int8/fp8 always compute their "
                                      "scales (one per token and head) as K and V are written",
                                      takes_value=False),
}
