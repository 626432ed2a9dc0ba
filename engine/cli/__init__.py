"""The command line: ``python -m engine serve|generate|run-batch|chat|complete|bench ...``.

The top floor of the package: each subcommand is a module of this package
(:mod:`engine.cli.serve`, :mod:`engine.cli.generate`, :mod:`engine.cli.run_batch`,
:mod:`engine.cli.chat` for ``chat`` and ``complete``, :mod:`engine.cli.bench`) that turns
flags into an :class:`~engine.config.EngineConfig` (:mod:`engine.cli.args`) and calls the
floors below.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from engine._version import VERSION
from engine.cli import bench, chat, generate, run_batch, serve
from engine.cli.help import HelpFormatter


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine", formatter_class=HelpFormatter,
        description="An LLM inference server on trio: `serve` runs the OpenAI-compatible "
                    "HTTP server, `generate` prints one completion, `run-batch` answers an "
                    "OpenAI Batch file offline, `chat` and `complete` talk to a server, "
                    "`bench` measures one. With no --model the engine loads the bundled "
                    "SmolLM2-135M-Instruct.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    serve_parser = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
        description="Serve the model over an OpenAI-compatible HTTP API until SIGINT or "
                    "SIGTERM (see docs/serving.md).")
    if "serve" in argv[:2]:
        serve.add_serve_arguments(serve_parser)
    run_batch.add_parser(sub)
    chat.add_parsers(sub)
    bench.add_parser(sub)
    return parser


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
        status = serve.run_serve(args)
    elif args.command == "run-batch":
        status = run_batch.run_batch(args)
    elif args.command in ("chat", "complete"):
        status = chat.run_client(args)
    elif args.command == "bench":
        status = bench.run_bench(args)
    else:
        status = generate.run_generate(args)
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

