"""Tensor parallelism's processes (engine/process/workers.py, worker_rank.py): worker ranks driven by
rank 0, the step broadcast, a worker killed mid-stream, Ray placement, and SmolLM2 split
over three ranks behind ``python -m engine serve``.

The oracle of every output is the same engine at one rank (itself checked against
transformers in test_parity.py / test_cli.py): the split model must give the one-rank
greedy tokens and, for a seeded sampler, the same draws."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import torch
import trio
from engine_helpers import collect, greedy, token_ids, wait_idle

import engine
from engine.errors import EngineDeadError
from engine.params import SamplingParams
from engine.structured.spec import StructuredOutputs

REPO = Path(__file__).resolve().parent.parent
OPTIONS: dict[str, Any] = dict(dtype="float32", kv_cache_memory=2**22, max_num_seqs=8,
                               async_scheduling=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.models.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tp-tiny"), "llama")


def _children() -> set[int]:
    """This process's live child processes. Tests compare the set before and after: the
    suite's process may hold children of its own (multiprocessing's resource tracker,
    started by another module's spawned ranks, lives as long as the process)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42], [100, 7, 33, 2 + 60, 90, 91]]
CASES: list[tuple[str, SamplingParams]] = [
    ("greedy", greedy(20)),
    ("logprobs", greedy(12, logprobs=3, prompt_logprobs=2)),
    ("penalties", greedy(16, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.3)),
    ("seeded", SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16,
                              ignore_eos=True)),
    ("regex", SamplingParams(temperature=0.0, max_tokens=12,
                             structured_outputs=StructuredOutputs(regex="[a-f]{3,6}"))),
]


async def _outputs(eng: Any) -> dict[tuple[str, int], Any]:
    """Every case on every prompt, all in flight at once (batched, async scheduling), then
    the first prompt again (its leading blocks come from the prefix cache)."""
    out: dict[tuple[str, int], Any] = {}

    async def one(name: str, i: int, params: SamplingParams) -> None:
        out[name, i] = await collect(eng, PROMPTS[i], params)

    async with trio.open_nursery() as nursery:
        for name, params in CASES:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, name, i, params)
    before = eng.statistics().prefix_cache_hits
    out["again", 0] = await collect(eng, PROMPTS[0], greedy(20))
    assert eng.statistics().prefix_cache_hits > before
    return out


def _same(got: list[Any], want: list[Any]) -> bool:
    """The same tokens, and logprobs within fp32's reach of a different summation order."""

    def flat(outputs: list[Any]) -> tuple[list[int], list[tuple[int, float]]]:
        scored = [lp for out in outputs for lp in (out.logprobs or ())]
        scored += [p for p in (outputs[0].prompt_logprobs or ()) if p is not None]
        return token_ids(outputs), [(lp.token_id, lp.logprob) for lp in scored]

    (got_ids, got_lp), (want_ids, want_lp) = flat(got), flat(want)
    return got_ids == want_ids and len(got_lp) == len(want_lp) and all(
        a == c and abs(b - d) < 1e-4 for (a, b), (c, d) in zip(got_lp, want_lp, strict=True))


async def test_two_ranks_give_the_one_rank_outputs_for_every_sampling_feature(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = await _outputs(eng)
    threads = torch.get_num_threads()
    async with engine.open_engine(str(model), tensor_parallel_size=2, **OPTIONS) as eng:
        runner = eng._parts.runner
        pids = runner.worker_pids()
        assert len(pids) == 1 and psutil.Process(pids[0]).ppid() == os.getpid()
        # Rank 0 holds half the model: one of the two KV heads in its pool.
        assert runner.rank0.tp.world_size == 2
        assert runner.kv_caches[0][0].shape[2] == runner.config.num_key_value_heads // 2 == 1
        got = await _outputs(eng)
        await wait_idle(eng)  # every KV block came back
        group = eng._parts.runner.group
        assert group.stats.steps > 0
        # The regex grammar went to the worker with its requests' steps: a worker never
        # compiles (it would raise: engine.process.grammars), so equal outputs say it
        # read back what rank 0 sent.
        assert 1 <= runner.grammars.sent <= 3
    for key, outputs in want.items():
        assert _same(got[key], outputs), key
    assert any(token_ids(want["regex", i]) for i in range(3))
    assert not psutil.pid_exists(pids[0])  # stopped with the engine
    assert torch.get_num_threads() == threads  # rank 0's share of the CPUs given back


async def _fail_mid_stream(eng: Any, sig: signal.Signals) -> tuple[int, str]:
    """Stream a long request, send ``sig`` to the worker after 3 tokens; the stream must
    fail. Returns the worker's pid and the error, once the engine serves again."""
    (victim,) = eng._parts.runner.worker_pids()
    stream = await eng.submit(PROMPTS[0], greedy(400))
    seen, sent = 0, False
    with pytest.raises(EngineDeadError) as info:
        async with stream:
            async for out in stream:
                seen += len(out.token_ids)
                if seen >= 3 and not sent:
                    os.kill(victim, sig)
                    sent = True
    assert 3 <= seen < 400
    with trio.fail_after(120):
        while not eng.serving:  # noqa: ASYNC110 - the group restarts (a new worker loads)
            await trio.sleep(0.05)
    assert not psutil.pid_exists(victim)  # stopped (a stuck one killed) and reaped
    return victim, str(info.value)


async def test_a_worker_killed_or_stuck_mid_stream_fails_that_stream_and_the_group_restarts(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.process.workers as workers

    # A stuck peer fails the step after the collective timeout (here 3 s, not 60).
    monkeypatch.setattr(workers, "COLLECTIVE_TIMEOUT_SECONDS", 3.0)
    before = _children()
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = token_ids(await collect(eng, PROMPTS[1], greedy(8)))
    async with engine.open_engine(str(model), tensor_parallel_size=2, max_engine_restarts=2,
                                  **OPTIONS) as eng:
        victim, error = await _fail_mid_stream(eng, signal.SIGKILL)
        assert f"tensor-parallel worker rank 1 (pid {victim}) died (killed by signal 9)" in error
        assert token_ids(await collect(eng, PROMPTS[1], greedy(8))) == want
        stopped, error = await _fail_mid_stream(eng, signal.SIGSTOP)
        assert stopped != victim
        assert "tensor-parallel worker rank 1 did not answer within 3 s" in error
        assert token_ids(await collect(eng, PROMPTS[1], greedy(8))) == want
        (replacement,) = eng._parts.runner.worker_pids()
        assert replacement not in (victim, stopped) and eng.restarts == 2
    assert not psutil.pid_exists(replacement)
    assert _children() <= before


async def test_ray_places_the_workers_of_two_ranks_on_a_local_ray(model: Path) -> None:
    """One local Ray for the whole suite, started and stopped by the engine: 1 CPU per
    worker rank, no dashboard, a 100 MB object store, loopback only; its session lives in
    the engine's runtime folder (not /tmp/ray) and is gone after the engine stops."""
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    import shutil
    import tempfile

    import ray

    before = _children()
    # Short: Ray's socket paths under it must fit a Unix socket's 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="rt-"))
    mine = f"session_*_{os.getpid()}"
    in_tmp = set((Path(tempfile.gettempdir()) / "ray").glob(mine))
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = token_ids(await collect(eng, PROMPTS[0], greedy(12)))
    assert not ray.is_initialized()
    env_address = os.environ.pop("RAY_ADDRESS", None)
    try:
        async with engine.open_engine(str(model), tensor_parallel_size=2, runtime_dir=str(root),
                                      distributed_executor_backend="ray", **OPTIONS) as eng:
            assert ray.is_initialized()
            placement = eng._parts.runner.group._placement
            assert ray.util.placement_group_table(placement)["bundles"] == {0: {"CPU": 1.0}}
            assert token_ids(await collect(eng, PROMPTS[0], greedy(12))) == want
            sessions = list((root / "ray").glob(mine))  # noqa: ASYNC240 - a test's look
            assert len(sessions) == 1 and (sessions[0] / "sockets").is_dir()
    finally:
        if env_address is not None:
            os.environ["RAY_ADDRESS"] = env_address
    assert not ray.is_initialized()  # the engine stopped the Ray it started
    assert not sessions[0].exists()  # noqa: ASYNC240 - and removed its session
    assert set((Path(tempfile.gettempdir()) / "ray").glob(mine)) == in_tmp  # noqa: ASYNC240
    shutil.rmtree(root, ignore_errors=True)
    with trio.fail_after(30):  # and its processes (GCS, raylet, the actor's worker) exit
        while not _children() <= before:  # noqa: ASYNC110 - no event to wait on
            await trio.sleep(0.1)


async def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(model: Path) -> None:
    from engine.errors import ConfigError

    before = _children()
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) does not divide by 3") as info:
        async with engine.open_engine(str(model), tensor_parallel_size=3, **OPTIONS):
            pass
    assert info.value.field == "tensor_parallel_size"
    assert _children() <= before


def test_the_two_flags_are_checked() -> None:
    from engine.config import EngineConfig
    from engine.errors import ConfigError

    assert EngineConfig().tensor_parallel_size == 1
    assert EngineConfig().distributed_executor_backend == "mp"
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError) as info:
            EngineConfig(tensor_parallel_size=bad)
        assert info.value.field == "tensor_parallel_size"
    with pytest.raises(ConfigError) as info:
        EngineConfig(distributed_executor_backend="spark")
    assert info.value.field == "distributed_executor_backend"
    # Each data-parallel core has its own workers (test_data_parallel_groups.py); with the
    # cores on Ray, so are the workers.
    assert EngineConfig(tensor_parallel_size=2, data_parallel_size=2).distributed_executor_backend == "mp"
    assert EngineConfig(tensor_parallel_size=2, data_parallel_size=2,
                        data_parallel_backend="ray").distributed_executor_backend == "ray"


@pytest.mark.slow
async def test_smollm2_over_three_ranks_through_serve_gives_the_one_rank_text() -> None:
    """SmolLM2 (9 query heads, 3 KV heads) split over 3 ranks behind ``python -m engine
    serve``, asked through the official client: its GGUF kept in blocks (the default, which
    issue 41 found leaving the one-rank text), each rank reading its slices of the file."""
    from test_http_serve_options import _serve

    from engine.models.loader import default_model_path

    gguf = str(default_model_path())
    flags = dict(dtype="float32", kv_cache_memory=16 * 2**20, max_model_len=256)
    prompt = [1, 504, 3575, 282, 4649, 314, 253]  # token ids: both sides encode nothing
    async with engine.open_engine(gguf, **flags) as eng:
        outputs = await collect(eng, prompt, SamplingParams(temperature=0.0, max_tokens=24))
    want = "".join(out.text for out in outputs)
    assert len(token_ids(outputs)) > 8
    with _serve(gguf, "--port", "0", "--tensor-parallel-size", "3", "--dtype", "float32") as (proc, where, log):
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert sum("engine.process.worker_rank" in " ".join(w.cmdline()) for w in workers) == 2
        with openai.OpenAI(base_url=f"{where}/v1", api_key="x", max_retries=0) as client:
            reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                              max_tokens=24, temperature=0)
        assert reply.choices[0].text == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(log)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)


def test_the_ray_backend_without_ray_installed_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.config import EngineConfig
    from engine.errors import ConfigError
    from engine.process.workers import WorkerGroup

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the [ray] extra were missing
    threads = torch.get_num_threads()
    config = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ConfigError, match=r"install the package's \[ray\] extra") as info:
        WorkerGroup(config, torch.device("cpu"))
    assert info.value.field == "distributed_executor_backend"
    assert torch.get_num_threads() == threads
