"""Decode steps through CUDA graphs (engine/runner/cuda_graphs.py) against eager steps.

On a GPU the runner captures real graphs and replays them; without one the same
persistent-buffer path runs the forward eagerly on the padded buffers, so the padding
rows, the buffer copies and the fallbacks are checked on CPU too.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from greedy_driver import run_greedy
from safetensors.torch import load_file

from engine.cli import build_parser
from engine.cli.args import config_from_args
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.models.testing import write_tiny_model
from engine.ops import get_ops
from engine.runner.cuda_graphs import capture_sizes
from engine.runner.kv_cache import CPU_DEFAULT_BUDGET, default_kv_budget
from engine.runner.model_runner import ModelRunner

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BS = 4
PROMPTS = [[5, 17, 42, 99, 7, 123, 8], [3, 1, 4], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return types.SimpleNamespace(config=config, weights=load_file(str(folder / "model.safetensors")),
                                 dtype=torch.float32)


def _runner(loaded, graphs: bool, max_num_seqs: int = 5) -> ModelRunner:
    runner = ModelRunner(
        loaded, device=DEVICE, ops=get_ops("triton", DEVICE), num_blocks=32, block_size=BS,
        max_num_batched_tokens=64, max_num_seqs=max_num_seqs, decode_graphs=graphs, max_model_len=48)
    runner.warm_up()
    return runner


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    sizes = capture_sizes(300)
    assert sizes[-1] == 300 and all(a < b for a, b in zip(sizes, sizes[1:], strict=False))


def test_replayed_decode_gives_the_eager_tokens_and_logprobs(loaded) -> None:
    eager = run_greedy(_runner(loaded, graphs=False), PROMPTS, 10, block_size=BS)
    runner = _runner(loaded, graphs=True)
    assert runner.graphs is not None
    assert runner.graphs.captured == CUDA  # real graphs on a GPU only
    replays = runner.graphs.replays
    # Three requests: each decode step pads to the captured size 4 (a padding row that
    # wrote its K/V anywhere, or read any, would change the others' tokens).
    got = run_greedy(runner, PROMPTS, 10, block_size=BS)
    assert runner.graphs.replays - replays == 9  # every decode step; the prefill ran eagerly
    assert [[s.token_id for s in r] for r in got] == [[s.token_id for s in r] for r in eager]
    for a, b in zip(got, eager, strict=True):
        # The split of the attention's context is fixed at capture (max_model_len), so
        # the sums run in other slices: equal to rounding.
        assert [s.logprob for s in a] == pytest.approx([s.logprob for s in b], abs=1e-4)


def test_a_batch_above_the_largest_size_runs_eagerly(loaded) -> None:
    eager = run_greedy(_runner(loaded, graphs=False), PROMPTS, 4, block_size=BS)
    runner = _runner(loaded, graphs=True, max_num_seqs=2)
    runner.max_num_seqs = runner._batch.max_num_seqs = 3  # three rows, graphs up to two
    replays = runner.graphs.replays
    got = run_greedy(runner, PROMPTS, 4, block_size=BS)
    assert runner.graphs.replays == replays
    assert [[s.token_id for s in r] for r in got] == [[s.token_id for s in r] for r in eager]


def test_graphs_stay_off_where_a_step_cannot_replay(loaded) -> None:
    runner = ModelRunner(loaded, device="cpu", ops=get_ops("torch"), num_blocks=32, block_size=BS,
                         max_num_batched_tokens=64, max_num_seqs=4, decode_graphs=True)
    assert runner.graphs is None  # the reference kernels read host-side lengths


def test_enforce_eager_and_gpu_memory_utilization_are_engine_flags() -> None:
    argv = ["serve", "--enforce-eager", "--gpu-memory-utilization", "0.5"]
    config = config_from_args(build_parser(argv).parse_args(argv))
    assert (config.enforce_eager, config.gpu_memory_utilization) == (True, 0.5)
    assert (EngineConfig().enforce_eager, EngineConfig().kv_cache_memory) == (False, None)
    with pytest.raises(ConfigError) as info:
        EngineConfig(gpu_memory_utilization=1.5)
    assert info.value.field == "gpu_memory_utilization"


def test_the_default_kv_budget_is_fixed_on_cpu_and_a_share_of_the_device_on_cuda(loaded) -> None:
    budget = default_kv_budget(loaded.config, DEVICE, gpu_memory_utilization=0.9,
                               max_num_batched_tokens=2048, max_num_seqs=64)
    if not CUDA:
        assert budget == CPU_DEFAULT_BUDGET
        return
    free, total = torch.cuda.mem_get_info()
    assert 0 < budget < 0.9 * total - (total - free)
    with pytest.raises(ConfigError):
        default_kv_budget(loaded.config, DEVICE, gpu_memory_utilization=(total - free) / total / 2,
                          max_num_batched_tokens=2048, max_num_seqs=64)
