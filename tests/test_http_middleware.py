"""vLLM's ``--middleware``: ASGI middleware classes and ``async def (request, call_next)``
functions named by import path, around the whole app (the last named outermost, before
the API key is checked), streams included; a path that does not load stops ``serve``
before the model loads.

The two middlewares below are what a vLLM user would write: a pure ASGI class, and a
Starlette-style function (the official ``openai`` client reads the streamed answer
through it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from http_server import ServerThread
from starlette.requests import Request
from starlette.responses import JSONResponse

import engine
from engine.errors import ConfigError
from engine.http.middleware import load_middleware
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
NOT_A_MIDDLEWARE = 3


class ChainHeader:
    """Pure ASGI: appends ``class`` to the response's ``x-chain`` header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message["headers"])
                chain = headers.pop(b"x-chain", b"")
                headers[b"x-chain"] = chain + (b"," if chain else b"") + b"class"
                message = {**message, "headers": list(headers.items())}
            await send(message)

        await self.app(scope, receive, sending)


async def gate(request: Request, call_next: Any) -> Any:
    """Starlette-style: refuses /blocked itself; appends ``function`` to ``x-chain``."""
    if request.url.path == "/blocked":
        return JSONResponse({"blocked": True}, status_code=418)
    response = await call_next(request)
    chain = response.headers.get("x-chain")
    response.headers["x-chain"] = f"{chain},function" if chain else "function"
    return response


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("middleware") / "llama", "llama")


def test_middleware_wraps_every_route_the_last_outermost(folder: Path) -> None:
    wraps = load_middleware([f"{__name__}.ChainHeader", f"{__name__}:gate"])
    with ServerThread(lambda: engine.open_engine(model=str(folder)), api_key="k",
                      middleware=wraps) as server:
        url = server.base_url
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"}, timeout=60)
        assert models.status_code == 200
        assert models.headers["x-chain"] == "class,function"  # the class inside the function
        # Outside the app's hooks: the function answers before the API key is asked for,
        # and the class sees the app's own 401.
        assert httpx.get(f"{url}/blocked", timeout=60).status_code == 418
        refused = httpx.get(f"{url}/v1/models", timeout=60)
        assert (refused.status_code, refused.headers["x-chain"]) == (401, "class,function")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k")
        model = server.engine.model_name
        whole = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=6,
                                          temperature=0)
        streamed = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=6,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_a_path_that_does_not_load_is_refused_by_name() -> None:
    for path, words in (("no_such_module.Thing", "does not import"),
                        (f"{__name__}.Missing", "does not import"),
                        (f"{__name__}.NOT_A_MIDDLEWARE", "class or an async function"),
                        ("Lonely", "import path")):
        with pytest.raises(ConfigError, match=words) as caught:
            load_middleware([path])
        assert caught.value.field == "middleware"


def test_serve_stops_on_a_bad_middleware_before_the_model_loads() -> None:
    # The model does not exist: had loading started first, the error would name it.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--port", "0", "--model", "/no/such/model",
         "--middleware", "no_such_module.Thing"], capture_output=True, text=True, cwd=REPO,
        env=env, timeout=120, check=False)
    assert result.returncode == 2
    assert "--middleware 'no_such_module.Thing' does not import" in result.stderr
    assert "/no/such/model" not in result.stderr
