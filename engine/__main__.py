"""Command line: ``python -m engine generate ...`` and ``python -m engine serve ...``.

``generate`` streams one completion to stdout through the actor engine and prints nothing
else there (logs go to stderr). Bad input gives a one-line error on stderr and exit code 2.
``serve`` lives in :mod:`engine.http.cli` and is imported only when asked for.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from engine.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, parse_memory

EXIT_BAD_INPUT = 2  # like argparse's own usage errors


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that map onto :class:`engine.config.EngineConfig` fields."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default="auto", choices=DTYPES)
    group.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                       help="auto/gguf: keep a GGUF's quantized blocks (CPU); none: dequantize")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                       help="bytes (512MiB, 2GB) or a fraction of free memory (0.5)")
    group.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                       help="K/V storage: auto (the model dtype), int8 or fp8")
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="plan step N+1 while step N runs (default: on with CUDA, off on CPU)",
    )
    group.add_argument("--ops-backend", default=None, choices=("auto", "torch", "cpu", "triton"))


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the user set on the command line."""
    options: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "quantization": args.quantization}
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "kv_cache_memory", "kv_cache_dtype", "ops_backend"):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.async_scheduling is not None:
        options["async_scheduling"] = args.async_scheduling
    return options


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate one completion and print its text")
    add_engine_arguments(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    if "serve" in argv[:2]:
        # The HTTP stack (quart, hypercorn) is heavy; only `serve` pays for importing it.
        from engine.http.cli import add_serve_arguments

        add_serve_arguments(serve)
    return parser


async def _generate(args: argparse.Namespace, params: Any) -> None:
    from engine.api import open_engine

    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    async with open_engine(args.model, **engine_options(args)) as eng:
        async with eng.generate(prompt, params) as outputs:
            async for out in outputs:
                sys.stdout.write(out.text)
                sys.stdout.flush()
    sys.stdout.write("\n")


def run_generate(args: argparse.Namespace) -> int:
    import trio

    from engine.errors import EngineError
    from engine.params import SamplingParams

    try:
        # Checked before the engine (and torch) loads, so bad flags fail fast.
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
        )
        trio.run(_generate, args, params)
    except (EngineError, ValueError, OSError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "serve":
        from engine.http.cli import run_serve

        return run_serve(args)
    return run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
