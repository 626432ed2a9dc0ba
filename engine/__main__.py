"""Command line: ``python -m engine generate ...`` and ``python -m engine serve ...``.

``generate`` streams one completion to stdout through the actor engine and prints nothing
else there (logs go to stderr). Bad input gives a one-line error on stderr and exit code 2.
``serve`` lives in :mod:`engine.http.cli` and is imported only when asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from engine.config import EngineConfig, add_engine_arguments, config_from_args

EXIT_BAD_INPUT = 2  # like argparse's own usage errors


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter that shows each flag's default, except where the help already
    says it (a default of None means something the help spells out, as "the model's").
    ``_get_help_string`` is the hook argparse's own ArgumentDefaultsHelpFormatter overrides."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_generate(sub: Any) -> None:
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


def _version() -> str:
    try:
        return importlib.metadata.version("engine")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "unknown"


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine", formatter_class=HelpFormatter,
        description="An LLM inference server on trio: `serve` runs the OpenAI-compatible "
                    "HTTP server, `generate` prints one completion. With no --model both "
                    "use the bundled SmolLM2-135M-Instruct.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    serve = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
        description="Serve the model over an OpenAI-compatible HTTP API until SIGINT or "
                    "SIGTERM (see docs/serving.md).")
    if "serve" in argv[:2]:
        # The HTTP stack (quart, hypercorn) is heavy; only `serve` pays for importing it.
        from engine.http.cli import add_serve_arguments

        add_serve_arguments(serve)
    return parser


async def _generate(args: argparse.Namespace, config: EngineConfig, params: Any) -> None:
    from engine.api import open_engine

    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    async with open_engine(config=config) as eng:
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
            top_k=args.top_k, ignore_eos=args.ignore_eos,
        )
        trio.run(_generate, args, config_from_args(args), params)
    except (EngineError, ValueError, OSError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status. With ``argv`` None (the process's own
    command line: ``python -m engine``, the ``engine`` script) the process ends right here
    instead, see :func:`_exit_now`."""
    command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "serve":
        from engine.http.cli import run_serve

        status = run_serve(args)
    else:
        status = run_generate(args)
    if command_line:
        _exit_now(status)
    return status


def _exit_now(status: int) -> NoReturn:
    """End the process now that the command is done (for ``serve``: the server drained,
    the engine closed, "shut down cleanly" logged). The normal interpreter exit would
    first wait for whatever worker threads still run (an abandoned grammar compile, a
    native library's thread pool joined by its destructors), so a SIGTERM could take tens
    of seconds after the log said the server was down; nothing of the command's is left
    to wait for, so flush the output and leave."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not change the status
            stream.flush()
    logging.shutdown()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
