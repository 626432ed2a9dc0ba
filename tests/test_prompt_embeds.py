"""vLLM's prompt_embeds: a prompt given as its input embeddings (engine/api/prompt_embeds.py).

The oracle is transformers' ``generate(inputs_embeds=...)`` (greedy) on the same tiny
model and the same embeddings: the engine's tokens must be its tokens, in one prompt or
over chunks, through the embedded API, an engine-core process, ``engine.LLM`` and the
HTTP server with the official ``openai`` client (the embeddings sent as vLLM's clients
send them: base64 of ``torch.save``'s bytes). The embeddings are a prompt's token
embeddings plus noise, so they are no token's: a server that read the placeholder ids,
or the embeddings of any ids, would give other tokens.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import openai
import pytest
import torch
from engine_helpers import wait_idle
from hf_written import write_deepseek_v3
from http_server import ServerThread
from test_cohere import write_cohere
from test_glm4 import write_glm4
from test_gpt_neox import write_neox
from test_phi import write_phi
from test_starcoder2 import write_starcoder2

import engine
from engine import InvalidParamError, SamplingParams
from engine.models.testing import write_tiny_model
from engine.models.testing_gpt_oss import write_gpt_oss

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("embeds") / "llama", "llama")


def _embeds(folder: Path, length: int, seed: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (length,), generator=gen)
    with torch.no_grad():
        rows = model.get_input_embeddings()(ids)
    return rows + 0.05 * torch.randn(rows.shape, generator=gen)


def _hf_greedy(folder: Path, rows: torch.Tensor, new_tokens: int = NEW_TOKENS) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(inputs_embeds=rows[None].float(), max_new_tokens=new_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(rows), dtype=torch.long),
                             pad_token_id=0)
    return out[0].tolist()[-new_tokens:]


def _hf_greedy_ids(folder: Path, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0].tolist()[len(ids):]


def _b64(rows: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(rows, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


async def _tokens(eng: engine.Engine, rows: torch.Tensor, **params) -> list[int]:
    stream = await eng.submit(None, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, **params),
                              prompt_embeds=rows)
    async with stream:
        return [t async for out in stream for t in out.token_ids]


async def test_prompt_embeds_give_transformers_tokens_whole_and_in_chunks(llama: Path) -> None:
    short, long_ = _embeds(llama, 12, seed=1), _embeds(llama, 45, seed=2)
    # A 16-token step budget: the 45 rows are prefilled over three chunks.
    async with engine.open_engine(llama, dtype="float32", enable_prompt_embeds=True,
                                  max_num_batched_tokens=16, block_size=16,
                                  kv_cache_memory=4 * 1024 * 1024) as eng:
        got_short = await _tokens(eng, short)
        got_long = await _tokens(eng, long_)
        # The same rows again: their full blocks come from the prefix cache, keyed by
        # the rows' content, and the tokens are the same.
        stream = await eng.submit(None, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                                  prompt_embeds=long_)
        async with stream:
            outs = [out async for out in stream]
        # Rows in bfloat16 and with a batch dimension, as vLLM takes them; cut to the last
        # 20 rows by truncate_prompt_tokens.
        got_bf16 = await _tokens(eng, short.to(torch.bfloat16)[None])
        got_cut = await _tokens(eng, long_, truncate_prompt_tokens=20)
        stats = await wait_idle(eng)
    assert got_short == _hf_greedy(llama, short)
    assert got_long == _hf_greedy(llama, long_)
    assert [t for o in outs for t in o.token_ids] == got_long
    assert outs[-1].usage.cached_tokens == 32 and outs[-1].usage.prompt_tokens == 45
    assert got_bf16 == _hf_greedy(llama, short.to(torch.bfloat16).float())
    assert got_cut == _hf_greedy(llama, long_[-20:])
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_prompt_embeds_refusals_name_their_field(llama: Path,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    rows = _embeds(llama, 6, seed=3)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    async with engine.open_engine(llama, dtype="float32") as eng:
        with pytest.raises(InvalidParamError, match="--enable-prompt-embeds") as info:
            await eng.submit(None, greedy, prompt_embeds=rows)
        assert info.value.param == "prompt_embeds"
    async with engine.open_engine(llama, dtype="float32", enable_prompt_embeds=True) as eng:
        nan = rows.clone()
        nan[2, 3] = float("nan")
        for kwargs, params, param in (
            ({"prompt_embeds": rows[:, :8]}, greedy, "prompt_embeds"),  # not the hidden size
            ({"prompt_embeds": nan}, greedy, "prompt_embeds"),
            ({"prompt_embeds": rows.long()}, greedy, "prompt_embeds"),
            ({"prompt_embeds": [[0.0] * rows.shape[1]]}, greedy, "prompt_embeds"),
            ({"prompt_embeds": rows, "prompt": "hi"}, greedy, "prompt_embeds"),
            ({"prompt_embeds": rows}, greedy.replace(prompt_logprobs=1), "prompt_logprobs"),
            ({"prompt_embeds": rows}, greedy.replace(repetition_penalty=1.2), "repetition_penalty"),
        ):
            kwargs = {"prompt": None, **kwargs}
            with pytest.raises(InvalidParamError) as info:
                await eng.submit(kwargs.pop("prompt"), params, **kwargs)
            assert info.value.param == param, kwargs
        # Refused requests leave nothing behind; the engine serves on.
        assert len(await _tokens(eng, rows)) == NEW_TOKENS
    gemma = write_tiny_model(tmp_path_factory.mktemp("embeds-gemma") / "g", "gemma2")
    async with engine.open_engine(gemma, dtype="float32", enable_prompt_embeds=True) as eng:
        with pytest.raises(InvalidParamError, match="gemma2") as info:
            await eng.submit(None, greedy, prompt_embeds=torch.zeros(3, 64))
        assert info.value.param == "prompt_embeds"


async def test_prompt_embeds_with_gpt2_and_through_an_engine_core_process(
    llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # GPT-2's learned positions are added to the given rows, as transformers adds them.
    gpt2 = write_tiny_model(tmp_path_factory.mktemp("embeds-gpt2") / "gpt2", "gpt2")
    rows = _embeds(gpt2, 10, seed=4)
    async with engine.open_engine(gpt2, dtype="float32", enable_prompt_embeds=True) as eng:
        got = await _tokens(eng, rows)
    assert got == _hf_greedy(gpt2, rows)
    # The rows cross the engine-core wire with the request.
    rows = _embeds(llama, 14, seed=5)
    async with engine.open_engine(llama, dtype="float32", enable_prompt_embeds=True,
                                  engine_core="process") as eng:
        got = await _tokens(eng, rows)
    assert got == _hf_greedy(llama, rows)


def _write_stream_family(folder: Path, family: str) -> None:
    """A tiny model of a family whose step is the decoder's hidden-states stream
    (``Decoder._run_stream``), written by transformers' own classes."""
    writers = {"olmo2": lambda f: write_tiny_model(f, "olmo2"), "gpt_oss": lambda f: write_gpt_oss(f, spread=0.2),
               "deepseek_v3": write_deepseek_v3, "glm4": write_glm4, "cohere2": write_cohere,
               "starcoder2": write_starcoder2, "gpt_neox": write_neox, "phi": write_phi}
    writers[family](folder)


@pytest.mark.parametrize("family", ["olmo2", "gpt_oss", "deepseek_v3", "glm4", "cohere2", "starcoder2", "gpt_neox",
                                    "phi"])
async def test_prompt_embeds_on_every_hidden_stream_family(family: str, tmp_path: Path) -> None:
    """The families whose step starts from the hidden states alone take the rows too
    (a step with them skips the fused CPU step, as the Llama decoder's does)."""
    folder = tmp_path / family
    _write_stream_family(folder, family)
    rows = _embeds(folder, 9, seed=6)
    async with engine.open_engine(folder, dtype="float32", enable_prompt_embeds=True,
                                  kv_cache_memory=2**22) as eng:
        got = await _tokens(eng, rows)
    assert got == _hf_greedy(folder, rows)


def test_llm_generate_takes_prompt_embeds_dicts(llama: Path) -> None:
    first, second = _embeds(llama, 9, seed=6), _embeds(llama, 17, seed=7)
    with engine.LLM(str(llama), dtype="float32", enable_prompt_embeds=True) as llm:
        outputs = llm.generate([{"prompt_embeds": first}, {"prompt_embeds": second}],
                               SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                               use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        _hf_greedy(llama, first), _hf_greedy(llama, second)]
    # vLLM's RequestOutput of an embeddings prompt has no prompt ids (nor text).
    assert [(o.prompt, o.prompt_token_ids) for o in outputs] == [(None, None)] * 2


def test_completions_take_base64_prompt_embeds_from_the_openai_client(llama: Path) -> None:
    first, second = _embeds(llama, 11, seed=8), _embeds(llama, 7, seed=9)
    want = [_hf_greedy(llama, first), _hf_greedy(llama, second)]
    ids = torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(10)).tolist()
    want_ids = _hf_greedy_ids(llama, ids)
    opener = lambda: engine.open_engine(str(llama), dtype="float32", enable_prompt_embeds=True)  # noqa: E731
    with ServerThread(opener) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        model = srv.engine.model_name
        one = client.completions.create(model=model, prompt=None, max_tokens=NEW_TOKENS,
                                        temperature=0, extra_body={
                                            "prompt_embeds": _b64(first), "return_token_ids": True})
        two = client.completions.create(model=model, prompt=None, max_tokens=NEW_TOKENS,
                                        temperature=0, extra_body={
                                            "prompt_embeds": [_b64(first), _b64(second)],
                                            "return_token_ids": True})
        streamed = [c.choices[0].text for c in client.completions.create(
            model=model, prompt=None, max_tokens=NEW_TOKENS, temperature=0, stream=True,
            extra_body={"prompt_embeds": _b64(second)})]
        # Embeddings and token prompts in one request: the embeddings' choices first, as
        # vLLM answers them, each prompt's tokens its own.
        mixed = client.completions.create(model=model, prompt=[ids], max_tokens=NEW_TOKENS,
                                          temperature=0, extra_body={
                                              "prompt_embeds": [_b64(second)],
                                              "return_token_ids": True})
        url = srv.base_url + "/v1/completions"
        refusals = [
            (httpx.post(url, json={"prompt_embeds": "not base64!"}, timeout=30), "prompt_embeds"),
            (httpx.post(url, json={"prompt_embeds": base64.b64encode(b"junk").decode()}, timeout=30),
             "prompt_embeds"),
            (httpx.post(url, json={"prompt_embeds": _b64(first), "echo": True}, timeout=30), "echo"),
            (httpx.post(srv.base_url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "prompt_embeds": _b64(first)}),
             "prompt_embeds"),
        ]
        alive = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert one.choices[0].token_ids == want[0]
    assert one.usage.prompt_tokens == 11 and one.choices[0].prompt_token_ids is None
    assert [c.token_ids for c in sorted(two.choices, key=lambda c: c.index)] == want
    assert "".join(streamed) == srv.engine.tokenizer.decode(want[1])
    by_index = sorted(mixed.choices, key=lambda c: c.index)
    assert [c.token_ids for c in by_index] == [want[1], want_ids]
    assert [c.prompt_token_ids for c in by_index] == [None, ids]
    assert mixed.usage.prompt_tokens == len(second) + len(ids)
    for reply, param in refusals:
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert alive.status_code == 200
    # Without --enable-prompt-embeds, a 400 naming the field.
    with ServerThread(lambda: engine.open_engine(str(llama), dtype="float32")) as srv:
        reply = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                           json={"prompt_embeds": _b64(first)})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_embeds"


async def test_n_samples_of_prompt_embeds_share_the_prompts_blocks(llama: Path) -> None:
    rows = _embeds(llama, 40, seed=10)
    async with engine.open_engine(llama, dtype="float32", enable_prompt_embeds=True,
                                  block_size=16, kv_cache_memory=4 * 1024 * 1024) as eng:
        stream = await eng.submit(None, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, n=3),
                                  prompt_embeds=rows)
        async with stream:
            outs = [out async for out in stream]
        stats = await wait_idle(eng)
    by_sample: dict[int, list[int]] = {}
    for out in outs:
        by_sample.setdefault(out.index, []).extend(out.token_ids)
    want = _hf_greedy(llama, rows)
    assert [by_sample[i] for i in range(3)] == [want] * 3
    # The second and third samples took the first's two full blocks from the cache.
    assert sum(o.usage.cached_tokens for o in outs if o.finished) == 2 * 32
    assert stats.kv_blocks_free == stats.kv_blocks_total
