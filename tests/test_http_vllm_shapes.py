"""vLLM's answer shapes through the official openai client (raw HTTP where it hides a key).

What a client written against vLLM reads beyond OpenAI's fields: ``prompt_logprobs``,
``return_token_ids``, ``return_tokens_as_token_ids``, the chosen token among
``top_logprobs``, ``text_offset`` across an echo, usage on every chunk, the reasoning
under vLLM's key, forced calls cut short, ``/tokenize``'s token strings and
``/tokenizer_info``. Oracles: transformers (the tiny model's logits and tokenizer) and the
openai client's own parsing.

Three servers per module: the tiny llama with the default flags, the same with vLLM's
answer flags on (``--enable-prompt-tokens-details``, ``--enable-force-include-usage``,
``--return-tokens-as-token-ids``, ``--max-logprobs -1``,
``--enable-tokenizer-info-endpoint``), and a scripted fake engine for reasoning and calls.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from chat_fixtures import THINK_TEMPLATE, TOOLS, write_marker_model
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.chat.request import ChatSettings
from engine.models.testing import TINY_VOCAB_SIZE, write_tiny_model
from engine.models.tokenizer import Tokenizer

MODEL = "tiny-llama"
FLAGS = {"enable_prompt_tokens_details": True, "enable_force_include_usage": True,
         "return_tokens_as_token_ids": True, "max_logprobs": -1,
         "enable_tokenizer_info_endpoint": True}
PROMPT = "Hello world! This is a tiny language model"
GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def _open_engine(folder, **options):
    import engine.api

    return engine.api.open_engine(str(folder), served_model_name=MODEL, max_model_len=256,
                                  kv_cache_memory=32 * 2**20, **options)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def server(folder):
    with ServerThread(lambda: _open_engine(folder)) as srv:
        yield srv


@pytest.fixture(scope="module")
def flagged(folder):
    with ServerThread(lambda: _open_engine(folder, **FLAGS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf(folder):
    """transformers' model and tokenizer of the same folder: the oracle."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder)


def _client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _post(server, path, body):
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60)


def _hf_logprobs(hf, ids):
    """log_softmax of the logits at every position of ``ids`` (row i scores ids[i + 1])."""
    import torch

    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def _ids(server, text):
    return httpx.post(server.base_url + "/tokenize", json={"prompt": text}).json()["tokens"]


# -- usage ---------------------------------------------------------------------------------


def test_prompt_tokens_details_only_with_the_flag(server, flagged):
    long = PROMPT * 3  # over one 16-token block, so the second request hits the cache
    for srv in (server, flagged):
        client = _client(srv)
        first = client.completions.create(model=MODEL, prompt=long, **GREEDY)
        second = client.completions.create(model=MODEL, prompt=long, **GREEDY)
        if srv is server:
            assert first.usage.prompt_tokens_details is None
            assert second.usage.prompt_tokens_details is None
        else:
            assert second.usage.prompt_tokens_details.cached_tokens >= 16
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": long}], **GREEDY)
            assert chat.usage.prompt_tokens_details.cached_tokens >= 0


def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    for create, request in ((_client(server).completions.create, {"prompt": PROMPT}),
                            (_client(server).chat.completions.create,
                             {"messages": [{"role": "user", "content": PROMPT}]})):
        chunks = list(create(model=MODEL, stream=True, **request, **GREEDY, stream_options={
            "include_usage": True, "continuous_usage_stats": True}))
        *body, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 6
        prompt = last.usage.prompt_tokens
        counts = [c.usage.completion_tokens for c in body]
        assert all(c.usage.prompt_tokens == prompt for c in body)
        assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in body)
        assert counts == sorted(counts) and counts[-1] == 6
        # Without it, usage is null but on the last chunk.
        plain = list(create(model=MODEL, stream=True, **request, **GREEDY,
                            stream_options={"include_usage": True}))
        assert all(c.usage is None for c in plain[:-1])


def test_force_include_usage_puts_usage_on_every_chunk_as_vllm(server, flagged):
    # vLLM's --enable-force-include-usage acts as include_usage and continuous_usage_stats
    # both: usage on every chunk, and a final usage chunk.
    messages = [{"role": "user", "content": PROMPT}]
    for srv, forced in ((server, False), (flagged, True)):
        client = _client(srv)
        for create, request in ((client.completions.create, {"prompt": PROMPT}),
                                (client.chat.completions.create, {"messages": messages})):
            *body, last = list(create(model=MODEL, stream=True, **request, **GREEDY))
            if not forced:
                assert all(c.usage is None for c in [*body, last])
                continue
            assert last.choices == [] and last.usage.completion_tokens == 6
            prompt = last.usage.prompt_tokens
            assert body and all(c.usage is not None for c in body)
            counts = [c.usage.completion_tokens for c in body]
            assert all(c.usage.prompt_tokens == prompt for c in body)
            assert counts == sorted(counts) and counts[-1] == 6


# -- prompt_logprobs -----------------------------------------------------------------------


def _check_prompt_logprobs(scores, ids, hf, top):
    expected = _hf_logprobs(hf, ids)
    assert len(scores) == len(ids) and scores[0] is None
    for i, entry in enumerate(scores[1:], 1):
        row = expected[i - 1]
        chosen = entry[str(ids[i])]
        assert chosen["logprob"] == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert chosen["rank"] == int((row > row[ids[i]]).sum()) + 1
        best = row.topk(top).indices.tolist()
        # The prompt token, then the top alternatives with ranks 1..top.
        assert set(entry) == {str(ids[i]), *map(str, best)}
        for rank, t in enumerate(best, 1):
            if t != ids[i]:
                assert entry[str(t)]["rank"] == rank
                assert entry[str(t)]["logprob"] == pytest.approx(row[t].item(), abs=1e-4)


def test_prompt_logprobs_score_every_prompt_token(server, hf):
    ids = _ids(server, PROMPT)
    full = _client(server).completions.create(model=MODEL, prompt=PROMPT, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "prompt_logprobs": 2}})
    scores = full.choices[0].model_extra["prompt_logprobs"]
    _check_prompt_logprobs(scores, ids, hf, 2)
    _, tok = hf
    assert scores[1][str(ids[1])]["decoded_token"] == tok.decode([ids[1]])
    # Chat: one prompt, so the key sits at the top of the response.
    messages = [{"role": "user", "content": PROMPT}]
    chat = _client(server).chat.completions.create(model=MODEL, messages=messages, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "prompt_logprobs": 1}})
    chat_ids = httpx.post(server.base_url + "/tokenize", json={"messages": messages}).json()
    _check_prompt_logprobs(chat.model_extra["prompt_logprobs"], chat_ids["tokens"], hf, 1)


def test_prompt_logprobs_key_is_null_when_not_asked_and_refused_when_streaming(server):
    plain = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert chat["prompt_logprobs"] is None
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(server, path, {**body, "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# -- token ids -----------------------------------------------------------------------------


def test_return_token_ids_in_answers_and_chunks(server, hf):
    _, tok = hf
    client = _client(server)
    extra = {"ignore_eos": True, "return_token_ids": True}
    full = client.completions.create(model=MODEL, prompt=PROMPT, **{**GREEDY, "extra_body": extra})
    choice = full.choices[0].model_extra
    assert choice["prompt_token_ids"] == tok(PROMPT)["input_ids"]
    assert len(choice["token_ids"]) == 6 and tok.decode(choice["token_ids"]) == full.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            **{**GREEDY, "extra_body": extra}))
    firsts = [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks]
    assert firsts[0] == choice["prompt_token_ids"] and not any(firsts[1:])
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == choice["token_ids"]
    # Chat: the prompt's ids at the top of the answer (and of the first chunk).
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages,
                                          **{**GREEDY, "extra_body": extra})
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.model_extra["prompt_token_ids"] == tok(templated)["input_ids"]
    ids = chat.choices[0].model_extra["token_ids"]
    assert tok.decode(ids) == chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 **{**GREEDY, "extra_body": extra}))
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == ids
    # Not asked: null keys in a whole answer, no keys in chunks.
    plain = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()
    assert plain["choices"][0]["token_ids"] is None
    assert plain["choices"][0]["prompt_token_ids"] is None


def test_tokens_as_token_ids(server, flagged):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    # The server's default (off, on) and the request's own choice winning.
    for srv, asked, expected in ((server, None, False), (server, True, True),
                                 (flagged, None, True), (flagged, False, False)):
        request = dict(body) if asked is None else {**body, "return_tokens_as_token_ids": asked}
        choice = _post(srv, "/v1/completions", request).json()["choices"][0]
        tokens = choice["logprobs"]["tokens"]
        named = [f"token_id:{t}" for t in choice["token_ids"]]
        assert (tokens == named) is expected
        if expected:
            assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"]
                       for k in top)
    chat = _post(flagged, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "return_token_ids": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)


# -- logprobs as vLLM lists them -----------------------------------------------------------


def test_logprobs_0_names_the_chosen_token(server):
    full = _client(server).completions.create(model=MODEL, prompt=PROMPT, logprobs=0,
                                              **GREEDY)
    lp = full.choices[0].logprobs
    assert [dict(top) for top in lp.top_logprobs] == [
        {t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]
    chat = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, **GREEDY)
    assert all(item.top_logprobs == [] for item in chat.choices[0].logprobs.content)


def test_top_logprobs_hold_the_sampled_token_first(flagged, hf):
    """Sampled at temperature 1: the chosen token is often not the most likely, and the
    entries are vLLM's: the chosen one, then the most likely others (transformers'
    logits), N + 1 at most for completions, N for chat."""
    ids = _ids(flagged, PROMPT)
    off_top = 0
    for seed in range(4):
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": seed,
                "logprobs": 2, "return_token_ids": True, "ignore_eos": True}
        choice = _post(flagged, "/v1/completions", body).json()["choices"][0]
        out = choice["token_ids"]
        rows = _hf_logprobs(hf, ids + out)[len(ids) - 1:]
        for k, (token, top) in enumerate(zip(out, choice["logprobs"]["top_logprobs"],
                                             strict=True)):
            best = rows[k].topk(2).indices.tolist()
            keys = [int(key.removeprefix("token_id:")) for key in top]
            assert keys[0] == token
            assert keys[1:] == [t for t in best if t != token]
            assert all(top[f"token_id:{t}"] == pytest.approx(rows[k][t].item(), abs=1e-4)
                       for t in keys)
            off_top += token not in best
        chat = _post(flagged, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 1.0, "seed": seed, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True}).json()["choices"][0]
        for item in chat["logprobs"]["content"]:
            assert len(item["top_logprobs"]) == 2
            assert item["top_logprobs"][0] == {k: item[k] for k in ("token", "logprob", "bytes")}
    assert off_top > 0  # the case that tells vLLM's order from OpenAI's was exercised


def test_top_logprobs_minus_1_where_the_server_allows_it(server, flagged):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": -1}
    every = _post(flagged, "/v1/chat/completions", body).json()["choices"][0]
    for item in every["logprobs"]["content"]:
        assert len(item["top_logprobs"]) == TINY_VOCAB_SIZE
        assert len({t["token"] for t in item["top_logprobs"]}) == TINY_VOCAB_SIZE
    refused = _post(server, "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    over = _post(server, "/v1/completions", {"prompt": "hi", "logprobs": 21})
    assert over.status_code == 400 and "--max-logprobs" in over.json()["error"]["message"]
    assert _post(flagged, "/v1/completions", {"prompt": "hi", "logprobs": 21}).status_code == 200


# -- /inference/v1/generate -----------------------------------------------------------------


def _generate(server, ids, **sampling):
    r = httpx.post(server.base_url + "/inference/v1/generate", timeout=60, json={
        "model": MODEL, "token_ids": ids, "sampling_params": sampling})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return choice


def test_generate_route_top_logprobs_hold_max_n_1_entries(server, hf):
    """vLLM's tokens-only logprobs: tokens named token_id:N, and max(logprobs, 1) entries,
    the chosen token first (transformers' logits are the oracle)."""
    ids = _ids(server, PROMPT)
    for n in (0, 1, 3):
        choice = _generate(server, ids, temperature=0, max_tokens=4, ignore_eos=True,
                           logprobs=n)
        rows = _hf_logprobs(hf, ids + choice["token_ids"])[len(ids) - 1:]
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
        for k, item in enumerate(content):
            top = item["top_logprobs"]
            assert len(top) == max(n, 1)
            # Greedy: the chosen token is the most likely, so the entries are the best ones.
            assert [t["token"] for t in top] == [
                f"token_id:{t}" for t in rows[k].topk(max(n, 1)).indices.tolist()]
            assert top[0]["logprob"] == item["logprob"] == pytest.approx(
                rows[k].max().item(), abs=1e-4)
    assert _generate(server, ids, max_tokens=2)["logprobs"] is None


def test_generate_route_without_max_tokens_fills_the_context(server):
    ids = _ids(server, PROMPT)
    choice = _generate(server, ids, temperature=0, ignore_eos=True)
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 256 - len(ids)  # the server's max_model_len


def _sse(response):
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_generate_route_streams_the_same_tokens(server):
    ids = _ids(server, PROMPT)
    sampling = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 1}
    whole = _generate(server, ids, **sampling)
    r = httpx.post(server.base_url + "/inference/v1/generate", timeout=60, json={
        "model": MODEL, "token_ids": ids, "sampling_params": sampling, "request_id": "g-1",
        "stream": True, "stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *chunks, last = _sse(r)
    assert all(c["request_id"] == last["request_id"] == "g-1" for c in chunks)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert [i for c in chunks for i in c["choices"][0]["logprobs"]["content"]] == \
        whole["logprobs"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert [c["usage"]["completion_tokens"] for c in chunks] == list(range(1, 7))
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6}
    # Without stream_options: no usage anywhere.
    plain = _sse(httpx.post(server.base_url + "/inference/v1/generate", timeout=60, json={
        "model": MODEL, "token_ids": ids, "sampling_params": sampling, "stream": True}))
    assert all(c["usage"] is None and c["choices"] for c in plain)


# -- echo ----------------------------------------------------------------------------------


def test_an_echoed_token_id_prompt_keeps_its_special_tokens(server, hf):
    _, tok = hf
    ids = tok("<|im_start|>user\nHello<|im_end|>")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) != tok.decode(ids)  # specials in it
    plain = _client(server).completions.create(model=MODEL, prompt=ids, **GREEDY)
    echoed = _client(server).completions.create(model=MODEL, prompt=ids, echo=True, **GREEDY)
    assert echoed.choices[0].text == tok.decode(ids) + plain.choices[0].text
    chunks = list(_client(server).completions.create(model=MODEL, prompt=ids, echo=True,
                                                     stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_text_offset_keeps_counting_after_an_echo(server, hf):
    _, tok = hf
    ids = tok("<|im_start|>" + PROMPT)["input_ids"]
    client = _client(server)
    full = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, **GREEDY)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 6
    assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    # One running count over every token's text, the echoed prompt's then the output's.
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == full.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1,
                                            stream=True, **GREEDY))
    assert [o for c in chunks if c.choices and c.choices[0].logprobs
            for o in c.choices[0].logprobs.text_offset] == lp.text_offset


# -- tokenizer routes ----------------------------------------------------------------------


def test_tokenize_returns_token_strs(server, hf):
    _, tok = hf
    body = httpx.post(server.base_url + "/tokenize",
                      json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    plain = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()
    assert plain["token_strs"] is None


def test_tokenizer_info_with_its_flag(server, flagged, folder):
    assert httpx.get(server.base_url + "/tokenizer_info").status_code == 404
    info = httpx.get(flagged.base_url + "/tokenizer_info").json()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert info["chat_template"] == Tokenizer.from_folder(folder).chat_template
    assert info["eos_token"] == config["eos_token"]
    assert isinstance(info["tokenizer_class"], str)
    paths = {srv: httpx.get(srv.base_url + "/openapi.json").json()["paths"]
             for srv in (server, flagged)}
    assert "/tokenizer_info" in paths[flagged] and "/tokenizer_info" not in paths[server]


# -- reasoning and forced calls (scripted) ---------------------------------------------------


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    folder = write_marker_model(tmp_path_factory.mktemp("tools") / "m", THINK_TEMPLATE)
    tokenizer = Tokenizer.from_folder(folder)
    settings = ChatSettings(tool_call_parser="hermes", enable_auto_tool_choice=True,
                            reasoning_parser="qwen3")
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=MODEL,
                                               max_model_len=1024), chat=settings) as srv:
        yield srv


ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>')


def test_reasoning_under_vllms_key_and_the_old_one(scripted):
    scripted.engine.script = "<think>\nParis is in France.\n</think>\n\nIt rains."
    client = _client(scripted)
    full = client.chat.completions.create(model=MODEL, messages=ASK)
    message = full.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] \
        == "\nParis is in France.\n"
    assert message.content == "\n\nIt rains."  # everything after </think>
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True))
    deltas = [c.choices[0].delta.model_extra for c in chunks if c.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message.model_extra["reasoning"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_a_forced_call_cut_short_is_no_call(scripted):
    scripted.engine.script = CALL
    client = _client(scripted)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        cut = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                             tool_choice=choice, max_completion_tokens=4)
        (answer,) = cut.choices
        assert answer.finish_reason == "length"
        assert answer.message.content == ""  # as vLLM: empty, not null, for a forced call
        assert answer.message.tool_calls == []  # no fragment of the markup as a call


def test_a_forced_call_cut_short_streams_what_the_message_says(scripted):
    """Streamed, a required list cut anywhere by max_tokens sends no call markup as
    content (it sent '<tool_call>' text at the end): its content adds up to the whole
    answer's, and its calls' names to the whole answer's finished calls."""
    scripted.engine.script = CALL + "\n" + CALL
    client = _client(scripted)
    first = len(scripted.engine.tokenizer.encode(CALL + "\n", add_special_tokens=False))
    # Inside the first call, and at the second's opening markup and its name.
    for limit in (3, first + 1, first + 3, first + 8):
        args = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                    max_completion_tokens=limit)
        (whole,) = client.chat.completions.create(**args).choices
        assert whole.finish_reason == "length"
        chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True)
                  if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == whole.message.content == ""
        names = [t.function.name for c in chunks for t in c.delta.tool_calls or ()
                 if t.function and t.function.name]
        assert names[:len(whole.message.tool_calls)] == [
            t.function.name for t in whole.message.tool_calls]


def test_a_named_call_ends_with_stop_and_required_with_tool_calls(scripted):
    """OpenAI's and vLLM's finish for a call that ended on its own: "stop" under a named
    tool_choice, "tool_calls" under required; streamed or not."""
    client = _client(scripted)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, script, ended in ((named, '{"city": "Paris", "unit": "celsius"}', "stop"),
                                  ("required", CALL, "tool_calls")):
        scripted.engine.script = script
        whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                               tool_choice=choice)
        (answer,) = whole.choices
        assert answer.finish_reason == ended
        assert [c.function.name for c in answer.message.tool_calls] == ["get_weather"]
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                     tool_choice=choice, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ended


@pytest.mark.parametrize("constrained", [False, True])
def test_a_required_list_cut_short_keeps_only_finished_calls(constrained):
    """The output parser on its own (what the HTTP answer and the embedded chat API read):
    cut short, a required list keeps the calls that finished and drops the one the limit
    cut, and no markup comes back as content; not cut short, nothing changes."""
    from engine.chat.output import ChatOutputOptions, ChatOutputParser
    from engine.chat.tool_parsers import get_tool_parser
    from engine.chat.tools import ToolChoice, parse_tools

    options = ChatOutputOptions(tools=parse_tools(TOOLS), tool_choice=ToolChoice("required"),
                                tool_parser=get_tool_parser("hermes"),
                                forced_in_parser_syntax=True)
    for text, finished in ((CALL[:30], 0), (CALL[:60], 0), (CALL + "\n" + CALL[:40], 1)):
        parser = ChatOutputParser(options, constrained=constrained)
        parser.feed(text)
        parser.finish()
        message = parser.message(cut_short=True)
        assert message.content is None
        assert [json.loads(c.arguments) for c in message.tool_calls] == [
            {"city": "Paris", "unit": "celsius"}] * finished
    whole = ChatOutputParser(options, constrained=constrained)
    whole.feed(CALL)
    whole.finish()
    assert len(whole.message(cut_short=True).tool_calls) == 1
