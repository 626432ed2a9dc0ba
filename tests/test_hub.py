"""Models by Hub id (engine.models.hub, engine.process.names): huggingface_hub's real
client against a fake Hub on 127.0.0.1 (tests/hub_server.py) serving tiny random repos.

The oracle for what lands in the cache is the fake Hub's own bytes; for what the served
model answers, transformers on the folder the repo was written from.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from pathlib import Path

import gguf
import huggingface_hub
import pytest
import torch
from engine_helpers import collect, greedy, token_ids
from hub_server import FakeHub
from test_http_cli import _server
from test_loader import write_gguf

import engine
from engine.config import EngineConfig
from engine.errors import (
    CorruptModelError,
    ModelAccessError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from engine.models.hub import resolve_name
from engine.models.testing import write_tiny_model
from engine.process.names import resolve_config

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The folders the repos are made of: Llama (two commits' worth), GPT-2 and OPT (OPT's
    tokenizer in the slow vocab.json + merges.txt form, as facebook/opt-* ship it), and a
    GGUF repo's two quantizations. GPT-2 and OPT carry files the engine never reads."""
    root = tmp_path_factory.mktemp("repos")
    out = {"llama": write_tiny_model(root / "llama", seed=0),
           "llama_v2": write_tiny_model(root / "llama_v2", seed=1)}
    for name in ("gpt2", "opt"):
        folder = write_tiny_model(root / name, name)
        (folder / "README.md").write_text("# tiny\n")
        (folder / "flax_model.msgpack").write_bytes(b"\x00" * 64)
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
        out[name] = folder
    opt = out["opt"]
    fast = json.loads((opt / "tokenizer.json").read_text())
    (opt / "tokenizer.json").unlink()
    (opt / "vocab.json").write_text(json.dumps(fast["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in fast["model"]["merges"]]
    (opt / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = json.loads((opt / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="GPT2Tokenizer", add_bos_token=True)
    (opt / "tokenizer_config.json").write_text(json.dumps(config))
    gg = root / "gguf"
    gg.mkdir()
    write_gguf(out["llama"], gg / "tiny-llama.F32.gguf")
    write_gguf(out["llama"], gg / "tiny-llama.Q8_0.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    out["gguf"] = gg
    return out


@pytest.fixture(scope="module")
def hub(repos: dict[str, Path]):
    with FakeHub() as fake, pytest.MonkeyPatch.context() as patch:
        # huggingface_hub read HF_ENDPOINT when it was imported: in this process, point what
        # it read at the fake, so that nothing here ever asks huggingface.co.
        patch.setattr(huggingface_hub.constants, "ENDPOINT", fake.url)
        patch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                      fake.url + "/{repo_id}/resolve/{revision}/{filename}")
        fake.add_folder("org/tiny-llama", repos["llama"], branch="v1")
        fake.add_folder("org/tiny-llama", repos["llama_v2"])  # main moves on
        fake.add_folder("org/tiny-gpt2", repos["gpt2"])
        fake.add_folder("org/tiny-opt", repos["opt"])
        fake.add_folder("org/tiny-GGUF", repos["gguf"])
        fake.add_folder("org/gated", repos["llama"], token=TOKEN)
        llama = {p.name: p.read_bytes() for p in repos["llama"].iterdir()}
        pickled = {k: v for k, v in llama.items() if not k.endswith(".safetensors")}
        fake.add_commit("org/pickles", pickled | {"pytorch_model.bin": b"\x80\x04 pickle"})
        fake.add_commit("org/sharded", _sharded(llama))
        sampling = json.loads(llama["generation_config.json"]) | {"temperature": 0.5, "top_k": 7}
        fake.add_commit("org/sampling", llama | {
            "generation_config.json": json.dumps(sampling).encode()})
        config = json.loads(llama["config.json"]) | {"auto_map": {"AutoModel": "x.Y"}}
        fake.add_commit("org/remote-code", llama | {"config.json": json.dumps(config).encode()})
        yield fake


def _sharded(files: dict[str, bytes]) -> dict[str, bytes]:
    """The Llama repo with its weights in two shards and an index, plus a consolidated
    copy beside them (as Mistral's repos carry) that nothing should fetch."""
    from safetensors.torch import load, save

    weights = load(files["model.safetensors"])
    names = sorted(weights)
    half = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    out = {k: v for k, v in files.items() if k != "model.safetensors"}
    for shard, keys in half.items():
        out[shard] = save({k: weights[k] for k in keys})
    out["model.safetensors.index.json"] = json.dumps(
        {"weight_map": {k: shard for shard, keys in half.items() for k in keys}}).encode()
    out["consolidated.safetensors"] = files["model.safetensors"]
    return out


def _resolve(hub: FakeHub, tmp: Path, name: str, **kwargs):
    return resolve_name(name, cache_dir=tmp / "hub", endpoint=hub.url,
                        record_dir=tmp / "checked", **kwargs)


def _files(hub: FakeHub, repo: str, branch: str = "main") -> dict[str, bytes]:
    r = hub.repos[repo]
    return r.commits[r.refs[branch]]


def _blob(path: Path) -> Path:
    return Path(os.path.realpath(path))


# -- end to end ------------------------------------------------------------------------


def _greedy_text(folder: Path, prompt: str, n: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return tok.decode(out[0, ids.shape[1]:])


def test_serve_by_id_then_offline_from_the_cache_with_no_request(
        hub: FakeHub, repos: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine"))
    expected = _greedy_text(repos["llama_v2"], "hello world", 4)
    for offline in ("0", "1"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        before = hub.count()
        with _server(None, "--model", "org/tiny-llama", "--dtype", "float32") as (proc, url, log):
            client = openai.OpenAI(base_url=url + "/v1", api_key="none")
            assert [m.id for m in client.models.list()] == ["org/tiny-llama"]
            done = client.completions.create(model="org/tiny-llama", prompt="hello world",
                                             max_tokens=4, temperature=0.0)
            assert done.choices[0].text == expected
            proc.send_signal(signal.SIGINT)
        if offline == "1":
            assert hub.count() == before, hub.requests[before:]
        else:
            assert hub.count() > before
            assert any("downloaded" in line for line in log), "".join(log)


def test_a_gguf_id_with_a_tag_serves_that_file_with_another_repos_tokenizer(
        hub: FakeHub, tmp_path: Path) -> None:
    config = resolve_config(
        EngineConfig(model="org/tiny-GGUF:Q8_0", tokenizer="org/tiny-llama", revision=None,
                     download_dir=str(tmp_path / "hub")), endpoint=hub.url)
    assert Path(config.model).name == "tiny-llama.Q8_0.gguf"
    assert Path(config.model).read_bytes() == _files(hub, "org/tiny-GGUF")["tiny-llama.Q8_0.gguf"]
    assert config.served_model_name == "org/tiny-GGUF:Q8_0"
    assert sorted(p.name for p in Path(config.tokenizer).iterdir()) == [
        "tokenizer.json", "tokenizer_config.json"]
    fetched = [r for r in hub.requests if r.startswith("GET /org/tiny-GGUF/resolve")]
    assert fetched and all("Q8_0" in r for r in fetched)  # only the chosen file


async def test_open_engine_takes_a_gguf_id_and_a_tokenizer_repo(
        hub: FakeHub, repos: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine"))
    options = dict(dtype="float32", max_num_seqs=4, kv_cache_memory=4 * 2**20)
    prompt = [5, 6, 7, 8]
    async with engine.open_engine("org/tiny-GGUF:Q8_0", tokenizer="org/tiny-llama",
                                  download_dir=str(tmp_path / "hub"), **options) as eng:
        assert eng.model_name == "org/tiny-GGUF:Q8_0"
        got = token_ids(await collect(eng, prompt, greedy(6)))
        folder = Path(eng.tokenizer.folder)
    assert folder.parent.parent.name == "models--org--tiny-llama"
    # The oracle: the same file opened by its path.
    async with engine.open_engine(str(repos["gguf"] / "tiny-llama.Q8_0.gguf"), **options) as eng:
        assert got == token_ids(await collect(eng, prompt, greedy(6)))


@pytest.mark.parametrize("engine_core", ["inprocess", "process"])
async def test_another_tokenizer_keeps_the_models_sampling_defaults(
        hub: FakeHub, repos: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, engine_core: str) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine"))
    # The tokenizer's folder has a generation_config.json without sampling fields; the
    # model's (org/sampling) has two.
    async with engine.open_engine("org/sampling", tokenizer=str(repos["llama_v2"]),
                                  download_dir=str(tmp_path / "hub"), dtype="float32",
                                  max_num_seqs=2, kv_cache_memory=4 * 2**20,
                                  engine_core=engine_core) as eng:
        assert eng.sampling_defaults == {"temperature": 0.5, "top_k": 7}
        assert Path(eng.tokenizer.folder) == repos["llama_v2"]


# -- what is fetched ---------------------------------------------------------------------


@pytest.mark.parametrize("repo", ["org/tiny-gpt2", "org/tiny-opt"])
def test_transformers_folders_download_with_only_what_the_engine_reads(
        hub: FakeHub, tmp_path: Path, repo: str) -> None:
    got = _resolve(hub, tmp_path, repo)
    files = _files(hub, repo)
    fetched = {p.name: p.read_bytes() for p in got.path.iterdir()}
    assert fetched == {k: v for k, v in fetched.items() if files.get(k) == v}
    assert not {"README.md", "flax_model.msgpack", "pytorch_model.bin"} & fetched.keys()
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= fetched.keys()


@pytest.mark.parametrize("repo", ["org/tiny-gpt2", "org/tiny-opt"])
async def test_gpt2_and_opt_by_id_answer_as_transformers(
        hub: FakeHub, repos: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, repo: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine"))
    folder = repos[repo.removeprefix("org/tiny-")]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = "the engine serves tokens"
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    async with engine.open_engine(repo, download_dir=str(tmp_path / "hub"), dtype="float32",
                                  max_num_seqs=2, kv_cache_memory=4 * 2**20) as eng:
        assert eng.model_name == repo
        got = token_ids(await collect(eng, prompt, greedy(8)))
    assert got == ref[0, ids.shape[1]:].tolist()


def test_a_sharded_repo_fetches_the_shards_its_index_names(
        hub: FakeHub, repos: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from engine.models.loader import load_model

    got = _resolve(hub, tmp_path, "org/sharded")
    assert sorted(p.name for p in got.path.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    loaded = load_model(got.path, dtype="float32")
    expected = load_file(repos["llama"] / "model.safetensors")
    assert loaded.weights.keys() >= expected.keys() - {"lm_head.weight"}
    for name in expected.keys() & loaded.weights.keys():
        assert torch.equal(loaded.weights[name], expected[name]), name
    assert _resolve(hub, tmp_path, "org/sharded", offline=True).path == got.path


def test_a_draft_model_and_a_tokenizer_by_id_become_paths(hub: FakeHub, tmp_path: Path) -> None:
    spec = {"method": "draft_model", "model": "org/tiny-llama", "num_speculative_tokens": 2}
    config = resolve_config(EngineConfig(
        model="org/tiny-llama", revision="v1", speculative_config=json.dumps(spec),
        download_dir=str(tmp_path / "hub")))
    v1 = hub.repos["org/tiny-llama"].refs["v1"]
    assert Path(config.model).name == v1
    draft = Path(config.speculative.model)
    assert draft.parent.parent.name == "models--org--tiny-llama" and draft.name != v1  # main


def test_revision_pins_a_commit_by_branch_or_hash(hub: FakeHub, tmp_path: Path) -> None:
    v1 = hub.repos["org/tiny-llama"].refs["v1"]
    by_branch = _resolve(hub, tmp_path, "org/tiny-llama", revision="v1")
    by_hash = _resolve(hub, tmp_path, "org/tiny-llama", revision=v1)
    main = _resolve(hub, tmp_path, "org/tiny-llama")
    assert by_branch.path == by_hash.path and by_branch.commit == v1
    weights = "model.safetensors"
    assert (by_branch.path / weights).read_bytes() == _files(hub, "org/tiny-llama", "v1")[weights]
    assert (main.path / weights).read_bytes() == _files(hub, "org/tiny-llama")[weights]
    assert main.commit != v1
    # Offline, the branch name is read from the cache's refs.
    assert _resolve(hub, tmp_path, "org/tiny-llama", revision="v1", offline=True).path == by_hash.path
    with pytest.raises(ModelNotFoundError, match="no revision 'v9'"):
        _resolve(hub, tmp_path, "org/tiny-llama", revision="v9")


def test_a_gated_repo_needs_its_token(hub: FakeHub, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))  # no saved login
    with pytest.raises(ModelAccessError, match="org/gated.*HF_TOKEN"):
        _resolve(hub, tmp_path, "org/gated")
    got = _resolve(hub, tmp_path, "org/gated", token=TOKEN)
    assert (got.path / "model.safetensors").read_bytes() == \
        _files(hub, "org/gated")["model.safetensors"]


def test_llm_takes_a_gated_id_with_hf_token(hub: FakeHub, repos: dict[str, Path],
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import LLM, SamplingParams

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine"))
    with LLM("org/gated", hf_token=TOKEN, download_dir=str(tmp_path / "hub"), dtype="float32",
             max_num_seqs=2, kv_cache_memory=4 * 2**20) as llm:
        out = llm.generate("hello world", SamplingParams(max_tokens=4, temperature=0.0,
                                                          ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].text == _greedy_text(repos["llama"], "hello world", 4)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_cached_file_is_fetched_again_never_loaded(
        hub: FakeHub, tmp_path: Path, damage: str) -> None:
    got = _resolve(hub, tmp_path, "org/tiny-llama")
    blob = _blob(got.path / "model.safetensors")
    data = blob.read_bytes()
    with open(blob, "r+b") as f:
        if damage == "truncate":
            f.truncate(len(data) // 2)
        else:
            f.seek(len(data) // 2)
            f.write(bytes([data[len(data) // 2] ^ 0xFF]))
    with pytest.raises(CorruptModelError, match="model.safetensors"):
        _resolve(hub, tmp_path, "org/tiny-llama", offline=True)
    again = _resolve(hub, tmp_path, "org/tiny-llama")
    assert (again.path / "model.safetensors").read_bytes() == \
        _files(hub, "org/tiny-llama")["model.safetensors"]
    assert _resolve(hub, tmp_path, "org/tiny-llama", offline=True).path == got.path


def test_a_dropped_transfer_resumes_where_it_stopped(
        hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks smaller than the file, so that half of it is written before the cut (the
    # Hub's files are gigabytes against 10 MB chunks).
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.drop_once.add(("org/tiny-opt", "model.safetensors"))
    got = _resolve(hub, tmp_path, "org/tiny-opt")
    data = _files(hub, "org/tiny-opt")["model.safetensors"]
    assert (got.path / "model.safetensors").read_bytes() == data
    ranged = [r for r in hub.requests if "tiny-opt" in r and "Range=bytes=" in r]
    assert len(ranged) == 1 and int(ranged[0].rsplit("=", 1)[1].rstrip("-")) > 0


def test_not_enough_disk_is_refused_before_any_weight_is_fetched(
        hub: FakeHub, tmp_path: Path) -> None:
    before = hub.count()
    with pytest.raises(ModelLoadError, match="to download and .* free"):
        _resolve(hub, tmp_path, "org/tiny-gpt2", free_bytes=lambda path: 1000)
    assert [r for r in hub.requests[before:] if "/resolve/" in r] == []


def test_two_resolutions_at_once_share_the_cache(hub: FakeHub, tmp_path: Path) -> None:
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(
        _resolve(hub, tmp_path, "org/tiny-llama", revision="v1"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0].path == results[1].path
    blob = _blob(results[0].path / "model.safetensors")
    expected = _files(hub, "org/tiny-llama", "v1")["model.safetensors"]
    assert hashlib.sha256(blob.read_bytes()).digest() == hashlib.sha256(expected).digest()


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "error", "message"), [
    ("org/no-such-repo", ModelNotFoundError, "Hub has no repo 'org/no-such-repo'"),
    ("org/pickles", UnsupportedModelError, "pickles only.*pytorch_model.bin.*safetensors"),
    ("org/remote-code", UnsupportedModelError, "auto_map"),
    ("org/tiny-GGUF", ModelNotFoundError,
     "2 GGUF files.*tiny-llama.F32.gguf, tiny-llama.Q8_0.gguf.*org/tiny-GGUF:TAG"),
    ("org/tiny-GGUF:Q4_K_M", ModelNotFoundError, "no GGUF file of quantization Q4_K_M"),
    ("../no-such-folder/model", ModelNotFoundError, "not a Hugging Face Hub id"),
    ("org/x; rm -rf ~", ModelNotFoundError, "not a Hugging Face Hub id"),
])
def test_refusals_name_the_repo_and_the_reason(hub: FakeHub, tmp_path: Path, name: str,
                                                error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _resolve(hub, tmp_path, name)
    # Nothing of the model was written to the cache's snapshots (the config at most).
    weights = list((tmp_path / "hub").rglob("*.safetensors")) if (tmp_path / "hub").exists() else []
    assert weights == []


def test_offline_and_not_cached_names_the_repo_and_the_cache(hub: FakeHub, tmp_path: Path) -> None:
    before = hub.count()
    with pytest.raises(ModelNotFoundError, match=f"org/tiny-llama.*{tmp_path / 'hub'}.*HF_HUB_OFFLINE"):
        _resolve(hub, tmp_path, "org/tiny-llama", offline=True)
    assert hub.count() == before


def test_an_unreachable_hub_falls_back_to_the_cache(hub: FakeHub, tmp_path: Path) -> None:
    cached = _resolve(hub, tmp_path, "org/tiny-gpt2")
    # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    away = dict(cache_dir=tmp_path / "hub", endpoint="http://127.0.0.1:9",
                record_dir=tmp_path / "checked")
    assert resolve_name("org/tiny-gpt2", **away).path == cached.path
    with pytest.raises(ModelNotFoundError, match="org/tiny-opt.*could not be reached"):
        resolve_name("org/tiny-opt", **away)


def test_a_local_path_stays_a_path(repos: dict[str, Path]) -> None:
    got = resolve_name(str(repos["llama"]))
    assert got.path == repos["llama"] and got.name is None
