"""``python -m engine generate``: stream one completion to stdout through the embedded
engine and print nothing else there (logs go to stderr). Bad input gives a one-line error on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import trio

from engine.api import open_engine
from engine.cli.args import add_engine_arguments, config_from_args
from engine.cli.help import HelpFormatter
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.params import SamplingParams

EXIT_BAD_INPUT = 2  # like argparse's own usage errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate", help="generate one completion and print its text",
        description="Load the model, stream one completion of --prompt to stdout and exit. "
                    "Only the text goes to stdout; logs go to stderr.",
        formatter_class=HelpFormatter)
    request = p.add_argument_group("request")
    request.add_argument("--prompt", required=True)
    request.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    request.add_argument("--max-tokens", type=int, default=256)
    request.add_argument("--temperature", type=float, default=1.0)
    request.add_argument("--top-p", type=float, default=1.0)
    request.add_argument("--top-k", type=int, default=0)
    request.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(p)


async def _generate(args: argparse.Namespace, config: EngineConfig, params: Any) -> None:
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    async with open_engine(config=config) as eng:
        async with eng.generate(prompt, params) as outputs:
            async for out in outputs:
                sys.stdout.write(out.text)
                sys.stdout.flush()
    sys.stdout.write("\n")


def run_generate(args: argparse.Namespace) -> int:
    try:
        # Checked before the engine (and torch) loads, so bad flags fail fast.
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, ignore_eos=args.ignore_eos,
        )
        trio.run(_generate, args, config_from_args(args), params)
    except (EngineError, ValueError, OSError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
