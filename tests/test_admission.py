"""Admission (engine/core/admission.py) on its own: no trio, no engine, the real tokenizer
of the tiny model as the oracle of tokenization."""

from __future__ import annotations

import pytest
from text_fixtures import tiny_folder

from engine.chat.template import ChatTokenizer, apply_chat_template
from engine.core.admission import (
    AdmissionLimits,
    admit,
    prompt_chars,
    prompt_token_ids,
    sample_ids,
    submit_request,
)
from engine.errors import InvalidParamError, PromptTooLongError, QueueFullError
from engine.messages import ChatPrompt, TextPrompt, TokensPrompt, pack, unpack
from engine.models.tokenizer import Tokenizer
from engine.params import SamplingParams

LIMITS = AdmissionLimits(max_model_len=32, vocab_size=300, max_queued_requests=4, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(tiny_folder(tmp_path_factory.mktemp("admission")))


def _submit(prompt: object = (5, 6, 7), params: SamplingParams | None = None, **kw: object):
    args: dict[str, object] = dict(request_id="r", priority=0, cache_salt=None, arrival_time=1.5)
    args.update(kw)
    return submit_request(prompt, params, **args)  # type: ignore[arg-type]


def test_the_three_prompt_shapes_become_prompt_messages() -> None:
    assert _submit("hi").prompt == TextPrompt("hi")
    assert _submit([1, 2]).prompt == TokensPrompt((1, 2))
    chat = _submit([{"role": "user", "content": "hi"}]).prompt
    assert isinstance(chat, ChatPrompt) and '"content": "hi"' in chat.messages_json
    assert _submit([1, 2]).params == SamplingParams()  # None: the defaults


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(prompt=object()), "prompt"),
        (dict(prompt=[1, True]), "prompt"),
        (dict(prompt=[{"role": "user", "content": object()}]), "messages"),
        (dict(params={"max_tokens": 3}), "params"),
        (dict(priority="1"), "priority"),
        (dict(priority=True), "priority"),
        (dict(cache_salt=5), "cache_salt"),
    ],
)
def test_bad_arguments_name_their_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParamError) as info:
        _submit(**kwargs)
    assert info.value.param == param


def test_tokenization_matches_the_tokenizer(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello world!"}]
    rendered = apply_chat_template(tok, messages, add_generation_prompt=True)
    assert prompt_token_ids(tok, _submit("Hello").prompt) == tuple(tok.encode("Hello"))
    assert prompt_token_ids(ChatTokenizer(tok), _submit(messages).prompt) == tuple(
        tok.encode(rendered, add_special_tokens=False)
    )
    assert prompt_token_ids(tok, _submit([9, 8]).prompt) == (9, 8)
    assert prompt_chars(_submit("Hello").prompt) == 5 and prompt_chars(_submit([1]).prompt) == 0


@pytest.mark.parametrize(("prompt", "param"), [("a\ud800b", "prompt"),
                                                ([{"role": "user", "content": "x\udfff"}], "messages")])
def test_a_lone_surrogate_is_the_request_error(tok: Tokenizer, prompt: object, param: str) -> None:
    with pytest.raises(InvalidParamError) as info:
        prompt_token_ids(ChatTokenizer(tok), _submit(prompt).prompt)
    assert info.value.param == param


def test_one_sample_keeps_the_request_id_and_resolves_max_tokens() -> None:
    admitted = admit(_submit(params=SamplingParams(max_tokens=None)), (5, 6, 7), LIMITS,
                     waiting=0, serial=7)
    assert admitted.request_id == "r" and admitted.sample_ids == ("r#7",)
    (sample,) = admitted.samples
    assert (sample.max_tokens, sample.eos_token_ids, sample.wait_for) == (29, (2,), None)
    assert (sample.arrival_time, sample.priority) == (1.5, 0)
    (out,) = admitted.outputs
    assert (out.sample_id, out.request_id, out.index, out.prompt_token_ids) == ("r#7", "r", 0, (5, 6, 7))
    assert unpack(pack(admitted)) == admitted  # it is a message: packable


def test_n_samples_get_their_own_ids_and_seeds_and_wait_for_the_first() -> None:
    params = SamplingParams(n=3, seed=2**63 - 2, max_tokens=4)
    admitted = admit(_submit(params=params), (5, 6), LIMITS, waiting=0, serial=4)
    assert admitted.sample_ids == sample_ids("r", 3, 4) == ("r#4.0", "r#4.1", "r#4.2")
    assert [s.params.seed for s in admitted.samples] == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert all(s.params.n == 1 for s in admitted.samples)
    assert [s.wait_for for s in admitted.samples] == [None, "r#4.0", "r#4.0"]
    assert [(o.request_id, o.index) for o in admitted.outputs] == [("r", 0), ("r", 1), ("r", 2)]
    # With prompt logprobs every sample computes and scores the prompt itself.
    scored = admit(_submit(params=params.replace(prompt_logprobs=0)), (5, 6), LIMITS, waiting=0, serial=0)
    assert [s.wait_for for s in scored.samples] == [None, None, None]


def test_limits_raise_the_request_errors() -> None:
    with pytest.raises(QueueFullError):
        admit(_submit(), (5,), LIMITS, waiting=4, serial=0)
    with pytest.raises(InvalidParamError, match="empty"):
        admit(_submit(), (), LIMITS, waiting=0, serial=0)
    with pytest.raises(InvalidParamError, match="outside the vocabulary") as bad:
        admit(_submit(), (5, 300), LIMITS, waiting=0, serial=0)
    assert bad.value.param == "prompt"
    with pytest.raises(InvalidParamError) as bias:
        admit(_submit(params=SamplingParams(logit_bias={300: 1.0})), (5,), LIMITS, waiting=0, serial=0)
    assert bias.value.param == "logit_bias"
    with pytest.raises(PromptTooLongError) as too_long:
        admit(_submit(params=SamplingParams(max_tokens=4)), tuple(range(3, 32)), LIMITS, waiting=0, serial=0)
    assert (too_long.value.prompt_tokens, too_long.value.max_tokens, too_long.value.max_model_len) == (29, 4, 32)
    with pytest.raises(PromptTooLongError):  # no room left for even one token
        admit(_submit(params=SamplingParams(max_tokens=None)), tuple(range(3, 35)), LIMITS, waiting=0, serial=0)
    # Exactly full is fine.
    assert admit(_submit(params=SamplingParams(max_tokens=3)), tuple(range(3, 32)), LIMITS,
                 waiting=3, serial=0).samples[0].max_tokens == 3


def test_a_text_too_long_for_any_tokenization_to_fit_is_refused_untokenized(tok) -> None:
    limit = 4 * LIMITS.max_model_len * tok.max_token_chars
    # Just under the bound: tokenized (and then too long for admit, with its token count).
    ids = prompt_token_ids(tok, TextPrompt("a " * (limit // 2)), max_model_len=32)
    assert ids == tuple(tok.encode("a " * (limit // 2))) and len(ids) > 32
    with pytest.raises(PromptTooLongError, match="characters") as info:
        prompt_token_ids(tok, TextPrompt("a " * (limit // 2 + 1)), max_model_len=32)
    assert info.value.max_model_len == 32
    # The bound is sound: no vocabulary entry is longer than max_token_chars.
    assert all(len(t) <= tok.max_token_chars
               for t in tok.backend_tokenizer.get_vocab(with_added_tokens=True))


def test_a_long_text_tokenizes_the_same_through_the_gil_releasing_path(tok) -> None:
    text = "Hello, world! " * 2000  # over the length where encode switches paths
    assert tok.encode(text) == tok.backend_tokenizer.encode(text).ids
    assert tok.encode(text, add_special_tokens=False) == tok.backend_tokenizer.encode(
        text, add_special_tokens=False).ids
