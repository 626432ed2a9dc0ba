"""Speculative decoding with a draft model (``draft_model``): the output is the target
model's, greedy token for token and sampled in distribution, whatever the draft proposes;
the draft's KV cache follows the target's block tables, so no block is left behind."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import collect, greedy, text, token_ids, wait_idle

import engine
from engine.errors import ConfigError
from engine.params import SamplingParams
from engine.structured.spec import StructuredOutputs

# Tiny shapes: a second torch thread only adds waits on a shared machine.
pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, block_size=16,
    kv_cache_memory=8 * 1024 * 1024,
)


def _draft(path: Path, k: int = 4) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The target, and a draft: the target's weights with noise added (same vocabulary and
    shapes, a distribution close to the target's but not equal: some proposals accepted,
    some not)."""
    from engine.models.testing import write_tiny_model

    target = write_tiny_model(tmp_path_factory.mktemp("target"), "llama")
    return target, _perturbed(target, tmp_path_factory.mktemp("draft"), std=0.03)


def _perturbed(folder: Path, dest: Path, *, std: float) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        shutil.copy(f, dest / f.name)
    gen = torch.Generator().manual_seed(1)
    weights = load_file(str(folder / "model.safetensors"))
    noisy = {k: v + torch.randn(v.shape, generator=gen) * std for k, v in weights.items()}
    save_file(noisy, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _sharpened(folder: Path, dest: Path, *, factor: float) -> Path:
    """The model with its final norm's weight times ``factor``: its logits are the target's
    times ``factor`` (tied embeddings), so its distribution at temperature ``T`` is the
    target's at ``T / factor``: the same ranking and top-k set, another shape."""
    from safetensors.torch import load_file, save_file

    _perturbed(folder, dest, std=0.0)
    weights = load_file(str(dest / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * factor
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Random prompts of lengths that cross block edges and, at 64 tokens a step, chunk."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(4, 90))] for _ in range(count)]


async def _run_all(eng: Any, prompts: list[Any], params: list[SamplingParams]) -> list[list[Any]]:
    results: list[list[Any]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        results[i] = await collect(eng, prompts[i], params[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


def _logprobs(outputs: list[Any]) -> list[tuple[int, float]]:
    return [(t.token_id, round(t.logprob, 3)) for o in outputs if o.logprobs for t in o.logprobs]


async def test_greedy_output_is_the_target_alone_s(models: tuple[Path, Path]) -> None:
    """128 greedy tokens on several prompts (chunked prefills, a mixed batch: logprobs,
    penalties with min_tokens, a sampled request that also speculates) are the plain
    engine's. The target as its own draft is accepted every time; a different draft is
    not, and changes nothing of the output."""
    target, noisy = models
    prompts = _prompts(4, seed=3)
    params = [greedy(128, logprobs=2), greedy(128, repetition_penalty=1.3, frequency_penalty=0.5,
                                               min_tokens=40),
              greedy(128), SamplingParams(temperature=0.8, seed=7, max_tokens=64, ignore_eos=True)]
    async with engine.open_engine(str(target), **OPTIONS) as eng:
        plain = await _run_all(eng, prompts, params)
    for draft in (target, noisy):
        async with engine.open_engine(str(target), **OPTIONS, speculative_config=_draft(draft)) as eng:
            spec = await _run_all(eng, prompts, params)
            stats = await wait_idle(eng)
        for a, b in list(zip(plain, spec, strict=True))[:3]:
            assert token_ids(b) == token_ids(a)
            assert _logprobs(b) == _logprobs(a)
        assert len(token_ids(spec[3])) == 64
        assert stats.spec_drafts > 0 and sum(stats.spec_accepted_per_pos) == stats.spec_accepted_tokens
        rate = stats.spec_accepted_tokens / stats.spec_draft_tokens
        if draft is target:
            # The sampled request too: its draft's q equals the target's p, so p/q = 1.
            assert rate == 1.0, stats
        else:
            assert 0.0 < rate < 1.0, stats
        assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_async_scheduling_n_samples_and_stop_tokens_with_a_draft(models: tuple[Path, Path]) -> None:
    """Async scheduling (speculating requests are not planned ahead, the others are), n > 1
    seeded samples beside them, a grammar request (the draft proposes unconstrained; the
    part its grammar takes is verified), a stop token cut inside an accepted proposal and a
    stop string. A seeded
    request's tokens depend on its seed and on the steps it speculated in (the rule's
    uniforms are drawn per output index): the same request alone in two fresh engines
    gives the same tokens."""
    target, noisy = models
    prompts = _prompts(3, seed=5)
    async with engine.open_engine(str(target), **OPTIONS) as eng:
        plain = await _run_all(eng, prompts, [greedy(48)] * 3)
    stop_id = token_ids(plain[0])[20]
    whole = text(plain[1])
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    assert stop.strip()
    seeded = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=24,
                                 structured_outputs=StructuredOutputs(regex="(ab|cd){3,6}"))
    async with engine.open_engine(str(target), **OPTIONS, speculative_config=_draft(noisy, 3),
                                  async_scheduling=True) as eng:
        spec = await _run_all(eng, [*prompts, prompts[0], prompts[1], prompts[2], prompts[1]],
                              [*[greedy(48)] * 3, greedy(48, stop_token_ids=[stop_id]), seeded,
                               constrained, greedy(48, stop=[stop])])
        stats = await wait_idle(eng)
    assert re.fullmatch("(ab|cd){3,6}", text(spec[5])), text(spec[5])
    assert [token_ids(o) for o in spec[:3]] == [token_ids(o) for o in plain]
    ids = token_ids(plain[0])
    assert token_ids(spec[3]) == ids[: ids.index(stop_id) + 1]
    assert text(spec[6]) == whole[: whole.index(stop)]
    assert [len(token_ids(spec[4], i)) for i in range(3)] == [24] * 3
    assert stats.spec_drafts > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    alone = []
    for _ in range(2):
        async with engine.open_engine(str(target), **OPTIONS, speculative_config=_draft(noisy, 3)) as eng:
            alone.append(await collect(eng, prompts[1], seeded))
    assert [token_ids(alone[0], i) for i in range(3)] == [token_ids(alone[1], i) for i in range(3)]
    assert len({tuple(token_ids(alone[0], i)) for i in range(3)}) == 3  # seeds 11, 12, 13


async def test_preemption_and_aborts_mid_draft_free_every_block(models: tuple[Path, Path]) -> None:
    """A pool far too small for all requests at once: the newest are preempted (their
    draft KV recomputed with the target's) and still give the plain engine's tokens; then
    requests cancelled while their proposals are in flight leave the pool whole."""
    target, noisy = models
    prompts = _prompts(6, seed=9)
    small = dict(OPTIONS, kv_cache_memory=2 * 20 * 512 * 16)  # 20 blocks of 16, both models
    async with engine.open_engine(str(target), **small) as eng:
        plain = await _run_all(eng, prompts, [greedy(64)] * len(prompts))
    async with engine.open_engine(str(target), **small, speculative_config=_draft(noisy)) as eng:
        spec = await _run_all(eng, prompts, [greedy(64)] * len(prompts))
        assert eng.statistics().preemptions > 0
        with trio.move_on_after(0.3):
            await _run_all(eng, prompts[:3], [greedy(200)] * 3)
        stats = await wait_idle(eng)
    assert [token_ids(o) for o in spec] == [token_ids(o) for o in plain]
    assert stats.spec_drafts > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_draft_with_another_vocabulary_is_refused_at_startup(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    target, noisy = models
    bigger = tmp_path / "bigger"
    from engine.models.testing import write_tiny_model

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    write_tiny_model(bigger, "llama", overrides={"vocab_size": vocab + 16})
    swapped = _perturbed(noisy, tmp_path / "swapped", std=0.0)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    names = {v: k for k, v in tok["model"]["vocab"].items()}
    tok["model"]["vocab"][names[100]], tok["model"]["vocab"][names[101]] = 101, 100
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    for draft, words in ((bigger, f"vocabulary of {vocab + 16} tokens"), (swapped, "token 100 is")):
        with pytest.raises(ConfigError) as info:
            async with engine.open_engine(str(target), **OPTIONS, speculative_config=_draft(draft)):
                pass
        assert info.value.field == "speculative_config"
        assert words in str(info.value)
    with pytest.raises(ConfigError) as info:
        async with engine.open_engine(str(target), **OPTIONS,
                                      speculative_config=_draft(tmp_path / "none")):
            pass
    assert info.value.field == "speculative_config"


# --- sampled outputs follow the target distribution -----------------------------------------

# Upper 0.1% point of the chi-square distribution with 3 degrees of freedom (4 categories).
CHI2_3DF_999 = 16.27


def test_sampled_tokens_follow_the_target_distribution_with_a_different_draft(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """4000 seeded trials of one step verifying a 2-token proposal drawn from a draft whose
    distribution is sharper than the target's (top-4 at temperature 0.05 for both; on this
    prompt p is about (0.41, 0.28, 0.21, 0.10) and the draft's q (0.68, 0.21, 0.09, 0.01)):
    the first output token's frequencies match the target's distribution (transformers'
    logits, top-4 at temperature 0.05), and the second's, among the trials that accepted
    the first proposal token and output the commonest first token, match the target's
    distribution after it. Chi-square at the 0.1% level, 3 degrees of freedom each.
    Keeping the proposal blindly gives q's frequencies (a chi-square in the hundreds); so
    does any rule but min(1, p/q) with a resample from normalize(max(p - q, 0))."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.messages import NewRequest, ScheduledChunk, StepPlan
    from engine.models.config import ModelConfig
    from engine.ops import get_ops
    from engine.runner.model_runner import ModelRunner

    target, _ = models
    sharp = _sharpened(target, tmp_path / "sharp", factor=3.0)
    prompt = (5, 17, 42, 99, 7, 123)
    temperature = 0.05
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def p_target(tokens: tuple[int, ...]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1]
        top = torch.topk(logits, 4)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values / temperature, -1).tolist(),
                        strict=True))

    def loaded(folder: Path) -> Any:
        out = type("Loaded", (), {})()
        out.config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        out.weights = load_file(str(folder / "model.safetensors"))
        out.dtype = torch.float32
        return out

    batch = 100
    runner = ModelRunner(loaded(target), device="cpu", ops=get_ops("torch"), num_blocks=2 * batch,
                         block_size=4, max_num_batched_tokens=batch * 8, max_num_seqs=batch,
                         draft=loaded(sharp))
    first: dict[int, int] = {}
    pairs: dict[int, dict[int, int]] = {}
    trials, accepted = 4000, 0
    done: tuple[str, ...] = ()
    for step in range(trials // batch):
        ids = [f"r{step}-{i}" for i in range(batch)]
        news = tuple(NewRequest(r, prompt, SamplingParams(temperature=temperature, top_k=4, max_tokens=4,
                                                          seed=step * batch + i, ignore_eos=True), ())
                     for i, r in enumerate(ids))
        # Each trial its own two blocks: the proposals differ, and so do their KV writes.
        chunks = tuple(ScheduledChunk(r, 0, 8, (2 * i, 2 * i + 1), True, (), 2)
                       for i, r in enumerate(ids))
        result = runner.execute(StepPlan(step, news, chunks, done))
        done = tuple(ids)
        assert not result.failed
        drawn: dict[str, list[int]] = {}
        for s in result.sampled:
            drawn.setdefault(s.sample_id, []).append(s.token_id)
        for tokens in drawn.values():
            assert 1 <= len(tokens) <= 3
            first[tokens[0]] = first.get(tokens[0], 0) + 1
            if len(tokens) > 1:  # the first proposal token was accepted
                accepted += 1
                after = pairs.setdefault(tokens[0], {})
                after[tokens[1]] = after.get(tokens[1], 0) + 1

    def chi2(counts: dict[int, int], p: dict[int, float]) -> float:
        assert set(counts) <= set(p)
        n = sum(counts.values())
        return sum((counts.get(t, 0) - n * q) ** 2 / (n * q) for t, q in p.items())

    p0 = p_target(prompt)
    # The draft's q differs from p: some proposals are rejected, many kept.
    assert 400 < accepted < trials - 400, accepted
    assert chi2(first, p0) < CHI2_3DF_999, (first, p0)
    common = max(pairs, key=lambda t: sum(pairs[t].values()))
    assert sum(pairs[common].values()) > 400
    p1 = p_target((*prompt, common))
    assert chi2(pairs[common], p1) < CHI2_3DF_999, (pairs[common], p1)



# --- the scheduler reserves a draft model's positions (pure: no model) ----------------------


def test_scheduler_reserves_k_positions_for_the_draft_and_counts_what_was_verified() -> None:
    from engine.core.block_pool import BlockPool
    from engine.core.request import RequestStatus
    from engine.core.scheduler import Scheduler, SchedulerConfig, run_with_pool
    from engine.messages import CacheBlocks, SampledToken, SchedulerRequest, StepResult

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                             max_model_len=256, num_kv_blocks=32, num_speculative_tokens=3,
                             draft_model=True)
    sched, pool = Scheduler(config), BlockPool(32, 4, enable_prefix_caching=True)
    prompt = (7, 8, 9, 10, 11, 12)
    sched.add_request(SchedulerRequest("a", prompt, SamplingParams(temperature=0, max_tokens=9),
                                       (), 9, 0, 0.0, None, None))

    def step(tokens: list[int]) -> tuple[Any, Any]:
        plan = run_with_pool(sched.schedule(), pool)
        (chunk,) = plan.chunks
        result = StepResult(plan.step_id, tuple(SampledToken("a", t, 0.0, ()) for t in tokens), 0.0)
        update = sched.update_from_output(plan, result)
        for call in update.allocator_calls:
            pool.handle(call)
        return chunk, update

    chunk, _ = step([20])  # the prompt: no proposal (more than one token to compute)
    assert (chunk.num_tokens, chunk.num_model_drafts) == (6, 0)
    chunk, update = step([21, 22])  # 3 positions reserved; the first kept, then the model's 22
    assert (chunk.start, chunk.num_tokens, chunk.draft_token_ids, chunk.num_model_drafts) == (6, 4, (), 3)
    req = sched.get_request("a")
    assert req.output_token_ids == [20, 21, 22] and req.num_computed_tokens == 8
    # Positions 6 and 7 (20, the kept 21) are verified: block [4, 8) is full and cached.
    assert [c.token_ids for c in update.allocator_calls if isinstance(c, CacheBlocks)] == [(11, 12, 20, 21)]
    chunk, _ = step([23, 24, 25, 26])  # all 3 kept, then the model's own
    assert (chunk.start, chunk.num_model_drafts) == (8, 3)
    assert req.num_computed_tokens == 12 and len(req.output_token_ids) == 7
    chunk, _ = step([27, 28])  # max_tokens 9 leaves one proposal position
    assert (chunk.start, chunk.num_tokens, chunk.num_model_drafts) == (12, 2, 1)
    assert req.status == RequestStatus.FINISHED_LENGTH
    stats = sched.statistics()
    assert (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (3, 7, 5)
    assert pool.statistics().num_free_blocks == 32
