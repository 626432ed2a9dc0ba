"""Beam search against transformers' ``generate(num_beams=...)`` (issue 38).

The oracle is transformers' own beam search on the same weights in fp32: the same
hypotheses in the same order, their scores (``sequences_scores``) and cumulative logprobs
within 1e-4. The EOS of the "with EOS" cases is a token of the model's own greedy output,
so the search meets it inside the horizon.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from engine_helpers import collect, tiny_model, wait_idle

import engine
from engine.core.block_pool import BlockPool
from engine.messages import AllocateSlots, AllocationRefused, BlocksForked, ForkBlocks, FreeRequest
from engine.params import SamplingParams

# 16-token blocks; a pool of 4 MiB (8192 tokens of the tiny model) leaves every width room.
OPTIONS: dict[str, Any] = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
                               block_size=16, kv_cache_memory=4 * 1024 * 1024)
PROMPT = [5, 77, 123, 9, 201, 45, 300, 17, 88, 140, 66, 250, 31]  # 13 tokens: a partial block
MAX_TOKENS = 12
TOLERANCE = 1e-4  # the bound on scores and cumulative logprobs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def hf(model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def hf_beams(hf: Any, prompt: list[int], *, width: int, max_tokens: int, eos: int | None,
             length_penalty: float = 1.0, early_stopping: bool | str = False,
             min_tokens: int = 0) -> list[tuple[list[int], float, float]]:
    """transformers' hypotheses, best first: (generated ids, score, cumulative logprob).
    One beam is greedy search there (``num_beams=1`` takes that path): its scores are
    summed from the step logits it returns."""
    ids = torch.tensor([prompt])
    if width == 1:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=min_tokens or None, do_sample=False, eos_token_id=eos,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              top_k=None, top_p=None, temperature=None)
        tokens = out.sequences[0, len(prompt):].tolist()
        if eos is not None and eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        cum = sum(torch.log_softmax(out.logits[i][0].float(), -1)[t].item() for i, t in enumerate(tokens))
        return [(tokens, cum / len(tokens) ** length_penalty, cum)]
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
            min_new_tokens=min_tokens or None, num_beams=width, num_return_sequences=width,
            length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False,
            eos_token_id=eos, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
            top_k=None, top_p=None, temperature=None,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    result = []
    for row, length, score in zip(out.sequences.tolist(), lengths, out.sequences_scores.tolist(), strict=True):
        result.append((row[len(prompt):len(prompt) + length], score, score * length ** length_penalty))
    return result


def hf_greedy(hf: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, top_k=None,
                          top_p=None, temperature=None)
    return out[0, len(prompt):].tolist()


def beam_params(width: int, eos: int | None, **extra: Any) -> SamplingParams:
    # The tiny model's own EOS is ignored; the chosen EOS is a stop token (it ends a
    # hypothesis exactly as EOS does, and transformers is given it as eos_token_id).
    return SamplingParams(beam_width=width, n=width, max_tokens=extra.pop("max_tokens", MAX_TOKENS),
                          ignore_eos=True, stop_token_ids=[eos] if eos is not None else [], **extra)


async def engine_beams(eng: Any, prompt: list[int], params: SamplingParams) -> list[tuple[list[int], float, float]]:
    outputs = await collect(eng, prompt, params)
    final = sorted((o for o in outputs if o.finished), key=lambda o: o.index)
    return [(list(o.token_ids), o.beam_score, o.cumulative_logprob) for o in final]


def assert_same(ours: list[tuple[list[int], float, float]], theirs: list[tuple[list[int], float, float]]) -> None:
    assert [t for t, _, _ in ours] == [t for t, _, _ in theirs]
    for (_, s, c), (_, hs, hc) in zip(ours, theirs, strict=True):
        assert s == pytest.approx(hs, abs=TOLERANCE)
        assert c == pytest.approx(hc, abs=TOLERANCE)


@pytest.fixture(scope="module")
def eos(hf: Any) -> int:
    """The second token of the model's greedy continuation of PROMPT."""
    return hf_greedy(hf, PROMPT, 4)[1]


# (length_penalty, early_stopping, min_tokens): each of transformers' stopping rules; a
# penalty below 1 favours the short hypotheses EOS ends, "never" with a positive penalty
# takes the bound over max_tokens, min_tokens masks EOS in the first steps.
SETTINGS = [(1.0, False, 0), (0.5, True, 0), (2.0, "never", 0), (-1.0, False, 3)]


@pytest.mark.parametrize("width", [1, 2, 4, 8])
async def test_beams_match_transformers_with_and_without_eos(model: Path, hf: Any, eos: int, width: int) -> None:
    ended = 0
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        ours = await engine_beams(eng, PROMPT, beam_params(width, None))
        assert_same(ours, hf_beams(hf, PROMPT, width=width, max_tokens=MAX_TOKENS, eos=None))
        for penalty, early, min_tokens in SETTINGS:
            if width == 1 and early == "never":
                continue  # transformers runs greedy search for one beam, which never waits
            ours = await engine_beams(eng, PROMPT, beam_params(
                width, eos, length_penalty=penalty, early_stopping=early, min_tokens=min_tokens))
            theirs = hf_beams(hf, PROMPT, width=width, max_tokens=MAX_TOKENS, eos=eos,
                              length_penalty=penalty, early_stopping=early, min_tokens=min_tokens)
            assert_same(ours, theirs)
            ended += sum(1 for t, _, _ in theirs if t[-1] == eos and len(t) < MAX_TOKENS)
        await wait_idle(eng)
    assert ended, "no hypothesis ended with EOS inside the horizon: the EOS cases test nothing"


# 20 blocks of 16 tokens (the tiny model's KV is 512 bytes a token): one group of 4 beams
# of up to 62 tokens fits with room for its forks (the cap on max_tokens is 38 here),
# three at once do not.
SMALL_POOL = 20 * 16 * 512


@pytest.mark.parametrize("prefix_caching", [False, True])
async def test_groups_preempted_whole_give_the_same_beams(model: Path, hf: Any, prefix_caching: bool) -> None:
    # Recomputed beams take their prompt (and, with the cache, their cached blocks) anew.
    prompts = [PROMPT * 2, PROMPT[::-1] * 2, [7, *PROMPT[3:]] * 2]  # 20-26 tokens: a full block
    options = dict(OPTIONS, kv_cache_memory=SMALL_POOL, enable_prefix_caching=prefix_caching)
    params = beam_params(4, None, max_tokens=36)
    results: list[Any] = [None] * len(prompts)
    async with engine.open_engine(str(model), **options) as eng:
        assert eng.statistics().kv_blocks_total == 20

        async def one(i: int) -> None:
            results[i] = await engine_beams(eng, prompts[i], params)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        stats = await wait_idle(eng)
    assert stats.preemptions > 0
    for prompt, ours in zip(prompts, results, strict=True):
        assert_same(ours, hf_beams(hf, prompt, width=4, max_tokens=36, eos=None))


async def test_aborting_mid_search_leaks_no_block(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        total = eng.statistics().kv_blocks_total
        stream = await eng.submit(PROMPT, beam_params(8, None, max_tokens=200))
        async with stream:
            start = eng.statistics().steps
            # Several forks in: the beams hold shared and copied blocks of their own.
            with trio.fail_after(60):
                while eng.statistics().steps < start + 12:  # noqa: ASYNC110 - no event to wait on
                    await trio.sleep(0.01)
            assert eng.statistics().kv_blocks_free < total
        stats = await wait_idle(eng)  # aborted on leaving the stream
    assert stats.kv_blocks_free == total


def test_http_beam_search_through_the_openai_client(model: Path, hf: Any) -> None:
    import openai
    from http_server import ServerThread

    with ServerThread(lambda: engine.open_engine(str(model), served_model_name="tiny", **OPTIONS)) as srv, \
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0) as client:
        answer = client.completions.create(
            model="tiny", prompt=PROMPT, n=4, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True,
                        "return_token_ids": True})
        theirs = hf_beams(hf, PROMPT, width=4, max_tokens=MAX_TOKENS, eos=None, length_penalty=0.5)
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert [c.token_ids for c in answer.choices] == [t for t, _, _ in theirs]  # type: ignore[attr-defined]
        assert answer.usage.completion_tokens == sum(len(t) for t, _, _ in theirs)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
            extra_body={"use_beam_search": True, "ignore_eos": True, "early_stopping": "never"})
        assert [c.index for c in chat.choices] == [0, 1]
        assert chat.choices[0].message.content != chat.choices[1].message.content
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           n=2, stream=True, extra_body={"use_beam_search": True})
        assert info.value.body["param"] == "use_beam_search"  # type: ignore[index]
        stats = srv.engine.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_engine_beam_search_returns_vllms_beam_shape(model: Path, hf: Any) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        out = await eng.beam_search(PROMPT, engine.BeamSearchParams(
            beam_width=2, max_tokens=MAX_TOKENS, ignore_eos=True, early_stopping=True))
    theirs = hf_beams(hf, PROMPT, width=2, max_tokens=MAX_TOKENS, eos=None, early_stopping=True)
    assert [s.tokens for s in out.sequences] == [PROMPT + t for t, _, _ in theirs]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, _, c in theirs], abs=TOLERANCE)


def test_llm_beam_search_on_smollm2_matches_transformers(tmp_path: Path) -> None:
    """The one real-model case: SmolLM2-135M's GGUF, dequantized to fp32 on both sides."""
    from text_fixtures import smollm2_gguf, smollm2_transformers
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = tokenizer("The three primary colors are")["input_ids"]
    theirs_model = smollm2_transformers()
    theirs = hf_beams(theirs_model, prompt, width=4, max_tokens=8, eos=None, length_penalty=0.5)
    with engine.LLM(str(gguf), dtype="float32", quantization="none", max_model_len=256,
                    kv_cache_memory=16 * 2**20) as llm:
        (out,) = llm.beam_search([{"prompt_token_ids": prompt}], engine.BeamSearchParams(
            beam_width=4, max_tokens=8, ignore_eos=True, length_penalty=0.5))
    assert [s.tokens[len(prompt):] for s in out.sequences] == [t for t, _, _ in theirs]
    assert [s.score for s in out.sequences] == pytest.approx([s for _, s, _ in theirs], abs=TOLERANCE)
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, _, c in theirs], abs=TOLERANCE)
    assert out.sequences[0].text == tokenizer.decode(out.sequences[0].tokens[len(prompt):])


def test_a_fork_shares_full_blocks_and_copies_only_the_partial_last_one() -> None:
    pool = BlockPool(6, 16)
    parent = pool.handle(AllocateSlots("p", 0, 40, 40))  # 40 tokens: 2 full blocks + 8
    first, second, last = parent.block_ids  # type: ignore[union-attr]
    taken = pool.handle(ForkBlocks("p", "a", 3, copy_last=False))
    copied = pool.handle(ForkBlocks("p", "b", 3, copy_last=True))
    assert isinstance(taken, BlocksForked) and isinstance(copied, BlocksForked)
    assert taken.block_ids == (first, second, last) and taken.copies == ()
    fresh = copied.block_ids[2]
    assert copied.block_ids[:2] == (first, second) and copied.copies == ((last, fresh),)
    assert [pool.ref_count(b) for b in (first, second, last, fresh)] == [3, 3, 2, 1]
    pool.handle(FreeRequest("p"))  # the parent goes: each block keeps its children
    assert [pool.ref_count(b) for b in (first, second, last, fresh)] == [2, 2, 1, 1]
    pool.handle(AllocateSlots("x", 0, 32, 32))  # the last two free blocks
    assert isinstance(pool.handle(ForkBlocks("a", "c", 3, copy_last=True)), AllocationRefused)
    assert pool.block_table("c") == () and pool.ref_count(first) == 2  # nothing changed
    for table in ("a", "b", "x"):
        pool.handle(FreeRequest(table))
    assert pool.num_free_blocks == 6


async def test_a_group_that_cannot_fit_is_refused_by_name(model: Path) -> None:
    async with engine.open_engine(str(model), **dict(OPTIONS, kv_cache_memory=SMALL_POOL)) as eng:
        with pytest.raises(engine.InvalidParamError) as info:
            await eng.submit(PROMPT, beam_params(32, None))  # 32 beams, 16 rows a step
        assert info.value.param == "n"
        # 4 unshared beams and 4 copies in 20 blocks: 64 tokens each, the prompt included.
        with pytest.raises(engine.PromptTooLongError):
            await eng.submit(PROMPT * 5, beam_params(4, None))
        ours = await engine_beams(eng, PROMPT * 4, beam_params(4, None, max_tokens=100))
        assert {len(t) for t, _, _ in ours} == {64 - len(PROMPT * 4)}  # max_tokens cut to fit
        await wait_idle(eng)


@pytest.mark.parametrize("field", [
    {"logprobs": 1}, {"prompt_logprobs": 0}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2},
    {"logit_bias": {3: 1.0}}, {"allowed_token_ids": [3]}, {"bad_words": ["fox"]},
    {"extra_args": {"k": 1}},
])
def test_what_the_ranking_cannot_honour_is_refused_by_name(field: dict[str, Any]) -> None:
    (name,) = field
    with pytest.raises(engine.InvalidParamError) as info:
        SamplingParams(beam_width=2, **field)
    assert info.value.param == name
    SamplingParams(**field)  # fine without beam search


@pytest.mark.parametrize("field", [{"length_penalty": 0.5}, {"early_stopping": True}])
def test_beam_fields_without_beam_search_are_refused(field: dict[str, Any]) -> None:
    with pytest.raises(engine.InvalidParamError) as info:
        SamplingParams(**field)
    assert info.value.param == next(iter(field))


def test_the_width_is_best_of_on_completions_and_n_on_chat() -> None:
    from engine.http.completions import protocol

    req = protocol.parse_completion({"prompt": "x", "use_beam_search": True, "n": 2, "best_of": 4,
                                     "length_penalty": 0.5, "early_stopping": "never"})
    assert (req.params.beam_width, req.params.n, req.returned_n) == (4, 2, None)
    assert (req.params.length_penalty, req.params.early_stopping) == (0.5, "never")
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 3,
                                "use_beam_search": True, "early_stopping": True})
    assert (chat.params.beam_width, chat.params.n, chat.params.early_stopping) == (3, 3, True)


async def test_beams_through_an_engine_core_process(model: Path, hf: Any, eos: int) -> None:
    """The answers (scores and all) cross the engine core's wire (msgpack) intact."""
    async with engine.open_engine(str(model), **dict(OPTIONS, engine_core="process")) as eng:
        ours = await engine_beams(eng, PROMPT, beam_params(4, eos, length_penalty=0.5))
    assert_same(ours, hf_beams(hf, PROMPT, width=4, max_tokens=MAX_TOKENS, eos=eos, length_penalty=0.5))
