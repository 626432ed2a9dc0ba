"""vLLM's --stream-interval (engine.actors.detokenizer): a sample's new tokens are handed on
once N of them have come, its first token and its end at once.

The tokens are transformers' greedy tokens on the same tiny model; the text, logprobs and
usage are those of the same engine streaming every step (stream_interval 1, the previous
code path), so merging outputs loses and reorders nothing. The served form is read with
the official ``openai`` client.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from engine_helpers import collect, greedy, random_prompts, tiny_model, token_ids, wait_idle
from http_server import ServerThread

import engine
from engine.errors import ConfigError

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


def _hf_greedy(folder: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          pad_token_id=0)
    return out[0].tolist()[len(prompt):]


def _sizes(outputs: list, index: int = 0) -> list[int]:
    return [len(o.token_ids) for o in outputs if o.index == index]


async def test_outputs_come_every_n_tokens_with_the_first_and_last_at_once(model: Path) -> None:
    (prompt,) = random_prompts(1, vocab=300, lo=5, hi=12, seed=4)
    params = greedy(NEW_TOKENS, logprobs=2, n=2)
    async with engine.open_engine(model, dtype="float32") as eng:
        every_step = await collect(eng, prompt, params)
    async with engine.open_engine(model, dtype="float32", stream_interval=4) as eng:
        paced = await collect(eng, prompt, params)
        # A stop string ends a sample inside an interval: what it held goes with the end.
        stop_text = "".join(o.text for o in every_step if o.index == 0)[6:10]
        stopped = await collect(eng, prompt, greedy(NEW_TOKENS, stop=[stop_text]))
        await wait_idle(eng)
    want = _hf_greedy(model, prompt, NEW_TOKENS)
    for index in (0, 1):
        assert token_ids(paced, index) == token_ids(every_step, index) == want
        assert _sizes(paced, index) == [1, 4, 4, 1]  # 10 tokens: first, two intervals, the end
        assert _sizes(every_step, index) == [1] * NEW_TOKENS
        for field in ("text", "logprobs"):
            merged = [x for o in paced if o.index == index for x in (
                [o.text] if field == "text" else o.logprobs)]
            whole = [x for o in every_step if o.index == index for x in (
                [o.text] if field == "text" else o.logprobs)]
            assert ("".join(merged) if field == "text" else merged) == \
                ("".join(whole) if field == "text" else whole)
        last = [o for o in paced if o.index == index][-1]
        assert last.finished and last.usage == [o for o in every_step if o.index == index][-1].usage
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop_text
    assert "".join(o.text for o in stopped) == "".join(
        o.text for o in every_step if o.index == 0).split(stop_text)[0]


def test_a_served_stream_comes_in_chunks_of_n_tokens(model: Path) -> None:
    opener = lambda: engine.open_engine(str(model), dtype="float32", stream_interval=3)  # noqa: E731
    with ServerThread(opener) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        name = srv.engine.model_name
        whole = client.completions.create(model=name, prompt="Hello there", max_tokens=7,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     "return_token_ids": True})
        chunks = list(client.completions.create(
            model=name, prompt="Hello there", max_tokens=7, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}))
    sizes = [len(c.choices[0].token_ids) for c in chunks if c.choices and c.choices[0].token_ids]
    # A chunk carries whole outputs (the writer sends together what is waiting when it
    # writes), so between the first and the last no chunk is smaller than the interval.
    assert sum(sizes) == 7 and all(size >= 3 for size in sizes[1:-1]), sizes
    assert [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])] == \
        whole.choices[0].token_ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


@pytest.mark.parametrize("value", [0, -2])
def test_a_stream_interval_below_one_is_refused_by_name(value: int) -> None:
    with pytest.raises(ConfigError) as info:
        engine.EngineConfig(stream_interval=value)
    assert info.value.field == "stream_interval"
