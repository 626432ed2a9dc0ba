"""``python -m engine chat`` and ``python -m engine complete``: interactive clients of an
OpenAI-compatible server, as ``vllm chat`` and ``vllm complete``.

``chat`` keeps the conversation (the system prompt, every turn) and streams each reply;
``complete`` streams a completion of each line on its own. At the prompt, ``/clear``
forgets the conversation, ``/quit`` (or end of input) leaves; Ctrl-C while a reply streams
stops that reply (what was shown stays in the conversation), and at the prompt leaves.

``--url`` names the server (its ``/v1`` base). Without ``--url`` the client tries
``http://127.0.0.1:8000/v1`` (``serve``'s default address) and, when nothing answers
there, starts an embedded engine instead (:class:`EmbeddedServer`: the engine flags,
``--model`` first, say what it loads) and talks to it through the same HTTP API, so one
client serves both cases.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import urlsplit

import openai
import trio

from engine.api import open_engine
from engine.cli.args import add_engine_arguments, config_from_args
from engine.cli.help import HelpFormatter
from engine.config import EngineConfig
from engine.http.app import create_app
from engine.http.serve import bind_socket, serve_app

DEFAULT_URL = "http://127.0.0.1:8000/v1"  # serve's default --host and --port
PROMPT = "> "
# Long enough to load a large model from a slow disk; a hang guard, not a budget.
EMBEDDED_START_SECONDS = 600.0
# The embedded server drains this long when the client leaves; a reply cut off by /quit
# has nothing left to wait for.
EMBEDDED_SHUTDOWN_SECONDS = 1.0
# Answers quickly when a server listens; when none does the connection is refused at once.
PROBE_SECONDS = 5.0

Message = dict[str, str]


def base_url(url: str) -> str:
    """``url`` as the client's base: ``http://host:port`` alone gets ``/v1``; a URL with a
    path (``/v1``, a proxy's ``/llm/v1``) is taken as it is."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url {url!r} is not an http(s) URL")
    return url.rstrip("/") + ("/v1" if parts.path in ("", "/") else "")


class EmbeddedServer:
    """The engine and the HTTP app on a free loopback port, in a thread with its own trio
    loop, for a client with no server to talk to. A fresh API key keeps the machine's
    other users off it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.api_key = secrets.token_urlsafe(24)
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=self._main, name="embedded-engine", daemon=True)

    def __enter__(self) -> EmbeddedServer:
        self._thread.start()
        if not self._ready.wait(EMBEDDED_START_SECONDS):
            raise RuntimeError("the embedded engine did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._stop.set)
        self._thread.join(EMBEDDED_START_SECONDS)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # handed to the caller's thread, which raises it
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with open_engine(config=self.config) as eng:
            app = create_app(eng, api_key=self.api_key)
            with bind_socket("127.0.0.1", 0) as listener:
                async with trio.open_nursery() as nursery:
                    binds = await nursery.start(lambda task_status: serve_app(
                        app, listener, shutdown_timeout=EMBEDDED_SHUTDOWN_SECONDS,
                        shutdown_trigger=self._stop.wait, task_status=task_status))  # type: ignore[union-attr]
                    self.url = binds[0] + "/v1"
                    self._ready.set()


# -- the conversation -----------------------------------------------------------------------


class Session:
    """One client's conversation with a server: what is sent, and what is kept."""

    def __init__(self, client: openai.OpenAI, model: str, *, system_prompt: str | None,
                 sampling: dict[str, Any], out: TextIO) -> None:
        self.client = client
        self.model = model
        self.system_prompt = system_prompt
        self.sampling = sampling
        self.out = out
        self.history: list[Message] = []
        self.clear()

    def clear(self) -> None:
        self.history = ([{"role": "system", "content": self.system_prompt}]
                        if self.system_prompt else [])

    def chat(self, text: str) -> str:
        """Send ``text`` as the next user turn and stream the reply; both join the history
        (a reply cut short by Ctrl-C as far as it was shown). On an error the turn is
        dropped and the error raised."""
        self.history.append({"role": "user", "content": text})
        reply: list[str] = []
        try:
            stream = self.client.chat.completions.create(
                model=self.model, messages=self.history, stream=True,  # type: ignore[arg-type]
                **self.sampling)
        except (openai.OpenAIError, KeyboardInterrupt):  # no reply: the turn never happened
            self.history.pop()
            raise
        try:
            self._stream(stream, lambda chunk: chunk.choices[0].delta.content, reply)
        except openai.OpenAIError:
            self.history.pop()
            raise
        self.history.append({"role": "assistant", "content": "".join(reply)})
        return "".join(reply)

    def complete(self, prompt: str) -> str:
        """Stream a completion of ``prompt`` (no history)."""
        reply: list[str] = []
        stream = self.client.completions.create(model=self.model, prompt=prompt, stream=True,
                                                **self.sampling)
        self._stream(stream, lambda chunk: chunk.choices[0].text, reply)
        return "".join(reply)

    def _stream(self, stream: Any, text_of: Callable[[Any], str | None],
                reply: list[str]) -> None:
        try:
            with stream:  # leaving it closes the connection: the server aborts the request
                for chunk in stream:
                    text = text_of(chunk) if chunk.choices else None
                    if text:
                        reply.append(text)
                        self.out.write(text)
                        self.out.flush()
        except KeyboardInterrupt:
            self.out.write(" [stopped]")
        finally:
            self.out.write("\n")
            self.out.flush()


def repl(session: Session, send: Callable[[str], str], *, read: Callable[[str], str] = input,
         err: TextIO = sys.stderr) -> int:
    """Read lines and answer each with ``send`` until ``/quit`` or end of input."""
    while True:
        try:
            line = read(PROMPT)
        except (EOFError, KeyboardInterrupt):
            session.out.write("\n")
            return 0
        command = line.strip()
        if command in ("/quit", "/exit"):
            return 0
        if command == "/clear":
            session.clear()
            print("(conversation cleared)", file=err)
            continue
        if not command:
            continue
        try:
            send(line)
        except openai.OpenAIError as exc:
            print(f"error: {_message(exc)}", file=err)
        except KeyboardInterrupt:  # before the reply began: back to the prompt
            session.out.write("\n")


def _message(exc: openai.OpenAIError) -> str:
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        detail = body.get("error", body) if isinstance(body, dict) else {}
        message = detail.get("message") if isinstance(detail, dict) else None
        return f"HTTP {exc.status_code}: {message or exc.message}"
    return " ".join(str(exc).split()) or type(exc).__name__


# -- the command ----------------------------------------------------------------------------


def _client(url: str, api_key: str | None) -> openai.OpenAI:
    # max_retries 0: a person is waiting; an error is shown at once and the turn can be
    # sent again. The key "EMPTY" where none is needed: the client insists on one.
    return openai.OpenAI(base_url=url, api_key=api_key or "EMPTY", max_retries=0,
                         timeout=None)


def _first_model(client: openai.OpenAI) -> str:
    models = client.with_options(timeout=PROBE_SECONDS).models.list()
    if not models.data:
        raise ValueError("the server lists no model (GET /v1/models); pass --model")
    return models.data[0].id


def run_client(args: argparse.Namespace) -> int:
    """The ``chat`` or ``complete`` command; returns the exit status."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("ENGINE_API_KEY")
    with contextlib.ExitStack() as stack:
        try:
            url = base_url(args.url or DEFAULT_URL)
            client = stack.enter_context(_client(url, api_key))
            try:
                served = _first_model(client)  # also the probe: is a server there?
                model = args.model or served
            except openai.APIConnectionError:
                if args.url is not None:
                    raise
                print(f"no server at {url}: starting an embedded engine "
                      f"({args.model or 'the bundled SmolLM2'})", file=sys.stderr)
                server = stack.enter_context(EmbeddedServer(config_from_args(args)))
                client = stack.enter_context(_client(server.url, server.api_key))
                model = _first_model(client)  # the name it serves --model under
        except (openai.OpenAIError, ValueError, OSError) as exc:
            text = _message(exc) if isinstance(exc, openai.OpenAIError) else str(exc)
            print(f"error: {' '.join(text.split())}", file=sys.stderr)
            return 1
        sampling = {k: v for k, v in (("max_tokens", args.max_tokens),
                                      ("temperature", args.temperature)) if v is not None}
        session = Session(client, model, system_prompt=getattr(args, "system_prompt", None),
                          sampling=sampling, out=sys.stdout)
        send = session.chat if args.command == "chat" else session.complete
        if args.quick is not None:
            try:
                send(args.quick)
            except openai.OpenAIError as exc:
                print(f"error: {_message(exc)}", file=sys.stderr)
                return 1
            return 0
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
        print(f"{args.command} with {model} at {client.base_url} (/clear: forget the "
              "conversation, /quit: leave)", file=sys.stderr)
        return repl(session, send)


def add_parsers(sub: Any) -> None:
    for name, what in (("chat", "chat with a running server (history kept across turns)"),
                       ("complete", "complete prompts with a running server, one per line")):
        p = sub.add_parser(
            name, help=what, formatter_class=HelpFormatter,
            description=f"{what[0].upper()}{what[1:]}, streaming, as `vllm {name}`: /clear "
                        "forgets the conversation, /quit leaves (see docs/serving.md).")
        client = p.add_argument_group("client")
        client.add_argument("--url", default=None,
                            help=f"the server's OpenAI base URL (default: {DEFAULT_URL}, else "
                                 "an embedded engine of --model)")
        client.add_argument("--api-key", default=None, metavar="KEY",
                            help="the server's API key (default: $OPENAI_API_KEY, else "
                                 "$ENGINE_API_KEY)")
        # vLLM's client flag; --model (an engine flag below) means the same against a
        # server, and names what to load for an embedded engine.
        client.add_argument("--model-name", dest="model", default=argparse.SUPPRESS,
                            metavar="NAME", help="the model to ask the server for (default: "
                            "its first, GET /v1/models); same as --model")
        if name == "chat":
            client.add_argument("--system-prompt", default=None, metavar="TEXT",
                                help="the conversation's system message")
        client.add_argument("-q", "--quick", default=None, metavar="TEXT",
                            help="send this one message, print the answer and exit")
        client.add_argument("--max-tokens", type=int, default=None, metavar="N",
                            help="most tokens per answer (default: the server's)")
        client.add_argument("--temperature", type=float, default=None, metavar="T",
                            help="sampling temperature (default: the server's)")
        add_engine_arguments(p)
