"""Operations: TLS served by hypercorn, CORS for browsers (quart-cors), and the API key
from a flag, a file or the environment."""

from __future__ import annotations

import argparse
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.cli import serve as cli
from engine.errors import ConfigError
from engine.http import serve as server
from engine.models.testing import write_tiny_model
from engine.models.tokenizer import Tokenizer

API_KEY = "sk-ops"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_folder(write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


def _opener(tokenizer):
    return lambda: open_fake_engine(tokenizer, step_delay=0.001, max_model_len=256,
                                    served_model_name="tiny")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command line."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return key, cert


def test_tls_serves_https_with_the_given_certificate(tokenizer, certificate) -> None:
    key, cert = certificate
    options = {"ssl_keyfile": str(key), "ssl_certfile": str(cert)}
    with ServerThread(_opener(tokenizer), serve_options=options) as server:
        assert server.base_url.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(cert))
        response = httpx.get(server.base_url + "/health", verify=trusted)
        assert response.status_code == 200
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused
            httpx.get(server.base_url + "/health")


def test_tls_needs_both_files() -> None:
    import trio

    async def start() -> None:
        with server.bind_socket("127.0.0.1", 0) as listener:
            await server.serve_app(None, listener, shutdown_timeout=1,
                                shutdown_trigger=trio.sleep_forever, ssl_keyfile="k.pem")

    with pytest.raises(ConfigError, match="both"):
        trio.run(start)


def test_cors_answers_preflights_and_tags_allowed_origins_only(tokenizer) -> None:
    with ServerThread(_opener(tokenizer), api_key=API_KEY, allowed_origins=(ORIGIN,)) as server:
        preflight = httpx.options(server.base_url + "/v1/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200  # no API key needed for the preflight
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        auth = {"Authorization": f"Bearer {API_KEY}"}
        allowed = httpx.get(server.base_url + "/v1/models", headers={"Origin": ORIGIN, **auth})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        other = httpx.get(server.base_url + "/v1/models",
                          headers={"Origin": "https://evil.example", **auth})
        assert "access-control-allow-origin" not in other.headers
        # The key is still required for the request itself.
        assert httpx.get(server.base_url + "/v1/models",
                         headers={"Origin": ORIGIN}).status_code == 401


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_api_key_comes_from_the_flag_then_a_file_then_the_environment(
    tmp_path, monkeypatch
) -> None:
    keyfile = tmp_path / "key"
    keyfile.write_text("sk-from-file\n")
    monkeypatch.setenv("ENGINE_API_KEY", "sk-from-env")
    assert cli.api_key(_args("--api-key", "sk-flag", "--api-key-file", str(keyfile))) == "sk-flag"
    assert cli.api_key(_args("--api-key-file", str(keyfile))) == "sk-from-file"
    assert cli.api_key(_args()) == "sk-from-env"
    monkeypatch.delenv("ENGINE_API_KEY")
    assert cli.api_key(_args()) is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="no key"):
        cli.api_key(_args("--api-key-file", str(empty)))
    with pytest.raises(ConfigError, match="api-key-file"):
        cli.api_key(_args("--api-key-file", str(tmp_path / "missing")))


def test_allowed_origins_take_repeats_and_commas() -> None:
    args = _args("--allowed-origins", "https://a.example, https://b.example",
                 "--allowed-origins", "*")
    assert cli.allowed_origins(args) == ("https://a.example", "https://b.example", "*")
    assert cli.allowed_origins(_args()) == ()
