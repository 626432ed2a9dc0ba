"""Pipeline parallelism's processes (engine/process/pipeline.py, issue 39): the stages as
worker processes behind the engine, several batches in flight, a stage killed or stopped
mid-stream, and what is refused.

The oracle of every output is the same engine at one rank (itself checked against
transformers in test_parity.py): the staged model must give the one-rank greedy tokens,
logprobs within fp32's reach, and for a seeded sampler the same draws."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from engine_helpers import collect, greedy, token_ids, wait_idle, wait_until
from test_tensor_parallel_workers import CASES, PROMPTS, _children, _same

import engine
from engine.errors import ConfigError, EngineDeadError

OPTIONS: dict[str, Any] = dict(dtype="float32", kv_cache_memory=2**22, max_num_seqs=16)
LAYERS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.models.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("pp-tiny"), "qwen3",
                            overrides={"num_hidden_layers": LAYERS})


async def _outputs(eng: Any) -> dict[tuple[str, int], Any]:
    """Every case on every prompt, all in flight at once, then the first prompt again (its
    leading blocks from the prefix cache)."""
    out: dict[tuple[str, int], Any] = {}

    async def one(name: str, i: int, params: Any) -> None:
        out[name, i] = await collect(eng, PROMPTS[i], params)

    async with trio.open_nursery() as nursery:
        for name, params in CASES:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, name, i, params)
    before = eng.statistics().prefix_cache_hits
    out["again", 0] = await collect(eng, PROMPTS[0], greedy(20))
    assert eng.statistics().prefix_cache_hits > before
    return out


async def test_two_stages_give_the_one_rank_outputs_with_batches_in_flight(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = await _outputs(eng)
    async with engine.open_engine(str(model), pipeline_parallel_size=2, **OPTIONS) as eng:
        runner = eng._parts.runner
        (pid,) = runner.worker_pids()
        assert psutil.Process(pid).ppid() == os.getpid()
        # Rank 0 is stage 0: half the layers, their KV pool, the embedding and no head.
        assert len(runner.model.layers) == len(runner.kv_caches) == LAYERS // 2
        assert runner.model.lm_head is None and runner.model.embed is not None
        got = await _outputs(eng)
        await wait_idle(eng)  # every KV block came back
        # Steps were handed to the pipeline while another was in flight (the batch queue).
        assert eng.statistics().planned_ahead > 0
        # Every step went through both stages. The last stage's trace entry comes back with
        # its results on the collecting thread, so it may land just after the engine is idle.
        def stages(rank: int) -> set[int]:
            return {s for s, r, *_ in list(runner.trace) if r == rank}

        await wait_until(lambda: stages(1) == stages(0))
        assert stages(1)
    for key, outputs in want.items():
        assert _same(got[key], outputs), key
    assert not psutil.pid_exists(pid)


async def test_two_stages_behind_an_engine_core_process_keep_batches_in_flight(model: Path) -> None:
    # Regression: a core in its own process scheduled one batch at a time whatever its
    # pipeline, so a stage always waited for the other.
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = await _outputs(eng)
    async with engine.open_engine(str(model), pipeline_parallel_size=2, engine_core="process",
                                  **OPTIONS) as eng:
        got = await _outputs(eng)
        await wait_idle(eng)
        assert eng.statistics().planned_ahead > 0
    for key, outputs in want.items():
        assert _same(got[key], outputs), key


async def test_two_by_two_ranks_give_the_one_rank_tokens(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = [token_ids(await collect(eng, p, greedy(16))) for p in PROMPTS]
    async with engine.open_engine(str(model), pipeline_parallel_size=2, tensor_parallel_size=2,
                                  **OPTIONS) as eng:
        assert len(eng._parts.runner.worker_pids()) == 3
        assert eng._parts.runner.rank0.tp.world_size == 2
        got = []
        for p in PROMPTS:
            got.append(token_ids(await collect(eng, p, greedy(16))))
    assert got == want


async def test_preemption_and_abort_under_the_batch_queue(model: Path) -> None:
    """A pool too small for the requests in flight preempts (recomputed from the start,
    while their last step may still be in a later stage) and the tokens stay one rank's;
    a stream closed early is aborted, and every block comes back."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(20 + i)] for i in range(8)]

    async def run(eng: Any) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            out[i] = token_ids(await collect(eng, prompts[i], greedy(40)))

        async def aborted() -> None:
            async for _ in eng.generate(prompts[0], greedy(100)):
                break  # closing the stream aborts the request

        async with trio.open_nursery() as nursery:
            nursery.start_soon(aborted)
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return out

    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = await run(eng)
        assert eng.statistics().preemptions == 0
    # 10 blocks of 16 tokens (16 KiB each on a 2-layer stage) for 8 requests of ~60 tokens.
    async with engine.open_engine(str(model), pipeline_parallel_size=2,
                                  **{**OPTIONS, "kv_cache_memory": 10 * 16384}) as eng:
        assert eng.statistics().kv_blocks_total == 10
        got = await run(eng)
        assert eng.statistics().preemptions > 0
        await wait_idle(eng)
    assert got == want


async def test_stages_placed_by_ray_give_the_one_rank_tokens(model: Path) -> None:
    ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
    import tempfile

    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = [token_ids(await collect(eng, p, greedy(12))) for p in PROMPTS[:2]]
    env_address = os.environ.pop("RAY_ADDRESS", None)
    root = tempfile.mkdtemp(prefix="rt-")  # short: Ray's socket paths must fit 107 bytes
    try:
        async with engine.open_engine(str(model), pipeline_parallel_size=2, runtime_dir=root,
                                      distributed_executor_backend="ray", **OPTIONS) as eng:
            assert ray.util.placement_group_table(eng._parts.runner.group._placement)["bundles"] \
                == {0: {"CPU": 1.0}}  # stage 1; stage 0 is rank 0, in the engine
            got = [token_ids(await collect(eng, p, greedy(12))) for p in PROMPTS[:2]]
    finally:
        if env_address is not None:
            os.environ["RAY_ADDRESS"] = env_address
    assert got == want
    assert not ray.is_initialized()


async def _fail_mid_stream(eng: Any, sig: signal.Signals) -> tuple[int, str]:
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
        while not eng.serving:  # noqa: ASYNC110 - the group restarts (a new stage loads)
            await trio.sleep(0.05)
    assert not psutil.pid_exists(victim)
    return victim, str(info.value)


async def test_a_stage_killed_or_stopped_mid_stream_fails_its_stream_naming_the_stage(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.process.workers as workers

    monkeypatch.setattr(workers, "COLLECTIVE_TIMEOUT_SECONDS", 3.0)
    before = _children()
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = token_ids(await collect(eng, PROMPTS[1], greedy(8)))
    async with engine.open_engine(str(model), pipeline_parallel_size=2, max_engine_restarts=2,
                                  **OPTIONS) as eng:
        victim, error = await _fail_mid_stream(eng, signal.SIGKILL)
        assert f"pipeline stage 1 (rank 1) (pid {victim}) died (killed by signal 9)" in error
        assert token_ids(await collect(eng, PROMPTS[1], greedy(8))) == want
        stopped, error = await _fail_mid_stream(eng, signal.SIGSTOP)
        assert stopped != victim
        assert "pipeline stage 1 (rank 1) did not answer within" in error
        assert token_ids(await collect(eng, PROMPTS[1], greedy(8))) == want
        (replacement,) = eng._parts.runner.worker_pids()
        assert eng.restarts == 2
    assert not psutil.pid_exists(replacement)
    assert _children() <= before


async def test_what_pipeline_parallelism_cannot_run_is_refused_before_any_worker_starts(model: Path) -> None:
    before = _children()
    with pytest.raises(ConfigError, match="cannot be split into 5 pipeline stages") as info:
        async with engine.open_engine(str(model), pipeline_parallel_size=5, **OPTIONS):
            pass
    assert info.value.field == "pipeline_parallel_size"
    with pytest.raises(ConfigError, match="speculative decoding") as info:
        async with engine.open_engine(str(model), pipeline_parallel_size=2, **OPTIONS,
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 2}):
            pass
    assert _children() <= before


def test_the_flags_are_checked() -> None:
    from engine.config import EngineConfig

    assert EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition="3, 1").pipeline_layer_partition == (3, 1)
    assert EngineConfig.from_json(EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition="3,1")
                                  .to_json()).pipeline_layer_partition == (3, 1)
    for bad in (dict(pipeline_parallel_size=0), dict(pipeline_parallel_size=2, pipeline_layer_partition="4"),
                dict(pipeline_parallel_size=2, pipeline_layer_partition="a,b")):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)


@pytest.mark.slow
async def test_smollm2_in_two_stages_through_serve_gives_the_one_rank_text() -> None:
    """SmolLM2 (30 layers: 15 a stage) in two stages behind ``python -m engine serve``, asked
    through the official client: its GGUF kept in blocks, each stage reading its layers."""
    import openai
    from test_http_serve_options import _serve

    from engine.models.loader import default_model_path
    from engine.params import SamplingParams

    gguf = str(default_model_path())
    flags = dict(dtype="float32", kv_cache_memory=16 * 2**20, max_model_len=256)
    prompt = [1, 504, 3575, 282, 4649, 314, 253]  # token ids: both sides encode nothing
    async with engine.open_engine(gguf, **flags) as eng:
        outputs = await collect(eng, prompt, SamplingParams(temperature=0.0, max_tokens=24))
    want = "".join(out.text for out in outputs)
    assert len(token_ids(outputs)) > 8
    with _serve(gguf, "--port", "0", "-pp", "2", "--dtype", "float32") as (proc, where, log):
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert sum("engine.process.worker_rank" in " ".join(w.cmdline()) for w in workers) == 1
        with openai.OpenAI(base_url=f"{where}/v1", api_key="x", max_retries=0) as client:
            reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                              max_tokens=24, temperature=0)
        assert reply.choices[0].text == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(log)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
