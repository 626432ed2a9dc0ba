"""vLLM's profiler: ``--profiler-config`` (and ``VLLM_TORCH_PROFILER_DIR``),
``POST /start_profile`` / ``/stop_profile``, ``LLM.start_profile`` / ``stop_profile`` and
the embedded API's, in one process, a core process and two data-parallel cores.

The traces are read as torch writes them (gzipped Chrome trace JSON): each holds one
``engine step`` range for every step its core ran between the start and the stop, counted
by the engine's own step counter, with the model's torch ops under them; the tokens are
those of an untraced run."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import collect, greedy, token_ids
from http_server import ServerThread

import engine
from engine import LLM, SamplingParams
from engine.api.offline import engine_options
from engine.cli.args import add_engine_arguments, config_from_args
from engine.config import EngineConfig, parse_profiler_config
from engine.errors import ConfigError
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [(5 * i + 7) % 200 + 3 for i in range(20)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("profiler") / "llama", "llama")


def torch_profiler(folder: Path, **extra: Any) -> dict[str, Any]:
    # Python stacks off: torch's Python tracer hooks every thread of the process, and its
    # stop raced a call on the server's event loop thread once (a SIGFPE inside torch,
    # session 21's fresh-clone run). No test here reads the stacks.
    return {"profiler": "torch", "torch_profiler_dir": str(folder), "torch_profiler_with_stack": False,
            **extra}


def files(folder: Path) -> list[Path]:
    return sorted(folder.iterdir())


def trace_events(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def step_ranges(events: list[dict[str, Any]]) -> list[str]:
    return [e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("engine step")]


LAYOUTS = {"in-process": {}, "process": {"engine_core": "process"},
           "two-cores": {"engine_core": "process", "data_parallel_size": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llm_traces_every_step_between_start_and_stop(folder: Path, tmp_path: Path, layout: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[::-1]}]
    with LLM(str(folder), profiler_config=torch_profiler(tmp_path), **LAYOUTS[layout]) as llm:
        untraced = llm.generate(prompts, params, use_tqdm=False)
        before = llm.statistics().steps
        llm.start_profile()
        traced = llm.generate(prompts, params, use_tqdm=False)
        traces = llm.stop_profile()
        steps = llm.statistics().steps - before
    assert [o.outputs[0].token_ids for o in traced] == [o.outputs[0].token_ids for o in untraced]
    cores = 2 if layout == "two-cores" else 1
    assert len(traces) == cores and all(Path(p).parent == tmp_path for p in traces)
    assert sorted(Path(p).name.split(".")[0] for p in traces) == (
        ["engine"] if layout == "in-process" else [f"engine-core{i}" for i in range(cores)])
    events = [trace_events(p) for p in traces]
    assert sum(len(step_ranges(e)) for e in events) == steps > 0
    # The model's torch ops ran on the traced thread, under the step ranges.
    assert all(any(e["name"].startswith("aten::") for e in core) for core in events if step_ranges(core))


async def test_delay_and_max_iterations_bound_the_traced_steps(folder: Path, tmp_path: Path) -> None:
    config = torch_profiler(tmp_path, delay_iterations=1, max_iterations=3, torch_profiler_use_gzip=False)
    async with engine.open_engine(model=str(folder), profiler_config=config) as eng:
        await eng.start_profile()
        await collect(eng, PROMPT, greedy(12))  # 12 steps: a prefill and 11 decodes
        (path,) = files(tmp_path)  # the third traced step ended the trace
        assert path.name.endswith(".pt.trace.json")
        assert await eng.stop_profile() == [str(path)]
    # The prefill (20 tokens) passed untraced; decodes 2 to 4 traced, numbered from 1.
    assert step_ranges(trace_events(str(path))) == [f"engine step {i}: 1 tokens" for i in (1, 2, 3)]


async def test_a_trace_running_when_the_engine_closes_is_written(folder: Path, tmp_path: Path) -> None:
    async with engine.open_engine(model=str(folder), profiler_config=torch_profiler(tmp_path)) as eng:
        await eng.start_profile()
        await eng.start_profile()  # a second start changes nothing
        outputs = await collect(eng, PROMPT, greedy(4))
    (path,) = files(tmp_path)
    computed = [n for n in step_ranges(trace_events(str(path))) if not n.endswith(" 0 tokens")]
    assert len(computed) == 4 == len(token_ids(outputs))  # (a step may only drop finished requests)
    # The model thread outlives the engine: the next one runs untraced, and its stop
    # without a start writes nothing.
    async with engine.open_engine(model=str(folder), profiler_config=torch_profiler(tmp_path)) as eng:
        await collect(eng, PROMPT, greedy(4))
        assert await eng.stop_profile() == []
    assert files(tmp_path) == [path]


async def test_without_a_profiler_the_calls_are_refused(folder: Path) -> None:
    async with engine.open_engine(model=str(folder)) as eng:
        with pytest.raises(ConfigError, match="profiler_config"):
            await eng.start_profile()
        with pytest.raises(ConfigError, match="profiler_config"):
            await eng.stop_profile()


def test_the_routes_trace_and_exist_only_with_a_profiler(folder: Path, tmp_path: Path) -> None:
    def opened(**options: Any) -> Any:
        return lambda: engine.open_engine(model=str(folder), **options)

    with ServerThread(opened(profiler_config=torch_profiler(tmp_path)), api_key="k") as server:
        url, auth = server.base_url, {"Authorization": "Bearer k"}
        assert httpx.post(f"{url}/start_profile", timeout=60).status_code == 401
        started = httpx.post(f"{url}/start_profile", headers=auth, timeout=60)
        assert (started.status_code, started.content) == (200, b"")
        body = {"model": server.engine.model_name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60).raise_for_status()
        stopped = httpx.post(f"{url}/stop_profile", headers=auth, timeout=60)
        assert (stopped.status_code, stopped.content) == (200, b"")
    (path,) = files(tmp_path)
    assert len([n for n in step_ranges(trace_events(str(path))) if not n.endswith(" 0 tokens")]) == 3
    with ServerThread(opened()) as server:  # as vLLM: no profiler, no routes
        assert httpx.post(f"{server.base_url}/start_profile", timeout=60).status_code == 404


def test_the_configuration_is_vllms_json_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = parse_profiler_config('{"profiler": "torch", "torch_profiler_dir": "traces"}')
    assert spec is not None and spec.torch_profiler_dir == str(tmp_path / "traces")
    assert (spec.torch_profiler_with_stack, spec.torch_profiler_use_gzip, spec.max_iterations) == (True, True, 0)
    assert parse_profiler_config({}) is None
    for bad, word in (({"profiler": "torch"}, "torch_profiler_dir must be set"),
                      ({"profiler": "nsys"}, "profiler must be"),
                      ({"profiler": "torch", "torch_profiler_dir": "gs://b/t"}, "local folder"),
                      ({"profiler": "torch", "torch_profiler_dir": "t", "wait_iterations": 2}, "wait_iterations"),
                      ({"profiler": "torch", "torch_profiler_dir": "t", "colour": 1}, "colour"),
                      ({"profiler": "torch", "torch_profiler_dir": "t", "max_iterations": -1}, "max_iterations"),
                      ({"profiler": "cuda", "torch_profiler_dir": "t"}, "only read with profiler 'torch'")):
        with pytest.raises(ConfigError, match=word):
            parse_profiler_config(bad)
    with pytest.raises(ConfigError, match="tensor- or pipeline-parallel"):
        EngineConfig(profiler_config=torch_profiler(tmp_path), tensor_parallel_size=2)
    # The command line's flag, and vLLM's older variable at the edges (serve and LLM).
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flag = config_from_args(parser.parse_args(["--profiler-config", json.dumps(torch_profiler(tmp_path))]))
    assert flag.profiler == spec.__class__(profiler="torch", torch_profiler_dir=str(tmp_path),
                                           torch_profiler_with_stack=False)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "old")
    from_env = config_from_args(parser.parse_args([])).profiler
    assert from_env is not None and from_env.torch_profiler_dir == str(tmp_path / "old")
    assert config_from_args(parser.parse_args(["--profiler-config", "{}"])).profiler is None
    assert json.loads(engine_options(None, {})["profiler_config"])["torch_profiler_dir"] == "old"


async def test_the_cuda_profiler_needs_a_cuda_device(folder: Path) -> None:
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        async with engine.open_engine(model=str(folder), device="cpu",
                                      profiler_config={"profiler": "cuda"}):
            pass
