"""vLLM's sampling surface beyond the basics, through the official openai client: best_of,
fill-in-the-middle (suffix), allowed_token_ids and bad_words, truncate_prompt_tokens,
include_reasoning: false; and spaces_between_special_tokens through the embedded API.

One server on a tiny qwen2 whose tokenizer holds Qwen2.5-Coder's FIM tokens and the
<think> markers (as single added tokens), served with --reasoning-parser deepseek_r1. The
oracles: the same samples drawn one by one (best_of), transformers' tokenizer (the FIM
layout, left truncation, chat templates, decode), and the token ids each answer returns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from chat_fixtures import THINK_TEMPLATE, marker_id, write_marker_model
from http_server import ServerThread

import engine
from engine.chat.request import ChatSettings
from engine.params import SamplingParams

MODEL = "tiny-sampling"
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
MARKERS = (*FIM, "<think>", "</think>")
PROMPT = "Continuous batching lets new requests join"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_marker_model(tmp_path_factory.mktemp("sampling") / "m", THINK_TEMPLATE, MARKERS)


@pytest.fixture(scope="module")
def hf(folder: Path) -> Any:
    # The folder's tokenizer.json as transformers reads it (AutoTokenizer would rebuild a
    # Qwen2 tokenizer with Qwen2's own pre-tokenizer, not this tiny one's).
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


@pytest.fixture(scope="module")
def server(folder: Path) -> Any:
    # 125 samples of a request run in one step (max_num_seqs 128).
    with ServerThread(lambda: engine.open_engine(
            str(folder), served_model_name=MODEL, dtype="float32", max_model_len=512,
            max_num_seqs=128, kv_cache_memory=32 * 2**20),
            chat=ChatSettings(reasoning_parser="deepseek_r1")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def _complete(client: Any, **kwargs: Any) -> Any:
    extra = kwargs.pop("extra_body", {})
    return client.completions.create(model=MODEL, extra_body={"return_token_ids": True, **extra},
                                     **kwargs)


def _contains(seq: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(word)]) == word for i in range(len(seq) - len(word) + 1))


# -- allowed_token_ids and bad_words ---------------------------------------------------------


def test_allowed_token_ids_and_bad_words_hold_over_a_thousand_seeded_samples(client, hf):
    # A one-token word and a two-token one, spelled as the tokenizer spells them; four
    # allowed tokens make both likely in every sample unless banned (the control shows it).
    def ids(text: str) -> tuple[int, ...]:
        return tuple(hf.encode(text, add_special_tokens=False))

    single = next(w for w in ("The", "is", "in", "es") if len(ids(w)) == 1)
    pair = next(w for w in ("dog", "fox", "Paged", "unicode") if len(ids(w)) == 2)
    a, b = ids(pair)
    other = next(t for t in ids(" quick brown lazy") if t not in (a, b, *ids(single)))
    allowed = [ids(single)[0], a, b, other]
    # What each word bans: the word as the text starts it, and after a space where that is
    # another first token in as many tokens (vLLM's reading), here seen by transformers.
    banned = [ids(w) for w in (single, pair)] + [
        ids(" " + w) for w in (single, pair) if len(ids(" " + w)) == len(ids(w))]
    body = {"allowed_token_ids": allowed, "bad_words": [single, pair]}

    control = _complete(client, prompt=PROMPT, n=32, max_tokens=8, seed=1,
                        extra_body={"allowed_token_ids": allowed})
    seen = [c.token_ids for c in control.choices]
    assert any(ids(single)[0] in s for s in seen) and any(_contains(s, (a, b)) for s in seen)

    samples = []
    for request in range(8):  # 8 x 125 samples, each seeded (seed + its index)
        reply = _complete(client, prompt=PROMPT, n=125, max_tokens=8, seed=1000 * request,
                          extra_body=body)
        samples += [c.token_ids for c in reply.choices]
    assert len(samples) == 1000
    for s in samples:
        assert len(s) == 8 and set(s) <= set(allowed), s
        assert not any(_contains(s, word) for word in banned), s
    # Every allowed token the words leave is still drawn.
    assert {t for s in samples for t in s} == {a, b, other}


def test_bad_words_and_allowed_token_ids_combine_with_structured_output(client):
    reply = client.completions.create(
        model=MODEL, prompt="Is it?", max_tokens=4, seed=3,
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}, "bad_words": ["yes"]})
    assert reply.choices[0].text == " no"


def test_an_allowed_token_outside_the_vocabulary_or_an_empty_list_is_a_400(client):
    for value in ([10**6], []):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                      extra_body={"allowed_token_ids": value})
        assert info.value.body["param"] == "allowed_token_ids"


# -- best_of ----------------------------------------------------------------------------------


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(client):
    best_of, n, seed = 5, 2, 11
    reply = _complete(client, prompt=PROMPT, n=n, max_tokens=6, seed=seed,
                      extra_body={"best_of": best_of})
    # The oracle: the same samples drawn one at a time (sample i is seeded seed + i).
    singles = [_complete(client, prompt=PROMPT, max_tokens=6, seed=seed + i, logprobs=0)
               for i in range(best_of)]
    score = [sum(s.choices[0].logprobs.token_logprobs) for s in singles]
    best = sorted(range(best_of), key=lambda i: (-score[i], i))[:n]
    assert [c.token_ids for c in reply.choices] == [singles[i].choices[0].token_ids for i in best]
    assert [c.text for c in reply.choices] == [singles[i].choices[0].text for i in best]
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.logprobs is None for c in reply.choices)  # not asked for
    # Usage counts every sample drawn, as OpenAI bills best_of.
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens


@pytest.mark.parametrize(("change", "why"), [
    ({"best_of": 3, "stream": True}, "stream"), ({"best_of": 1, "n": 2}, "greater than"),
    ({"best_of": 129}, "128")])
def test_best_of_that_cannot_be_honoured_is_a_400(server, change, why):
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2, **change})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "best_of" and why in r.json()["error"]["message"]


# -- fill in the middle -----------------------------------------------------------------------


def test_a_suffix_lays_the_prompt_out_in_the_tokenizers_fim_tokens(client, hf):
    before, after = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    reply = _complete(client, prompt=before, suffix=after, max_tokens=5, temperature=0)
    # Qwen2.5-Coder's documented layout, as its tokenizer reads it.
    layout = hf.encode(f"{FIM[0]}{before}{FIM[1]}{after}{FIM[2]}")
    assert reply.choices[0].prompt_token_ids == layout
    plain = _complete(client, prompt=layout, max_tokens=5, temperature=0)
    assert reply.choices[0].token_ids == plain.choices[0].token_ids
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=before, suffix=after, echo=True,
                                  max_tokens=1)
    assert info.value.body["param"] == "suffix"


# -- truncate_prompt_tokens -------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens_as_vllm_truncates(client, hf):
    text = PROMPT + " while others are decoding, in fixed size blocks."
    hf.truncation_side = "left"  # vLLM's side
    kept = hf(text, truncation=True, max_length=6)["input_ids"]
    for prompt in (text, hf.encode(text)):
        reply = _complete(client, prompt=prompt, max_tokens=4, temperature=0,
                          extra_body={"truncate_prompt_tokens": 6})
        assert reply.choices[0].prompt_token_ids == kept
        assert reply.usage.prompt_tokens == 6
        alone = _complete(client, prompt=kept, max_tokens=4, temperature=0)
        assert reply.choices[0].token_ids == alone.choices[0].token_ids
    messages = [{"role": "user", "content": text}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 9,
                                                      "return_token_ids": True})
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    assert chat.model_extra["prompt_token_ids"] == rendered[-9:]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=text, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 513})
    assert info.value.body["param"] == "truncate_prompt_tokens"


def test_truncation_side_right_keeps_the_first_tokens_as_the_tokenizer_does(client, hf):
    text = PROMPT + " while others are decoding, in fixed size blocks."
    side = hf.truncation_side
    hf.truncation_side = "right"
    try:
        kept = hf(text, truncation=True, max_length=6)["input_ids"]
    finally:
        hf.truncation_side = side
    assert kept != hf(text)["input_ids"][-6:]  # the two sides differ on this text
    for prompt in (text, hf.encode(text)):
        reply = _complete(client, prompt=prompt, max_tokens=4, temperature=0, extra_body={
            "truncate_prompt_tokens": 6, "truncation_side": "right"})
        assert reply.choices[0].prompt_token_ids == kept
        alone = _complete(client, prompt=kept, max_tokens=4, temperature=0)
        assert reply.choices[0].token_ids == alone.choices[0].token_ids
    messages = [{"role": "user", "content": text}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 9,
                                                      "truncation_side": "right",
                                                      "return_token_ids": True})
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    assert chat.model_extra["prompt_token_ids"] == rendered[:9]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=text, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 6,
                                              "truncation_side": "middle"})
    assert info.value.body["param"] == "truncation_side"


# -- include_reasoning ------------------------------------------------------------------------


def test_include_reasoning_false_parses_the_reasoning_off_and_drops_it(client, hf):
    end = marker_id(hf, "</think>")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
           "max_tokens": 12, "seed": 5, "logit_bias": {str(end): 4.0}}
    kept = client.chat.completions.create(**ask, extra_body={"return_token_ids": True})
    dropped = client.chat.completions.create(**ask, extra_body={"include_reasoning": False,
                                                                "return_token_ids": True})
    ids = kept.choices[0].token_ids
    assert dropped.choices[0].token_ids == ids and end in ids
    # The template opened <think>: what the model wrote up to </think> is reasoning.
    reasoning, content = hf.decode(ids, skip_special_tokens=True).split("</think>", 1)
    assert kept.choices[0].message.model_extra["reasoning"] == reasoning
    assert (kept.choices[0].message.content or "") == content
    assert dropped.choices[0].message.model_extra.get("reasoning") is None
    assert dropped.choices[0].message.content == kept.choices[0].message.content
    stream = client.chat.completions.create(**ask, stream=True,
                                            extra_body={"include_reasoning": False})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert not any((d.model_extra or {}).get("reasoning") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == (kept.choices[0].message.content or "")


# -- logits processors' arguments -------------------------------------------------------------


def test_vllm_xargs_without_logits_processors_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"vllm_xargs": {"ban": 3}})
    assert info.value.body["param"] == "vllm_xargs"
    assert "--logits-processors" in info.value.body["message"]


def test_no_block_leaks_after_the_sampling_surface(server):
    stats = server.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0


# -- spaces_between_special_tokens (embedded API) ---------------------------------------------


def _wordpiece_model(path: Path) -> Path:
    """A tiny llama whose tokenizer is WordPiece, whose decoder puts a space between
    tokens (special ones included): where spaces_between_special_tokens shows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engine.models.testing import write_tiny_model

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=160, show_progress=False,
        special_tokens=["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer)
    write_tiny_model(path, "llama", overrides={"vocab_size": tok.get_vocab_size()})
    (path / "tokenizer.json").write_text(tok.to_str())
    return path


async def test_spaces_between_special_tokens_false_writes_adjacent_special_tokens_together(
        tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = _wordpiece_model(tmp_path / "wp")
    hf = AutoTokenizer.from_pretrained(path)
    specials = [hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>")]
    words = hf.encode("fox dog", add_special_tokens=False)
    added = set(hf.added_tokens_decoder)

    def tight(ids: list[int]) -> str:
        # The tokenizer's own decode of each run, cut before a special token that follows
        # a special token: nothing between those two.
        cuts = [0, *(i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added),
                len(ids)]
        return "".join(hf.decode(ids[a:b], skip_special_tokens=False)
                       for a, b in zip(cuts, cuts[1:], strict=False))

    async with engine.open_engine(str(path), dtype="float32", kv_cache_memory=8 * 2**20) as eng:
        adjacent = 0
        for seed in range(3):
            texts = {}
            for spaces in (True, False):
                params = SamplingParams(max_tokens=12, seed=seed, ignore_eos=True,
                                        skip_special_tokens=False, allowed_token_ids=[
                                            *specials, *words],
                                        spaces_between_special_tokens=spaces)
                stream = await eng.submit("the quick brown", params)
                async with stream:
                    outs = [o async for o in stream]
                ids = [t for o in outs for t in o.token_ids]
                texts[spaces] = ("".join(o.text for o in outs), ids)
                prompt = list(stream.prompt_token_ids)
            (default, ids), (without, same) = texts[True], texts[False]
            assert same == ids
            # The output's text continues the prompt's (a WordPiece word after it starts
            # with its space).
            plain = hf.decode(prompt, skip_special_tokens=False)
            assert default == hf.decode(prompt + ids, skip_special_tokens=False)[len(plain):]
            assert without == tight(prompt + ids)[len(plain):]
            adjacent += without != default
        assert adjacent  # some sample put two special tokens side by side


def test_bad_words_are_read_as_vllm_reads_them():
    from engine.core.admission import bad_words_token_ids

    vocab = {"Paris": [1], " Paris": [2], "New York": [3, 4], " New York": [5, 4],
             "ab": [6, 7], " ab": [8, 9, 7]}

    def encode(text: str) -> list[int]:
        return vocab[text]

    # " Paris" is another word token: banned too; " ab" is three tokens: not taken.
    assert bad_words_token_ids(encode, ["Paris", "  New York", "ab"]) == (
        (1,), (2,), (3, 4), (5, 4), (6, 7))


def test_logits_processor_arguments_are_json_values_that_cross_to_a_core_as_sent():
    from engine.messages import pack, unpack

    for bad in ({"f": object()}, {"a": [{"__msg__": "SamplingParams"}]}):
        with pytest.raises(engine.InvalidParamError) as info:
            SamplingParams(extra_args=bad)
        assert info.value.param == "extra_args"
    params = SamplingParams(extra_args={"ban": [1, 2], "k": {"x": None}}, bad_words=["a b"],
                            bad_words_token_ids=[[3, 4]], allowed_token_ids=[5],
                            truncate_prompt_tokens=-1, spaces_between_special_tokens=False)
    back = unpack(pack(params))
    assert back == params.replace(extra_args={"ban": (1, 2), "k": {"x": None}})
    assert json.loads(json.dumps(back.extra_args)) == {"ban": [1, 2], "k": {"x": None}}


async def test_the_masks_under_prompt_lookup_give_the_plain_outputs(tmp_path: Path) -> None:
    """Speculative proposals copy the prompt's phrase, bigram and all: each verified row is
    masked after the proposal tokens before it, so what comes out is what the plain
    engine writes, greedy and seeded alike."""
    from engine.models.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "t", "llama")
    phrase = [40, 41, 42, 43, 44]
    asks = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                       allowed_token_ids=[*phrase, 45], bad_words_token_ids=((42, 43),)),
        SamplingParams(n=3, seed=4, max_tokens=16, ignore_eos=True, allowed_token_ids=phrase,
                       bad_words_token_ids=((41,), (43, 44))),
    ]
    options: dict[str, Any] = dict(dtype="float32", kv_cache_memory=8 * 2**20)
    outputs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4,
                        "prompt_lookup_max": 3, "prompt_lookup_min": 1}):
        async with engine.open_engine(str(path), speculative_config=spec, **options) as eng:
            runs = []
            for params in asks:
                stream = await eng.submit(phrase * 4, params)
                async with stream:
                    outs = [o async for o in stream]
                runs.append([[t for o in outs if o.index == i for t in o.token_ids]
                             for i in range(params.n)])
            outputs.append(runs)
            stats = eng.statistics()
    assert stats.spec_drafts > 0
    assert outputs[0] == outputs[1]
    (greedy_run,), sampled = outputs[1]
    assert not _contains(greedy_run, (42, 43))
    for s in sampled:
        assert 41 not in s and not _contains(s, (43, 44)) and set(s) <= set(phrase)
