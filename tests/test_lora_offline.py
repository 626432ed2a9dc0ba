"""The offline ``engine.LLM`` with LoRA adapters beyond ``generate`` (tests/test_lora.py
has that one): ``chat`` and ``beam_search`` take vLLM's ``lora_request``; the pooling
methods, whose models never take adapters (``--enable-lora`` is refused for them), refuse
it by name.

The oracle for ``chat``: transformers' own rendering of the model's chat template
(``apply_chat_template``), generated from as token ids with the same adapter; for
``beam_search``, peft's ``PeftModel`` searching with transformers' ``generate(num_beams=...)``.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_lora import write_peft_adapters

import engine
from engine.errors import InvalidParamError
from engine.models.testing import write_tiny_model
from engine.params import SamplingParams

CONVERSATIONS = [[{"role": "user", "content": "hello world"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick brown fox"}]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-offline")
    base = write_tiny_model(root / "base", "llama")
    write_peft_adapters(base, root, {"aa": dict(r=8, lora_alpha=16)}, seed=9)
    llm = engine.LLM(str(base), dtype="float32", enable_lora=True, kv_cache_memory=2**24)
    yield llm, base, types.SimpleNamespace(lora_name="aa", lora_int_id=1, lora_path=str(root / "aa"))
    llm.close()


def test_chat_with_an_adapter_is_generate_on_the_templated_prompt(llm) -> None:
    from transformers import AutoTokenizer

    model, base, request = llm
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tok = AutoTokenizer.from_pretrained(base)
    rendered = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVERSATIONS]
    ids = [tok(r, add_special_tokens=False).input_ids for r in rendered]
    chat = model.chat(CONVERSATIONS, params, lora_request=request, use_tqdm=False)
    plain = model.generate([{"prompt_token_ids": i} for i in ids], params, lora_request=request, use_tqdm=False)
    base_chat = model.chat(CONVERSATIONS, params, use_tqdm=False)
    for c, p, b, r in zip(chat, plain, base_chat, rendered, strict=True):
        assert c.prompt == r
        assert c.outputs[0].token_ids == p.outputs[0].token_ids
        assert c.outputs[0].token_ids != b.outputs[0].token_ids  # the adapter changes the reply
    # One adapter per conversation, the base for the other.
    mixed = model.chat(CONVERSATIONS, params, lora_request=[request, None], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == chat[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == base_chat[1].outputs[0].token_ids


def test_classify_refuses_lora_request_by_name(llm) -> None:
    model, _, request = llm
    with pytest.raises(InvalidParamError, match="lora_request") as info:
        model.classify("hello", lora_request=request)
    assert info.value.param == "lora_request"


@pytest.mark.parametrize("method", ["embed", "score"])
def test_embed_or_score_with_an_adapter_on_a_generation_model_names_the_model(llm, method) -> None:
    # Adapters embed and score with a decoder embedder (tests/test_pooling.py); this
    # model generates.
    model, _, request = llm
    call = {"embed": lambda: model.embed("hello", lora_request=request),
            "score": lambda: model.score("hello", "world", lora_request=request)}[method]
    with pytest.raises(InvalidParamError, match="does not") as info:
        call()
    assert info.value.param == "model"


def test_beam_search_with_an_adapter_finds_peft_beams(llm, tmp_path_factory) -> None:
    from peft import PeftModel
    from test_beam_search import TOLERANCE, hf_beams
    from transformers import AutoModelForCausalLM

    model, base, request = llm
    prompt = [5, 77, 123, 9, 201, 45, 300, 17, 88, 140, 66, 250, 31]
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(hf, request.lora_path).eval()
    theirs = hf_beams(peft, prompt, width=3, max_tokens=8, eos=None, length_penalty=0.5)
    params = engine.BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, length_penalty=0.5)
    (ours,) = model.beam_search([{"prompt_token_ids": prompt}], params, lora_request=request)
    assert [s.tokens[len(prompt):] for s in ours.sequences] == [t for t, _, _ in theirs]
    assert [s.score for s in ours.sequences] == pytest.approx([s for _, s, _ in theirs], abs=TOLERANCE)
    # The adapter made the difference: the base model's beams are others.
    (plain,) = model.beam_search([{"prompt_token_ids": prompt}], params)
    assert [s.tokens for s in plain.sequences] != [s.tokens for s in ours.sequences]
