"""LoRA adapters by Hugging Face Hub id: ``--lora-modules name=ORG/NAME`` and
``POST /v1/load_lora_adapter {"lora_path": "ORG/NAME"}``, fetched with huggingface_hub's
real client from the fake Hub on 127.0.0.1 that tests/test_hub.py uses.

The oracle for what is fetched is the fake Hub's own bytes and request log; for what an
adapter by id answers, the same adapter served from its folder (its numerics against peft
are tests/test_lora.py's).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import huggingface_hub
import openai
import pytest
from hub_server import FakeHub
from test_http_cli import _server
from test_lora import write_peft_adapters

from engine.api.lora import adapter_folder
from engine.errors import LoraAdapterError, ModelNotFoundError, UnsupportedModelError
from engine.models.hub import resolve_name
from engine.models.testing import write_tiny_model

KEY = "lora-hub-key"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora-hub")
    base = write_tiny_model(root / "base", "llama")
    write_peft_adapters(base, root, {"aa": dict(r=8, lora_alpha=16)}, seed=5)
    # What adapter repos carry beside the adapter, which nothing should fetch.
    (root / "aa" / "training_args.bin").write_bytes(b"\x80\x04 pickle")
    (root / "aa" / "checkpoint-10").mkdir()
    (root / "aa" / "checkpoint-10" / "adapter_model.safetensors").write_bytes(
        (root / "aa" / "adapter_model.safetensors").read_bytes())
    return base, root / "aa"


@pytest.fixture(scope="module")
def hub(folders):
    base, adapter = folders
    with FakeHub() as fake, pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "ENDPOINT", fake.url)
        patch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                      fake.url + "/{repo_id}/resolve/{revision}/{filename}")
        fake.add_folder("org/tiny-lora", adapter)
        fake.add_commit("org/pickle-lora", {"adapter_config.json": (adapter / "adapter_config.json").read_bytes(),
                                            "adapter_model.bin": b"\x80\x04 pickle"})
        fake.add_folder("org/tiny-llama", base)
        yield fake


def _resolve(hub: FakeHub, tmp: Path, name: str, **kwargs):
    return resolve_name(name, cache_dir=tmp / "hub", endpoint=hub.url, record_dir=tmp / "checked",
                        adapter=True, **kwargs)


def test_an_adapter_id_fetches_only_the_adapters_files_then_serves_from_the_cache_offline(
        hub: FakeHub, tmp_path: Path) -> None:
    got = _resolve(hub, tmp_path, "org/tiny-lora")
    repo = hub.repos["org/tiny-lora"]
    files = repo.commits[repo.refs["main"]]
    assert {p.name: p.read_bytes() for p in got.path.iterdir()} == {
        n: files[n] for n in ("adapter_config.json", "adapter_model.safetensors")}
    fetched = [r for r in hub.requests if "/org/tiny-lora/resolve/" in r]
    assert fetched and not any("training_args" in r or "checkpoint-10" in r for r in fetched)
    before = hub.count()
    assert _resolve(hub, tmp_path, "org/tiny-lora", offline=True).path == got.path
    assert hub.count() == before


@pytest.mark.parametrize(("name", "error", "message"), [
    ("org/pickle-lora", UnsupportedModelError, "org/pickle-lora.*pickles only.*adapter_model.bin"),
    ("org/tiny-llama", ModelNotFoundError, "org/tiny-llama.*no adapter_config.json"),
    ("org/no-such-lora", ModelNotFoundError, "adapter org/no-such-lora not found"),
])
def test_refusals_name_the_repo_and_the_reason(hub: FakeHub, tmp_path: Path, name, error, message) -> None:
    with pytest.raises(error, match=message):
        _resolve(hub, tmp_path, name)
    assert not list((tmp_path / "hub").rglob("*.safetensors")) if (tmp_path / "hub").exists() else True


def test_offline_uses_the_cache_and_names_what_is_not_cached(hub: FakeHub, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cache = str(tmp_path / "hub")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine"))
    online = adapter_folder("x", "org/tiny-lora", cache_dir=cache)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    before = hub.count()
    assert adapter_folder("x", "org/tiny-lora", cache_dir=cache) == online
    with pytest.raises(LoraAdapterError, match="'y'.*org/pickle-lora.*not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        adapter_folder("y", "org/pickle-lora", cache_dir=cache)
    assert hub.count() == before


def _complete(url: str, model: str):
    reply = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=3, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    return choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs


def test_serve_an_adapter_by_id_at_start_and_at_runtime(hub: FakeHub, folders, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    base, adapter = folders
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with _server(base, "--dtype", "float32", "--enable-lora", "--lora-modules", "hub=org/tiny-lora",
                 f"local={adapter}", "--allow-runtime-lora-updating", "--api-key", KEY,
                 "--served-model-name", "tiny") as (proc, url, log):
        cards = {m.id: m for m in openai.OpenAI(base_url=url + "/v1", api_key=KEY).models.list().data}
        assert cards["hub"].root == "org/tiny-lora" and cards["local"].root == str(adapter)  # as vLLM lists them
        local = _complete(url, "local")
        assert _complete(url, "hub") == local  # the same tokens and logprobs
        assert _complete(url, "tiny")[0] != local[0]  # and the adapter is not the base
        headers = {"Authorization": f"Bearer {KEY}"}
        reply = httpx.post(url + "/v1/load_lora_adapter", headers=headers, timeout=60,
                           json={"lora_name": "rt", "lora_path": "org/tiny-lora"})
        assert reply.status_code == 200, reply.text
        assert _complete(url, "rt") == local
        for name, path, reason in (("nope", "org/no-such-lora", "org/no-such-lora"),
                                   ("pickled", "org/pickle-lora", "pickles only")):
            reply = httpx.post(url + "/v1/load_lora_adapter", headers=headers, timeout=60,
                               json={"lora_name": name, "lora_path": path})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert repr(name) in error["message"] and reason in error["message"], error
            assert error["param"] == "lora_path"
        # Still serving, unchanged (its prompt's blocks are cached by now: a prefill over
        # cached keys sums in another order, hence the fp32 tolerance on the logprobs).
        text, logprobs, _ = _complete(url, "hub")
        assert text == local[0] and logprobs == pytest.approx(local[1], abs=1e-5)
        proc.terminate()
