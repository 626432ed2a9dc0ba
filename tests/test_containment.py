"""A fault in one request or one step stays there: the engine goes on serving the rest.

Tiny float32 model, real actors. Each fault is injected into the real model runner; the
oracle for the survivors is the same request run alone on a healthy engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import (
    WAIT_LIMIT_SECONDS,
    collect,
    greedy,
    random_prompts,
    tiny_model,
    token_ids,
    wait_idle,
    wait_until,
)

import engine
from engine.errors import EngineDeadError, InvalidParamError, RequestFailedError
from engine.params import SamplingParams
from engine.runner.model_runner import STEP_FAILED, ModelRunner

OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
    kv_cache_memory=4 * 1024 * 1024,
)
PROMPTS = random_prompts(4, vocab=300, lo=20, hi=40, seed=11)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


async def _run_together(eng: Any, jobs: dict[str, tuple[Any, SamplingParams]]) -> dict[str, Any]:
    """Each job's token ids, or the exception its stream raised."""
    results: dict[str, Any] = {}

    async def one(name: str) -> None:
        prompt, params = jobs[name]
        try:
            results[name] = token_ids(await collect(eng, prompt, params, request_id=name))
        except RequestFailedError as exc:
            results[name] = exc

    async with trio.open_nursery() as nursery:
        for name in jobs:
            nursery.start_soon(one, name)
    return results


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_an_injected_step_fault_fails_only_that_steps_requests(
    model: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        alone = [token_ids(await collect(eng, p, greedy(12))) for p in PROMPTS[:2]]
    original = ModelRunner._run
    faults = 0

    def faulty(self: ModelRunner, chunks: Any) -> Any:
        nonlocal faults
        # The step that decodes the victim's 4th token raises (once): by then the others
        # have steps of their own too.
        victim = [c for c in chunks if c.sample_id.startswith("victim#")]
        if victim and victim[0].start == len(PROMPTS[2]) + 3 and not faults:
            faults += 1
            raise RuntimeError("injected fault")
        return original(self, chunks)

    monkeypatch.setattr(ModelRunner, "_run", faulty)
    async with engine.open_engine(str(model), **OPTIONS, async_scheduling=async_scheduling) as eng:
        jobs = {"a": (PROMPTS[0], greedy(12)), "b": (PROMPTS[1], greedy(12)),
                "victim": (PROMPTS[2], greedy(30))}
        results = await _run_together(eng, jobs)
        assert faults == 1
        assert isinstance(results["victim"], RequestFailedError)
        assert str(results["victim"]) == STEP_FAILED
        # The others either shared the failed step (and failed with it) or got exactly
        # the tokens they get alone: nothing half-written reached them.
        for name, want in zip("ab", alone, strict=True):
            got = results[name]
            assert got == want or (isinstance(got, RequestFailedError) and str(got) == STEP_FAILED)
        stats = await wait_idle(eng)
        assert not eng.dead
        # And the engine serves the next request as a healthy one would.
        assert token_ids(await collect(eng, PROMPTS[0], greedy(12))) == alone[0]
        assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_request_that_can_never_sample_is_refused_at_admission(model: Path) -> None:
    # Regression: stop_token_ids listing the whole vocabulary with min_tokens=1 made the
    # sampler return the vocabulary size and the engine died for everybody.
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        vocab = eng.tokenizer.vocab_size
        masked = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=1,
                                stop_token_ids=list(range(vocab)))
        with pytest.raises(InvalidParamError, match="no token can be sampled") as info:
            await eng.submit(PROMPTS[1], masked)
        assert info.value.param == "stop_token_ids"
        for params, param in [
            (SamplingParams(top_k=vocab + 1), "top_k"),
            (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
            (SamplingParams(max_tokens=None, min_tokens=10_000), "min_tokens"),
        ]:
            with pytest.raises(InvalidParamError) as info:
                await eng.submit(PROMPTS[0], params)
            assert info.value.param == param
        # At the limits, fine: top_k = V is "off", every token but one may stop.
        await collect(eng, PROMPTS[0], SamplingParams(top_k=vocab, max_tokens=2))
        await collect(eng, PROMPTS[0], SamplingParams(
            min_tokens=1, max_tokens=2, stop_token_ids=list(range(1, vocab)), ignore_eos=True))


async def test_a_row_whose_logits_turn_nan_fails_only_its_request(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.runner.sampler import Sampler

    original = Sampler._adjust_logits
    poisoned_seed = 424242  # marks the victim's rows

    def poisoned(self: Sampler, logits: Any, rows: Any) -> Any:
        logits = original(self, logits, rows).clone()
        for b, row in enumerate(rows):
            if row.params.seed == poisoned_seed:
                logits[b, 3] = float("nan")
        return logits

    async with engine.open_engine(str(model), **OPTIONS) as eng:
        alone = token_ids(await collect(eng, PROMPTS[0], greedy(10)))
        monkeypatch.setattr(Sampler, "_adjust_logits", poisoned)
        results = await _run_together(eng, {
            "ok": (PROMPTS[0], greedy(10)),
            "nan": (PROMPTS[1], SamplingParams(max_tokens=5, seed=poisoned_seed)),
        })
        assert results["ok"] == alone
        assert isinstance(results["nan"], RequestFailedError)
        assert "NaN" in str(results["nan"])
        stats = await wait_idle(eng)
        assert not eng.dead and stats.kv_blocks_free == stats.kv_blocks_total


# -- the self-healing engine --------------------------------------------------------------


def _crash_on(monkeypatch: pytest.MonkeyPatch, when: Any) -> list[int]:
    """Make the executor actor crash (its runner raises) on the plans ``when`` picks."""
    original = ModelRunner.execute
    crashes: list[int] = []

    def execute(self: ModelRunner, plan: Any) -> Any:
        if when(plan):
            crashes.append(plan.step_id)
            raise RuntimeError("injected actor crash")
        return original(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    return crashes


def _has_victim(plan: Any) -> bool:
    return any(c.sample_id.startswith("victim") for c in plan.chunks)


async def test_an_actor_crash_restarts_the_engine_in_place_up_to_its_limit(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        healthy = token_ids(await collect(eng, PROMPTS[0], greedy(12)))
    crashes = _crash_on(monkeypatch, _has_victim)
    async with engine.open_engine(str(model), **OPTIONS, max_engine_restarts=1) as eng:
        weights = eng._parts.runner.model
        bystander = await eng.submit(PROMPTS[1], greedy(40))
        with pytest.raises(EngineDeadError) as info:
            await collect(eng, PROMPTS[2], greedy(8), request_id="victim-1")
        assert isinstance(info.value.__cause__, RuntimeError)
        # The request in flight with it fails too, with the same error and nothing hangs.
        with pytest.raises(EngineDeadError), trio.fail_after(WAIT_LIMIT_SECONDS):
            async with bystander:
                async for _ in bystander:
                    pass
        await wait_until(lambda: not eng.restarting)
        assert not eng.dead and eng.restarts == 1
        assert eng._parts.runner.model is weights  # weights kept, not reloaded
        stats = await wait_idle(eng)
        assert stats.running == stats.waiting == 0
        assert token_ids(await collect(eng, PROMPTS[0], greedy(12))) == healthy
        # Past the limit the engine stays dead.
        with pytest.raises(EngineDeadError):
            await collect(eng, PROMPTS[2], greedy(8), request_id="victim-2")
        await wait_until(lambda: eng.dead)
        assert not eng.restarting and eng.restarts == 1 and len(crashes) == 2
        with pytest.raises(EngineDeadError):
            await eng.submit("Hello", greedy(4))
