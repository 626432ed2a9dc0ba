"""The model runner's step contract and KV pool sizing, on a tiny llama."""

from __future__ import annotations

import json
import types

import pytest
import torch
from greedy_driver import generate_greedy
from safetensors.torch import load_file

from engine.errors import ConfigError
from engine.messages import NewRequest, RequestFailure, ScheduledChunk, StepPlan
from engine.models.config import ModelConfig
from engine.models.testing import write_tiny_model
from engine.ops import get_ops
from engine.params import SamplingParams
from engine.runner.kv_cache import allocate_kv_caches, bytes_per_block, num_kv_blocks
from engine.runner.model_runner import STEP_FAILED, ModelRunner

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPT = (5, 17, 42, 99, 7, 123, 8)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return types.SimpleNamespace(
        config=config, weights=load_file(str(folder / "model.safetensors")), dtype=torch.float32
    )


def _runner(loaded) -> ModelRunner:
    return ModelRunner(
        loaded, device="cpu", ops=get_ops("torch"), num_blocks=64, block_size=BS,
        max_num_batched_tokens=64, max_num_seqs=4,
    )


def test_partial_prefill_chunk_samples_nothing(loaded) -> None:
    runner = _runner(loaded)
    new = NewRequest("a", PROMPT, GREEDY, ())
    result = runner.execute(StepPlan(0, (new,), (ScheduledChunk("a", 0, 3, (0, 1, 2), False),), ()))
    assert result.sampled == ()
    result = runner.execute(StepPlan(1, (), (ScheduledChunk("a", 3, 4, (0, 1, 2), True),), ()))
    assert [s.sample_id for s in result.sampled] == ["a"]


def test_recompute_after_preemption_continues_the_same_tokens(loaded) -> None:
    want = generate_greedy(_runner(loaded), [list(PROMPT)], 6, block_size=BS)[0]
    runner = _runner(loaded)
    new = NewRequest("a", PROMPT, GREEDY, ())
    first = runner.execute(StepPlan(0, (new,), (ScheduledChunk("a", 0, 7, (0, 1, 2), True),), ()))
    second = runner.execute(StepPlan(1, (), (ScheduledChunk("a", 7, 1, (0, 1, 2), True),), ()))
    # Preempted: its blocks went to someone else (overwrite them), then it is recomputed
    # from position 0 into different blocks out of its stored 9 tokens.
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    got = [first.sampled[0].token_id, second.sampled[0].token_id]
    step = 2
    result = runner.execute(StepPlan(step, (), (ScheduledChunk("a", 0, 9, (9, 8, 7), True),), ()))
    got.append(result.sampled[0].token_id)
    while len(got) < 6:
        step += 1
        pos = len(PROMPT) + len(got) - 1
        result = runner.execute(StepPlan(step, (), (ScheduledChunk("a", pos, 1, (9, 8, 7), True),), ()))
        got.append(result.sampled[0].token_id)
    assert got == want


def test_prompt_logprobs_come_once_per_prompt_token_across_chunks_and_recompute(loaded) -> None:
    scored = GREEDY.replace(prompt_logprobs=1)
    runner = _runner(loaded)
    new = NewRequest("a", PROMPT, scored, ())
    # Chunks [0, 3) and [3, 7): position p scores prompt token p + 1, the last position
    # samples instead; so 1..3, then 4..6.
    first = runner.execute(StepPlan(0, (new,), (ScheduledChunk("a", 0, 3, (0, 1), False),), ()))
    second = runner.execute(StepPlan(1, (), (ScheduledChunk("a", 3, 4, (0, 1), True),), ()))
    assert [(p.start, [e.token_id for e in p.logprobs]) for p in first.prompt_logprobs] == [(1, [17, 42, 99])]
    assert [(p.start, [e.token_id for e in p.logprobs]) for p in second.prompt_logprobs] == [(4, [7, 123, 8])]
    # Recomputed from position 0 after a preemption: nothing is scored twice.
    again = runner.execute(StepPlan(2, (), (ScheduledChunk("a", 0, 8, (4, 5), True),), ()))
    assert again.prompt_logprobs == ()
    # A request that did not ask scores nothing.
    plain = _runner(loaded).execute(
        StepPlan(0, (NewRequest("b", PROMPT, GREEDY, ()),), (ScheduledChunk("b", 0, 7, (0, 1), True),), ())
    )
    assert plain.prompt_logprobs == ()


def test_finished_requests_are_forgotten(loaded, caplog) -> None:
    runner = _runner(loaded)
    new = NewRequest("a", PROMPT, GREEDY, ())
    runner.execute(StepPlan(0, (new,), (ScheduledChunk("a", 0, 7, (0, 1), True),), ()))
    runner.execute(StepPlan(1, (), (), ("a",)))
    assert runner.num_requests == 0
    result = runner.execute(StepPlan(2, (), (ScheduledChunk("a", 7, 1, (0, 1), True),), ()))
    assert result.failed == (RequestFailure("a", STEP_FAILED),)
    assert "unknown request" in caplog.text


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (ScheduledChunk("a", 5, 5, (0, 1, 2), False), "outside its 7 known tokens"),
        (ScheduledChunk("a", 0, 5, (0, 1), True), "sampling after token 5"),
        (ScheduledChunk("a", 0, 7, (0,), True), "cannot hold 7 tokens"),
    ],
)
def test_inconsistent_chunks_fail_the_step_not_the_runner(loaded, caplog, chunk, message) -> None:
    # A plan the runner cannot execute is a bug (StepPlanError); it fails the step's
    # requests, is logged with its cause, and the client sees no internal text.
    runner = _runner(loaded)
    result = runner.execute(StepPlan(0, (NewRequest("a", PROMPT, GREEDY, ()),), (chunk,), ()))
    assert result.sampled == ()
    assert result.failed == (RequestFailure("a", STEP_FAILED),)
    assert message in caplog.text and "StepPlanError" in caplog.text
    assert runner.num_requests == 0


def test_a_step_that_raises_fails_only_that_steps_requests(loaded, monkeypatch) -> None:
    runner = _runner(loaded)
    news = tuple(NewRequest(r, PROMPT, GREEDY, ()) for r in "abc")
    runner.execute(StepPlan(0, news, (ScheduledChunk("c", 0, 7, (4, 5), True),), ()))
    forward = runner.model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(runner.model, "forward", broken)
    plan = StepPlan(1, (), (ScheduledChunk("a", 0, 7, (0, 1), True), ScheduledChunk("b", 0, 7, (2, 3), True)), ())
    result = runner.execute(plan)
    assert {f.sample_id for f in result.failed} == {"a", "b"}
    assert all("injected" not in f.reason for f in result.failed)
    monkeypatch.setattr(runner.model, "forward", forward)
    # A chunk planned for a failed request before the failure was known (async
    # scheduling) is skipped; "c", which was not in the step, goes on.
    result = runner.execute(
        StepPlan(2, (), (ScheduledChunk("a", 7, 1, (0, 1), True), ScheduledChunk("c", 7, 1, (4, 5), True)), ())
    )
    assert [s.sample_id for s in result.sampled] == ["c"] and result.failed == ()
    runner.execute(StepPlan(3, (), (), ("a", "b", "c")))
    assert runner.num_requests == 0


def test_an_unsamplable_row_fails_only_its_request(loaded) -> None:
    # Regression: stop_token_ids listing the whole vocabulary with min_tokens=1 masked
    # every token and the sampler returned the vocabulary size, which crashed the engine.
    runner = _runner(loaded)
    vocab = loaded.config.vocab_size
    everything = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=1,
                                stop_token_ids=list(range(vocab)))
    news = (NewRequest("bad", PROMPT, everything, ()), NewRequest("ok", PROMPT, GREEDY, ()))
    chunks = (ScheduledChunk("bad", 0, 7, (0, 1), True), ScheduledChunk("ok", 0, 7, (2, 3), True))
    result = runner.execute(StepPlan(0, news, chunks, ()))
    assert [f.sample_id for f in result.failed] == ["bad"]
    assert "every token is masked" in result.failed[0].reason
    assert [s.sample_id for s in result.sampled] == ["ok"]
    assert 0 <= result.sampled[0].token_id < vocab


def test_kv_pool_sizing(loaded) -> None:
    config = loaded.config
    # 2 (K and V) x 2 layers x 4 tokens x 2 kv heads x 16 dims x 4 bytes
    assert bytes_per_block(config, torch.float32, 4) == 2 * 2 * 4 * 2 * 16 * 4
    per_block = bytes_per_block(config, torch.bfloat16, 16)
    assert num_kv_blocks(config, torch.bfloat16, 16, 100 * per_block + 5, "cpu") == 100
    assert num_kv_blocks(config, torch.float32, 16, 0.001, "cpu") >= 1
    caches = allocate_kv_caches(config, 3, 16, torch.bfloat16, "cpu")
    assert len(caches) == config.num_hidden_layers
    assert caches[0][0].shape == (3, 16, config.num_key_value_heads, config.head_dim)


def test_kv_pool_too_small_for_one_request_is_rejected(loaded) -> None:
    # max_position_embeddings 512 at block size 16 needs 32 blocks.
    per_block = bytes_per_block(loaded.config, torch.float32, 16)
    with pytest.raises(ConfigError) as info:
        num_kv_blocks(loaded.config, torch.float32, 16, 31 * per_block, "cpu")
    assert info.value.field == "kv_cache_memory"


def test_warm_up_leaves_no_request_and_changes_no_later_output(loaded) -> None:
    cold = generate_greedy(_runner(loaded), [list(PROMPT)], 6, block_size=BS)
    runner = _runner(loaded)
    runner.warm_up()
    assert runner.num_requests == 0
    assert generate_greedy(runner, [list(PROMPT)], 6, block_size=BS) == cold


def test_a_failing_warm_up_raises_instead_of_spinning(loaded, monkeypatch) -> None:
    # Regression: once execute() turned step faults into failed requests, run_greedy (the
    # warm-up) looped forever on a step that kept failing (a stale C kernel build).
    from engine.runner.model_runner import StepFailedError

    runner = _runner(loaded)

    def broken(*args, **kwargs):
        raise TypeError("eng_paged_decode expected 17 arguments, got 19")

    monkeypatch.setattr(runner.model, "forward", broken)
    with pytest.raises(StepFailedError, match="warm-up step 0 failed"):
        runner.warm_up()
    assert runner.num_requests == 0


@pytest.mark.parametrize("seed", range(4))
def test_small_cpu_batches_built_on_lists_equal_the_tensor_path(monkeypatch, seed: int) -> None:
    from engine.runner import batch

    rng = torch.Generator().manual_seed(seed)
    spans = []
    for _ in range(int(torch.randint(1, 5, (1,), generator=rng))):
        start = int(torch.randint(0, 40, (1,), generator=rng))
        n = int(torch.randint(1, 6, (1,), generator=rng))
        blocks = -(-(start + n) // 8)
        table = torch.randperm(32, generator=rng)[:blocks].tolist()
        spans.append((start, torch.randint(0, 100, (n,), generator=rng).tolist(), table))
    small = batch.build_batch(spans, 8, torch.device("cpu"))
    monkeypatch.setattr(batch, "_HOST_BATCH_TOKENS", 0)
    tensor = batch.build_batch(spans, 8, torch.device("cpu"))
    for got, want in zip(small[:2], tensor[:2], strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        got, want = getattr(small[2], field), getattr(tensor[2], field)
        assert got.dtype == want.dtype and torch.equal(got, want), field
    for field in ("max_query_len", "max_seq_len", "query_lens_host", "seq_lens_host"):
        assert getattr(small[2], field) == getattr(tensor[2], field)


def test_a_runners_reused_host_tensors_hold_each_steps_values() -> None:
    # The runner's HostBatch writes each small step into the same buffers (views cached per
    # shape): every step's tensors equal a fresh build's, across shapes and back again.
    from engine.runner import batch

    host = batch.HostBatch()
    steps = [
        [(5, [7], [3])],
        [(6, [9], [3])],  # same shape: the cached views, new values
        [(16, [1, 2], [3, 4]), (0, [5], [8])],
        [(7, [4], [3])],
    ]
    for spans in steps:
        got = batch.build_batch(spans, 16, torch.device("cpu"), host)
        want = batch.build_batch(spans, 16, torch.device("cpu"))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            a, b = getattr(got[2], field), getattr(want[2], field)
            assert a.dtype == b.dtype and torch.equal(a, b), field
