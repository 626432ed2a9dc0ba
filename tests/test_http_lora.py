"""LoRA adapters through ``python -m engine serve --enable-lora --lora-modules ...`` and the
official ``openai`` client: each adapter and the base answer differently and, batched
together, as they do alone; /v1/models lists the adapters with their parent; unknown names
are 404s in OpenAI's shape; adapters load, serve and unload at runtime (with the API key),
an adapter unloaded mid-stream lets its request finish, and bad adapters are refused while
the server goes on serving; the prefix cache shares nothing between adapters.

The numerics are tests/test_lora.py's (against peft); here the plumbing.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_http_cli import _server
from test_lora import write_peft_adapters

from engine.models.testing import write_tiny_model

KEY = "lora-test-key"
PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores keys"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("http-lora")
    folder = write_tiny_model(root / "base", "llama")
    # Names of more than one letter: peft warns of one inside its "lora_" prefix.
    write_peft_adapters(folder, root, {"aa": dict(r=8, lora_alpha=16), "bb": dict(r=16, lora_alpha=16),
                                       "cc": dict(r=8, lora_alpha=32)}, seed=11)
    bad = root / "bad"
    bad.mkdir()
    for name, change in (("rank", "r32"), ("nan", "nan"), ("shape", "shape")):
        out = bad / name
        if change == "r32":
            write_peft_adapters(folder, bad, {name: dict(r=32, lora_alpha=16)}, seed=12)
            continue
        shutil.copytree(root / "aa", out)
        t = load_file(str(out / "adapter_model.safetensors"))
        key = next(k for k in t if k.endswith("k_proj.lora_B.weight"))
        t[key] = torch.full_like(t[key], float("nan")) if change == "nan" else torch.zeros(3, t[key].shape[1])
        save_file(t, str(out / "adapter_model.safetensors"))
    return folder, root


@pytest.fixture(scope="module")
def server(adapters):
    folder, root = adapters
    b = json.dumps({"name": "b", "path": str(root / "bb"), "base_model_name": "tiny-parent"})
    with _server(folder, "--dtype", "float32", "--enable-lora", "--lora-modules", f"a={root / 'aa'}", b,
                 "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4",
                 "--allow-runtime-lora-updating", "--api-key", KEY, "--served-model-name", "tiny",
                 "--enable-prompt-tokens-details") as (proc, url, log):
        yield url
        proc.terminate()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def _complete(url: str, model: str, prompt: str = PROMPT, max_tokens: int = 12):
    return _client(url).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           extra_body={"ignore_eos": True})


def test_models_lists_the_adapters_with_their_parent(server) -> None:
    cards = {m.id: m for m in _client(server).models.list().data}
    assert set(cards) >= {"tiny", "a", "b"}
    assert cards["a"].parent == "tiny" and cards["b"].parent == "tiny-parent"
    assert cards["tiny"].parent is None


def test_each_adapter_answers_differently_and_as_it_does_alone(server) -> None:
    names = ["tiny", "a", "b"]
    alone = {n: _complete(server, n).choices[0].text for n in names}
    assert len(set(alone.values())) == 3, alone
    # Batched: the three at once, twice each, share steps (two adapters: --max-loras 2).
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda n: (n, _complete(server, n)), names * 2))
    for name, reply in together:
        assert reply.choices[0].text == alone[name]
        assert reply.model == name  # the answer names the adapter it ran
    chats = {n: _client(server).chat.completions.create(
        model=n, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True}).choices[0].message.content for n in names}
    assert len(set(chats.values())) == 3, chats
    # A route that would run the base model refuses an adapter's name.
    with pytest.raises(openai.BadRequestError, match="LoRA adapter"):
        _client(server).responses.create(model="a", input="hello", max_output_tokens=4)


def test_an_unknown_model_is_a_404_in_openais_shape(server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _complete(server, "no-such-adapter")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_adapters_load_serve_and_unload_at_runtime(server, adapters) -> None:
    _, root = adapters
    body = {"lora_name": "c", "lora_path": str(root / "cc")}
    assert httpx.post(server + "/v1/load_lora_adapter", json=body).status_code == 401  # the key applies
    headers = {"Authorization": f"Bearer {KEY}"}
    reply = httpx.post(server + "/v1/load_lora_adapter", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert "c" in {m.id for m in _client(server).models.list().data}
    c = _complete(server, "c").choices[0].text
    assert c not in (_complete(server, "a").choices[0].text, _complete(server, "tiny").choices[0].text)
    # Loading a name twice is refused; the adapter serves on.
    again = httpx.post(server + "/v1/load_lora_adapter", json=body, headers=headers, timeout=60)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    # Unloaded while one of its requests streams: that request finishes, new ones are 404s.
    stream = _client(server).completions.create(model="c", prompt=PROMPT, max_tokens=448, temperature=0.0,
                                                stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    metrics = httpx.get(server + "/metrics").text  # vLLM's lora_requests_info names it running
    assert 'engine:lora_requests_info{max_lora="2",running_lora_adapters="c"' in metrics
    reply = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=headers)
    assert reply.status_code == 200, reply.text
    rest = list(chunks)
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    with pytest.raises(openai.NotFoundError):
        _complete(server, "c")
    gone = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=headers)
    assert gone.status_code == 404


@pytest.mark.parametrize(("name", "reason"), [
    ("missing", "is not a folder"), ("rank", "above --max-lora-rank 16"), ("nan", "NaN"),
    ("shape", "do not fit the base model"),
])
def test_bad_adapters_are_refused_while_serving(server, adapters, name, reason) -> None:
    _, root = adapters
    before = _complete(server, "a").choices[0].text
    reply = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(root / "bad" / name)},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert reason in error["message"] and repr(name) in error["message"]
    assert name not in {m.id for m in _client(server).models.list().data}
    assert _complete(server, "a").choices[0].text == before  # still serving, unchanged


def test_the_prefix_cache_shares_nothing_between_adapters(server) -> None:
    # Text no other test sends (their blocks would be cached already), over several blocks.
    prompt = "Continuous batching lets new requests join while others are decoding, " * 3

    def cached(model: str) -> int:
        usage = _complete(server, model, prompt, max_tokens=2).usage
        return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0

    assert cached("a") == 0
    assert cached("a") > 0  # the same adapter shares its own blocks
    assert cached("b") == 0  # another adapter's blocks are not its
    assert cached("tiny") == 0  # nor the base model's
    assert cached("tiny") > 0
