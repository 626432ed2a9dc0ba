"""``--kv-transfer-config``: vLLM's folder connector (``ExampleConnector``), prompt blocks
shared between engines through a folder.

What is checked: a block's bytes come back from the folder as they were in the pool (the
pool's own tensors are the oracle); an engine that reads a prompt's blocks computes only
the rest, and answers as transformers does on the whole prompt; each role does only its
half (a prefill engine writes, a decode engine behind an engine-core process reads); a
file that cannot be read is a miss, not an error; weights read again write to a folder of
their own; and what is not built is refused by name."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from engine_helpers import collect, greedy, token_ids
from http_server import ServerThread
from test_granite4_mamba import write_hybrid
from test_parity import LOGPROB_ATOL, _hf_greedy, _hf_model

import engine
from engine.cli.args import config_from_args
from engine.cli.serve import add_serve_arguments
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from engine.models.config import ModelConfig
from engine.models.testing import write_tiny_model
from engine.runner.kv_cache import allocate_kv_caches
from engine.runner.kv_store import HEADER, KVStore, pool_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(5 * BLOCK + 3)]  # 5 full blocks and 3 tokens
# Its first 3 blocks, then other tokens: a prompt sharing a system prompt, say.
SHARED = PROMPT[:3 * BLOCK] + [(11 * i + 5) % 200 + 3 for i in range(2 * BLOCK + 7)]


def _kv(folder: Path, role: str = "kv_both", name: str = "ExampleConnector") -> dict[str, Any]:
    return {"kv_connector": name, "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(folder)}}


def _options(store: Path, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    return dict(block_size=BLOCK, dtype="float32", kv_transfer_config=_kv(store, role)) | extra


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("kvt") / "llama", "llama")


@pytest.fixture(scope="module")
def hf(model: Path) -> Any:
    return _hf_model(model)


def _files(store: Path) -> list[Path]:
    return sorted(store.rglob("*.kv"))


async def _answer(eng: Any, prompt: list[int], n: int = 8) -> tuple[list[int], list[float]]:
    outputs = await collect(eng, prompt, greedy(n, logprobs=0))
    return token_ids(outputs), [lp.logprob for out in outputs for lp in out.logprobs]


def _assert_transformers(answer: tuple[list[int], list[float]], hf: Any, prompt: list[int]) -> None:
    tokens, logprobs = _hf_greedy(hf, prompt, len(answer[0]))
    assert answer[0] == tokens
    assert answer[1] == pytest.approx(logprobs, abs=LOGPROB_ATOL)


# -- the configuration ---------------------------------------------------------------------------


def test_vllms_json_is_taken_and_what_is_not_built_is_refused(tmp_path: Path) -> None:
    for name in ("ExampleConnector", "SharedStorageConnector"):
        for role in ("kv_producer", "kv_consumer", "kv_both"):
            kv = EngineConfig(kv_transfer_config=json.dumps(_kv(tmp_path, role, name))).kv_transfer
            assert (kv.kv_connector, kv.kv_role, kv.shared_storage_path) == (name, role, str(tmp_path))
            assert (kv.saves, kv.loads) == (role != "kv_consumer", role != "kv_producer")
    # vLLM's default folder; another connector's transport keys are accepted, unused.
    kv = parse_kv_transfer_config({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                   "kv_ip": "127.0.0.1", "kv_port": 14579, "kv_buffer_size": 1e9,
                                   "kv_load_failure_policy": "recompute"})
    assert kv == KVTransferConfig("ExampleConnector", "kv_both", "/tmp")
    assert EngineConfig(kv_transfer_config=kv).kv_transfer == kv  # the checked form given back
    refused = {
        "NixlConnector": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        "kv_role": {"kv_connector": "ExampleConnector", "kv_role": "kv_sender"},
        "kv_load_failure_policy": {**_kv(tmp_path), "kv_load_failure_policy": "fail"},
        "kv_connector_module_path": {**_kv(tmp_path), "kv_connector_module_path": "my.connector"},
        "unknown key": {**_kv(tmp_path), "kv_rol": "kv_both"},
        "chunk_size": {**_kv(tmp_path), "kv_connector_extra_config": {"chunk_size": 256}},
        "not JSON": "{kv_connector: ExampleConnector}",
    }
    for words, value in refused.items():
        with pytest.raises(ConfigError, match=words) as info:
            EngineConfig(kv_transfer_config=value)
        assert info.value.field == "kv_transfer_config"
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                   {"speculative_config": {"method": "draft_model", "model": str(tmp_path),
                                           "num_speculative_tokens": 2}}):
        with pytest.raises(ConfigError, match="kv_transfer_config") as info:
            EngineConfig(kv_transfer_config=_kv(tmp_path), **layout)
        assert info.value.field == "kv_transfer_config"
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(["--kv-transfer-config", json.dumps(_kv(tmp_path, "kv_consumer"))]))
    assert config.kv_transfer == KVTransferConfig("ExampleConnector", "kv_consumer", str(tmp_path))


async def test_a_model_whose_state_the_blocks_do_not_hold_is_refused(tmp_path: Path) -> None:
    hybrid = tmp_path / "hybrid"
    write_hybrid(hybrid)
    with pytest.raises(ConfigError, match="recurrent") as info:
        async with engine.open_engine(model=str(hybrid), **_options(tmp_path / "store")):
            pass
    assert info.value.field == "kv_transfer_config"


# -- the folder ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_block_comes_back_from_the_folder_as_it_was_in_the_pool(
    model: Path, tmp_path: Path, kv_cache_dtype: str
) -> None:
    config = ModelConfig.from_hf(json.loads((model / "config.json").read_text()))
    pools = [allocate_kv_caches(config, 16, BLOCK, torch.float32, "cpu", kv_cache_dtype=kv_cache_dtype)
             for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    for t in pool_tensors(pools[0]):
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    kv = parse_kv_transfer_config(_kv(tmp_path))
    store = KVStore.for_engine(kv, pools[0], model_path=model, dtype="float32", hf_overrides=None)
    digests = store.digests(PROMPT, None, BLOCK)
    assert len(digests) == len(PROMPT) // BLOCK
    assert store.save(pools[0], [(3, digests[0]), (7, digests[1])]) == 2
    assert store.save(pools[0], [(3, digests[0])]) == 0  # there already
    payloads = store.read_prefix(digests)
    assert len(payloads) == 2  # up to the first block not written
    store.load(pools[1], [(10, payloads[0]), (11, payloads[1])])
    for src, dst in zip(pool_tensors(pools[0]), pool_tensors(pools[1]), strict=True):
        assert torch.equal(dst[10], src[3]) and torch.equal(dst[11], src[7])
        assert int(dst[:10].count_nonzero()) == 0  # nothing else written
    # Another salt, another prompt, another model dtype: other names, or another folder.
    assert store.digests(PROMPT, "salt", BLOCK)[0] != digests[0]
    assert store.digests(SHARED, None, BLOCK)[:3] == digests[:3]
    assert store.digests(SHARED, None, BLOCK)[3] != digests[3]
    other = KVStore.for_engine(kv, pools[0], model_path=model, dtype="bfloat16", hf_overrides=None)
    assert other.folder != store.folder and other.read_prefix(digests) == []
    # A file cut short, or carrying another block's digest, ends the prefix there.
    path = store.path(digests[1])
    path.write_bytes(path.read_bytes()[:-1])
    assert len(store.read_prefix(digests)) == 1
    store.path(digests[0]).write_bytes(HEADER.pack(b"EKV1", digests[1], store.block_nbytes)
                                       + bytes(store.block_nbytes))
    assert store.read_prefix(digests) == []


# -- engines sharing the folder -------------------------------------------------------------------


async def test_a_second_engine_reads_the_prompt_instead_of_computing_it(
    model: Path, hf: Any, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    async with engine.open_engine(model=str(model), **_options(store)) as eng:
        first = await _answer(eng, PROMPT)
        assert eng.statistics().external_prefix_cache_hits == 0
    assert len(_files(store)) == 5  # every full block of the prompt
    _assert_transformers(first, hf, PROMPT)
    async with engine.open_engine(model=str(model), **_options(store)) as eng:
        before = eng.statistics()
        outputs = await collect(eng, PROMPT, greedy(8, logprobs=0))
        after = eng.statistics()
        assert outputs[-1].usage.cached_tokens == 5 * BLOCK
        # 3 prompt tokens and 7 decode steps computed; the 80 read.
        assert after.scheduled_tokens - before.scheduled_tokens == 3 + 7
        assert after.external_prefix_cache_hits == 5 * BLOCK
        assert after.external_prefix_cache_queries == len(PROMPT)
        assert after.prefix_cache_hits == 0  # this engine's own cache was empty
        assert token_ids(outputs) == first[0]
        assert [lp.logprob for o in outputs for lp in o.logprobs] == pytest.approx(first[1], abs=LOGPROB_ATOL)
        # The blocks read entered its own prefix cache: the prompt again hits there.
        again = await collect(eng, PROMPT, greedy(2))
        assert eng.statistics().prefix_cache_hits == 5 * BLOCK
        assert again[-1].usage.cached_tokens == 5 * BLOCK
        # A prompt sharing the first 3 blocks reads those, computes the rest (and writes
        # its own 2 new full blocks).
        shared = await _answer(eng, SHARED)
        assert eng.statistics().external_prefix_cache_hits == 5 * BLOCK
    _assert_transformers(shared, hf, SHARED)
    assert len(_files(store)) == 7


async def test_what_is_read_is_what_the_model_attends_to(model: Path, hf: Any, tmp_path: Path) -> None:
    """The blocks read are used as they are: a file whose K/V were zeroed (its header
    intact) changes the answer away from transformers', which a recomputed block would
    not."""
    store = tmp_path / "store"
    async with engine.open_engine(model=str(model), **_options(store)) as eng:
        await _answer(eng, PROMPT, 1)
    for path in _files(store):
        data = path.read_bytes()
        path.write_bytes(data[:HEADER.size] + bytes(len(data) - HEADER.size))
    async with engine.open_engine(model=str(model), **_options(store)) as eng:
        answer = await _answer(eng, PROMPT)
        assert eng.statistics().external_prefix_cache_hits == 5 * BLOCK
    expected = _hf_greedy(hf, PROMPT, 8)
    assert max(abs(a - b) for a, b in zip(answer[1], expected[1], strict=True)) > 100 * LOGPROB_ATOL


async def test_a_block_that_cannot_be_read_is_computed(model: Path, hf: Any, tmp_path: Path) -> None:
    """The prompt's second block's file is cut short: the engine reads the first block,
    computes the rest (the three after it are in the folder, but no longer a prefix), and
    answers as transformers does."""
    store = tmp_path / "store"
    async with engine.open_engine(model=str(model), **_options(store)) as eng:
        await _answer(eng, PROMPT[:BLOCK + 1], 1)
        first = set(_files(store))
        await _answer(eng, PROMPT[:2 * BLOCK + 1], 1)
        (second,) = set(_files(store)) - first
        await _answer(eng, PROMPT, 1)
    assert len(_files(store)) == 5
    second.write_bytes(second.read_bytes()[:HEADER.size + 10])
    async with engine.open_engine(model=str(model), **_options(store)) as eng:
        answer = await _answer(eng, PROMPT)
        assert eng.statistics().external_prefix_cache_hits == BLOCK
    _assert_transformers(answer, hf, PROMPT)


async def test_a_prefill_engine_writes_and_a_decode_engine_behind_a_core_process_reads(
    model: Path, hf: Any, tmp_path: Path
) -> None:
    """Disaggregated prefill as vLLM's folder connector does it: the prefill engine
    (kv_producer) computes the prompt and one token; the decode engine (kv_consumer, its
    core in a process of its own) reads the prompt's blocks and decodes. Neither does the
    other's half."""
    store = tmp_path / "store"
    async with engine.open_engine(model=str(model), **_options(store, "kv_producer")) as eng:
        await _answer(eng, PROMPT, 1)
        await _answer(eng, PROMPT, 1)  # its own cache; it never reads the folder
        assert eng.statistics().external_prefix_cache_queries == 0
    written = _files(store)
    assert len(written) == 5
    async with engine.open_engine(model=str(model), **_options(store, "kv_consumer", engine_core="process")) as eng:
        answer = await _answer(eng, PROMPT)
        assert eng.statistics().external_prefix_cache_hits == 5 * BLOCK
        await _answer(eng, SHARED, 1)  # new full blocks, not written by a consumer
    assert _files(store) == written
    _assert_transformers(answer, hf, PROMPT)


async def test_weights_read_again_share_blocks_only_with_the_same_weights(tmp_path: Path) -> None:
    """reload_weights after a trainer rewrote the checkpoint: the blocks of the old
    weights are not read (the answer is transformers' on the new weights), and the new
    weights' blocks go to a folder of their own, which an engine opened on them reads."""
    path = write_tiny_model(tmp_path / "llama", "llama", seed=0)
    store = tmp_path / "store"
    async with engine.open_engine(model=str(path), **_options(store)) as eng:
        await _answer(eng, PROMPT, 1)
        write_tiny_model(path, "llama", seed=1)
        await eng.reload_weights()
        new = await _answer(eng, PROMPT)
        assert eng.statistics().external_prefix_cache_hits == 0
    assert len([p for p in store.iterdir() if p.is_dir()]) == 2
    async with engine.open_engine(model=str(path), **_options(store)) as eng:
        again = await _answer(eng, PROMPT)
        assert again[0] == new[0] and again[1] == pytest.approx(new[1], abs=LOGPROB_ATOL)
        assert eng.statistics().external_prefix_cache_hits == 5 * BLOCK
    _assert_transformers(new, _hf_model(path), PROMPT)


def test_served_usage_and_metrics_count_the_blocks_read(model: Path, tmp_path: Path) -> None:
    """Through HTTP, with the official client: cached_tokens counts the blocks read, and
    /metrics exports the store's counters."""
    store = tmp_path / "store"

    def opened() -> Any:
        return engine.open_engine(model=str(model), enable_prompt_tokens_details=True, **_options(store))

    with ServerThread(opened) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        name = server.engine.model_name
        first = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    with ServerThread(opened) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        second = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert second.usage.prompt_tokens_details.cached_tokens == 5 * BLOCK
    assert second.choices[0].text == first.choices[0].text
    hits = [line for line in metrics.splitlines() if line.startswith("engine:external_prefix_cache_hits_total")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) == 5 * BLOCK


def test_vllms_offline_disaggregated_prefill_example(model: Path, hf: Any, tmp_path: Path) -> None:
    """vLLM's offline example, as written: a prefill LLM (kv_producer) generates one token
    for each prompt, then a decode LLM (kv_consumer) on the same folder generates the
    answers, reading the prompts' blocks."""
    prompts = [{"prompt_token_ids": p} for p in (PROMPT, SHARED)]
    store = tmp_path / "store"
    with engine.LLM(str(model), **_options(store, "kv_producer")) as llm:
        llm.generate(prompts, engine.SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    with engine.LLM(str(model), **_options(store, "kv_consumer")) as llm:
        outputs = llm.generate(prompts, engine.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)
        hits = llm.get_metrics()
    for out, p in zip(outputs, (PROMPT, SHARED), strict=True):
        assert out.num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, p, 6)[0]
    # Every cached token came from the folder: read there, or (SHARED's first blocks, when
    # it runs after PROMPT's blocks entered the cache) from the cache that read them.
    (read,) = [m for m in hits if m.name == "vllm:external_prefix_cache_hits"]
    (local,) = [m for m in hits if m.name == "vllm:prefix_cache_hits"]
    assert read.value >= len(PROMPT) // BLOCK * BLOCK
    assert read.value + local.value == sum((len(p) - 1) // BLOCK * BLOCK for p in (PROMPT, SHARED))
