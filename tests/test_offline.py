"""engine.LLM, the offline API shaped like vLLM's: the embedded trio API's greedy outputs
on the same prompts, in order; transformers' logprobs, tokenizer and chat template;
a script written for vLLM run with only its import changed; several threads and a
running asyncio loop (Jupyter); a bad prompt refused by its index before anything runs;
Ctrl-C mid-batch leaving no thread, process or KV block behind."""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import gc
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
from chat_fixtures import TOOL_TEMPLATE
from engine_helpers import collect, greedy, random_prompts, text, tiny_model, token_ids
from tqdm import tqdm

import engine
from engine import LLM, SamplingParams
from engine.errors import BatchPromptError, EngineDeadError, InvalidParamError, PromptTooLongError

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parent.parent

# A 64-token step budget and 8 sequences: the ten prompts below share steps and queue.
# A 4 MiB pool keeps start-up fast; 128 positions make a too-long prompt cheap to write.
OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
    kv_cache_memory=4 * 1024 * 1024, max_model_len=128,
)

TEXTS = ["The quick brown fox", "Hello world! This is", "Paged attention stores keys",
         "naïve café 日本語"]
IDS = random_prompts(6, vocab=300, lo=2, hi=40, seed=3)
# Every prompt form of vLLM's generate, mixed, each with its own output length.
PROMPTS: list[Any] = [TEXTS[0], IDS[0], {"prompt": TEXTS[1]}, {"prompt_token_ids": IDS[1]},
                      TEXTS[2], IDS[2], IDS[3], TEXTS[3], {"prompt_token_ids": IDS[4]}, IDS[5]]
MAX_TOKENS = [3, 9, 5, 12, 1, 7, 10, 4, 8, 6]


def _engine_form(prompt: Any) -> Any:
    """The same prompt as the embedded API takes it."""
    if isinstance(prompt, dict):
        return prompt.get("prompt_token_ids", prompt.get("prompt"))
    return prompt


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def llm(model: Path) -> Any:
    with LLM(str(model), **OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[Any]]:
    """Each prompt's outputs from the embedded trio API, all submitted at once."""

    async def main() -> list[list[Any]]:
        results: list[list[Any]] = [[] for _ in PROMPTS]
        async with engine.open_engine(str(model), **OPTIONS) as eng:

            async def one(i: int) -> None:
                results[i] = await collect(eng, _engine_form(PROMPTS[i]), greedy(MAX_TOKENS[i]))

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
        return results

    return trio.run(main)


def _assert_like_reference(outputs: list[Any], reference: list[list[Any]], indices: range) -> None:
    assert len(outputs) == len(indices)
    for out, i in zip(outputs, indices, strict=True):
        (sample,) = out.outputs
        assert sample.token_ids == token_ids(reference[i])
        assert sample.text == text(reference[i])
        assert len(sample.token_ids) == MAX_TOKENS[i] and sample.finish_reason == "length"


def _llm_threads() -> int:
    return [t.name for t in threading.enumerate()].count("engine.LLM")


def _idle(llm: Any) -> None:
    stats = llm.statistics()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


# -- generate ------------------------------------------------------------------------------

def test_generate_gives_the_embedded_apis_greedy_outputs_in_order_with_a_progress_bar(
    llm: Any, reference: list[list[Any]],
) -> None:
    bars: list[Any] = []

    class Bar(tqdm):  # use_tqdm takes a tqdm class, as vLLM's
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, file=io.StringIO(), mininterval=0, **kwargs)
            bars.append(self)

    outputs = llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS], use_tqdm=Bar)
    _assert_like_reference(outputs, reference, range(len(PROMPTS)))
    tokenizer = llm.get_tokenizer()  # transformers' own, the oracle of the prompt's ids
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        body = _engine_form(prompt)
        if isinstance(body, str):
            assert out.prompt == body
            assert out.prompt_token_ids == tokenizer(body)["input_ids"]
        else:
            assert out.prompt is None and out.prompt_token_ids == body
    assert len({out.request_id for out in outputs}) == len(PROMPTS)
    (bar,) = bars
    assert bar.n == bar.total == len(PROMPTS)
    rates = [float(x) for x in re.findall(r"([\d.]+) tok/s", bar.postfix)]
    assert len(rates) == 2 and all(r > 0 for r in rates)
    _idle(llm)


def test_logprobs_and_samples_take_vllms_shape_with_transformers_values(
    llm: Any, model: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    prompt = IDS[2]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2, logprobs=3,
                            prompt_logprobs=2)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert [s.index for s in out.outputs] == [0, 1]
    tokens = out.outputs[0].token_ids
    assert out.outputs[1].token_ids == tokens  # greedy: both samples alike

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0], -1)
    for sample in out.outputs:
        assert len(sample.logprobs) == len(tokens)
        for k, (token, position) in enumerate(zip(tokens, sample.logprobs, strict=True)):
            row = want[len(prompt) - 1 + k]
            values, top = row.topk(3)
            # The chosen token first, then the top 3 (greedy: it is the first of them).
            assert list(position) == top.tolist() and list(position)[0] == token
            assert [p.rank for p in position.values()] == [1, 2, 3]
            assert np.allclose([p.logprob for p in position.values()], values, atol=1e-4)
            assert position[token].decoded_token == llm.get_tokenizer().decode([token])
        assert sample.cumulative_logprob == pytest.approx(
            sum(p[t].logprob for p, t in zip(sample.logprobs, tokens, strict=True)), abs=1e-6)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert list(entry)[0] == prompt[i]
        assert entry[prompt[i]].logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=1e-4)
    (plain,) = llm.generate(prompt, greedy(2), use_tqdm=False)  # a bare token-id list: one prompt
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    # vLLM's detokenize=False: the same tokens and logprobs, no text, no decoded tokens.
    (bare,) = llm.generate({"prompt_token_ids": prompt}, params.replace(detokenize=False),
                           use_tqdm=False)
    assert out.outputs[0].text and bare.outputs[0].text == ""
    assert bare.outputs[0].token_ids == tokens
    assert [list(p) for p in bare.outputs[0].logprobs] == [list(p) for p in out.outputs[0].logprobs]
    assert all(v.decoded_token is None for p in bare.outputs[0].logprobs for v in p.values())


def test_a_bad_prompt_is_refused_by_its_index_before_any_prompt_runs(llm: Any) -> None:
    before = llm.statistics()
    batches = [
        (["fine", [5, 6], [7] * 200, "fine too"], 2, PromptTooLongError),  # 128 positions
        (["fine", {"prompt": "x", "video": 1}], 1, InvalidParamError),
        ([[5, 6], {"prompt": "x", "multi_modal_data": {"image": b"\x89PNG"}}], 1,
         InvalidParamError),  # the tiny model takes text only
        ([[5, 6], [5, 999_999]], 1, InvalidParamError),  # outside the vocabulary
        (["fine", 3.5], 1, InvalidParamError),
    ]
    for prompts, index, kind in batches:
        with pytest.raises(BatchPromptError) as info:
            llm.generate(prompts, greedy(4), use_tqdm=False)
        assert info.value.index == index and isinstance(info.value.error, kind)
        assert isinstance(info.value, ValueError) and str(info.value).startswith(f"prompt {index}")
    after = llm.statistics()
    assert (after.steps, after.requests_finished) == (before.steps, before.requests_finished)
    with pytest.raises(InvalidParamError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy(1)], use_tqdm=False)


# -- threads and notebooks ----------------------------------------------------------------

def test_several_threads_share_the_engine(llm: Any, reference: list[list[Any]]) -> None:
    slices = [range(0, 3), range(3, 5), range(5, 8), range(8, 10)]

    def run(indices: range) -> list[Any]:
        return llm.generate([PROMPTS[i] for i in indices],
                            [greedy(MAX_TOKENS[i]) for i in indices], use_tqdm=False)

    with concurrent.futures.ThreadPoolExecutor(len(slices)) as pool:
        results = list(pool.map(run, slices))
    for outputs, indices in zip(results, slices, strict=True):
        _assert_like_reference(outputs, reference, indices)
    _idle(llm)


def test_a_running_asyncio_loop_as_in_jupyter(
    llm: Any, model: Path, reference: list[list[Any]],
) -> None:
    async def notebook() -> tuple[list[Any], list[Any], Any]:
        asyncio.get_running_loop()  # a cell runs inside the kernel's loop
        outputs = llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS], use_tqdm=False)
        with LLM(str(model), **OPTIONS) as second:  # loaded under the running loop too
            more = second.generate(PROMPTS[:2], [greedy(m) for m in MAX_TOKENS[:2]],
                                   use_tqdm=False)
        return outputs, more, second

    outputs, more, second = asyncio.run(notebook())
    _assert_like_reference(outputs, reference, range(len(PROMPTS)))
    _assert_like_reference(more, reference, range(2))
    with pytest.raises(EngineDeadError, match="closed"):
        second.generate("after", greedy(1), use_tqdm=False)
    assert _llm_threads() == 1  # the module's


# -- a script written for vLLM -------------------------------------------------------------

def _printed(out: str) -> dict[str, list[Any]]:
    """The values the script printed, by label: each line ``Label: <a Python literal>``."""
    values: dict[str, list[Any]] = {}
    for line in out.splitlines():
        label, sep, value = line.partition(": ")
        if sep:
            values.setdefault(label, []).append(ast.literal_eval(value))
    return values


def test_a_script_written_for_vllm_runs_with_only_its_import_changed(
    model: Path, minilm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    before = _llm_threads()
    source = (DATA / "vllm_offline_example.py").read_text()
    ported = source.replace("from vllm import LLM", "from engine import LLM")
    changed = [(a, b) for a, b in zip(source.splitlines(), ported.splitlines(), strict=True)
               if a != b]
    assert changed == [("from vllm import LLM, SamplingParams", "from engine import LLM, SamplingParams")]
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    argv = ["vllm_offline_example.py", "--model", str(model), "--embed-model", str(minilm),
            "--chat-template", str(template), "--dtype", "float32"]
    namespace: dict[str, Any] = {"__name__": "__main__"}
    saved = sys.argv
    sys.argv = argv
    try:
        exec(compile(ported, str(DATA / "vllm_offline_example.py"), "exec"), namespace)
    finally:
        sys.argv = saved
    out = _printed(capsys.readouterr().out)
    script = namespace

    # generate: transformers' greedy continuation of transformers' tokens.
    tok = AutoTokenizer.from_pretrained(str(model))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def hf_greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            full = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0]
        return full[len(ids):].tolist()

    assert out["Prompt"] == script["PROMPTS"]
    generated_ids = out["Token ids"][:3]
    for prompt, text_, ids in zip(out["Prompt"], out["Generated text"], generated_ids, strict=True):
        want = hf_greedy(tok(prompt)["input_ids"])
        assert ids == want and text_ == tok.decode(want, skip_special_tokens=True)

    # chat with a tool, two turns: the template renders as transformers renders it.
    tool = script["WEATHER_TOOL"]
    first = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "What is the weather like in Paris?"}]
    # The template gets a call's arguments parsed, as vLLM hands them (templates tojson them).
    second = [*first, {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "tool_call_id": "call_0", "content": "18 degrees and sunny"}]
    turns = zip((first, second), out["Chat prompt"], out["Chat reply"], out["Token ids"][3:],
                strict=True)
    for messages, prompt, reply, ids in turns:
        rendered = tok.apply_chat_template(messages, tools=[tool], chat_template=TOOL_TEMPLATE,
                                           add_generation_prompt=True, tokenize=False)
        assert prompt == rendered and "get_weather" in rendered
        want = hf_greedy(tok(rendered, add_special_tokens=False)["input_ids"])
        assert ids == want and reply == tok.decode(want, skip_special_tokens=True)

    # embed and score: sentence-transformers' MiniLM.
    st = SentenceTransformer(str(minilm), device="cpu")
    assert out["Sentence"] == script["SENTENCES"]
    want_vectors = st.encode(out["Sentence"], convert_to_numpy=True)
    assert np.allclose(np.array(out["Embedding"]), want_vectors, atol=1e-5)
    assert out["Against"] == script["SENTENCES"][1:]
    unit = want_vectors / np.linalg.norm(want_vectors, axis=1, keepdims=True)
    assert np.allclose(out["Score"], unit[1:] @ unit[0], atol=1e-5)

    # The script never closed its two LLMs: once dropped, their engines stopped.
    namespace.clear()
    gc.collect()
    assert _llm_threads() == before


# -- images -------------------------------------------------------------------------------

def test_a_prompt_dict_with_images_matches_transformers_llava(tmp_path: Path) -> None:
    """vLLM's ``{"prompt": ..., "multi_modal_data": {"image": ...}}``: the prompt holds the
    model's image token once per image, widened to the image's placeholders."""
    from PIL import Image
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from engine.models.testing import IMAGE_TOKEN, write_tiny_llava

    folder = write_tiny_llava(tmp_path / "llava")
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8))
              for _ in range(2)]
    prompts = [f"<|im_start|>user\n{IMAGE_TOKEN * k}\nWhat is this?<|im_end|>\n"
               f"<|im_start|>assistant\n" for k in (1, 2)]
    with LLM(str(folder), dtype="float32", kv_cache_memory=8 * 2**20) as llm:
        outputs = llm.generate(
            [{"prompt": prompts[0], "multi_modal_data": {"image": images[0]}},
             {"prompt": prompts[1], "multi_modal_data": {"image": images}}],
            SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    hf = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    # The tiny CLIP tower's CLS position is dropped (the default feature strategy).
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder), patch_size=14,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN)
    for out, prompt, few in zip(outputs, prompts, ([images[0]], images), strict=True):
        inputs = processor(text=prompt, images=few, return_tensors="pt")
        with torch.no_grad():
            full = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0]
        ids = inputs["input_ids"][0].tolist()
        assert out.prompt == prompt and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == full[len(ids):].tolist()


# -- pooling -------------------------------------------------------------------------------

def test_classify_and_score_with_a_cross_encoder_match_transformers(cross_encoder: Path) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    texts = ["Berlin is the capital of Germany.", "x", "A cat sits on the mat."]
    query = "How many people live in Berlin?"
    with LLM(str(cross_encoder), dtype="float32") as llm:
        classified = llm.classify(texts, use_tqdm=False)
        scored = llm.score(query, texts, use_tqdm=False)
        with pytest.raises(InvalidParamError, match="not embed"):
            llm.embed("hello", use_tqdm=False)
        with pytest.raises(InvalidParamError, match="pooling model"):
            llm.generate("hello", use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(str(cross_encoder))
    hf = BertForSequenceClassification.from_pretrained(str(cross_encoder)).eval()
    with torch.no_grad():
        alone = torch.sigmoid(hf(**tok(texts, padding=True, return_tensors="pt")).logits[:, 0])
        pairs = torch.sigmoid(hf(**tok([query] * len(texts), texts, padding=True,
                                       return_tensors="pt")).logits[:, 0])
    assert np.allclose([c.outputs.probs[0] for c in classified], alone.tolist(), atol=1e-5)
    assert [c.prompt_token_ids for c in classified] == tok(texts)["input_ids"]
    assert np.allclose([s.outputs.score for s in scored], pairs.tolist(), atol=1e-5)


def test_default_sampling_params_follow_the_generation_config(tmp_path: Path) -> None:
    """vLLM's get_default_sampling_params: generation_config.json's fields, its
    max_new_tokens as max_tokens, override_generation_config over them; generate without
    params runs with them (transformers' greedy tokens, its EOS included)."""
    from transformers import AutoModelForCausalLM

    from engine.models.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "m", "llama")
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.7, "max_new_tokens": 4}))
    prompt = [5, 17, 99, 42, 8]
    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                           eos_token_id=2)[0, len(prompt):].tolist()
    with LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory=8 * 2**20,
             override_generation_config={"temperature": 0, "top_k": 5}) as llm:
        defaults = llm.get_default_sampling_params()
        out = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0, 5, 4)
    assert list(out[0].outputs[0].token_ids) == want
    # vLLM's idiom: take the defaults and set a field; each request keeps the values it
    # was submitted with.
    with LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory=8 * 2**20,
             override_generation_config={"temperature": 0}) as llm:
        params = llm.get_default_sampling_params()
        params.max_tokens, params.ignore_eos = 2, True
        two = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        params.max_tokens = 3
        three = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert len(two[0].outputs[0].token_ids) == 2 and len(three[0].outputs[0].token_ids) == 3


def test_pooling_params_shape_embeddings_and_classifications(
    minilm: Path, classifier: Path
) -> None:
    """vLLM's PoolingParams: normalize and truncation per prompt on an embedder, the
    logits of a classifier; fields that mean nothing for the task are refused."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer, BertForSequenceClassification

    texts = ["A first sentence to embed.", "And a second, a little longer than the first."]
    full = SentenceTransformer(str(minilm), device="cpu")
    raw_model = SentenceTransformer(modules=[full[0], full[1]], device="cpu")
    want_raw = raw_model.encode(texts, convert_to_numpy=True)
    want = full.encode(texts, convert_to_numpy=True)
    want_tokens = full.encode(texts, output_value="token_embeddings")
    tok = AutoTokenizer.from_pretrained(str(minilm))
    with LLM(str(minilm), dtype="float32") as llm:
        raw = llm.embed(texts, pooling_params=engine.PoolingParams(normalize=False), use_tqdm=False)
        mixed = llm.embed(texts, use_tqdm=False, pooling_params=[
            engine.PoolingParams(normalize=False), engine.PoolingParams(truncate_prompt_tokens=5)])
        # The batch's texts reach the tokenizer in one call; a refusal still names its
        # prompt (a text that is not Unicode, one past the model's 256 tokens).
        for bad_texts, index in (([texts[0], "bad \ud800 text"], 1), ([texts[0], "word " * 400], 1),
                                 (["word " * 400, texts[1]], 0)):
            with pytest.raises(BatchPromptError) as info:
                llm.embed(bad_texts, use_tqdm=False)
            assert info.value.index == index
        for bad, param in ((engine.PoolingParams(use_activation=False), "pooling_params.use_activation"),
                           (engine.PoolingParams(dimensions=8), "dimensions"),
                           ([engine.PoolingParams()], "pooling_params")):
            with pytest.raises((InvalidParamError, BatchPromptError)) as info:
                llm.embed(texts, pooling_params=bad, use_tqdm=False)
            assert getattr(info.value, "param", None) == param
        with pytest.raises(InvalidParamError, match="disagree"):
            llm.embed(texts, truncate_prompt_tokens=4, use_tqdm=False,
                      pooling_params=engine.PoolingParams(truncate_prompt_tokens=5))
        cut_ids = tok(texts[1])["input_ids"]
        cut_ids = [cut_ids[0], *cut_ids[-4:]]  # [CLS] and the last four: [SEP] at the end
        cut_want = llm.embed([cut_ids], use_tqdm=False)[0].outputs.embedding
        # vLLM's generic call: the embedding as a tensor; every token's hidden state with
        # token_embed (no task means it for an embedder, as in vLLM), normalised as the
        # model's embeddings are unless asked not to; token_classify is refused by name.
        encoded = llm.encode(texts, pooling_task="embed", use_tqdm=False)
        per_token = llm.encode(texts, use_tqdm=False)
        per_token_raw = llm.encode(texts, engine.PoolingParams(normalize=False),
                                   pooling_task="token_embed", use_tqdm=False)
        with pytest.raises(InvalidParamError) as info:
            llm.encode(texts, pooling_task="token_classify", use_tqdm=False)
        assert info.value.param == "pooling_task"
        with pytest.raises(BatchPromptError) as info:
            llm.encode(texts, engine.PoolingParams(dimensions=8), pooling_task="token_embed",
                       use_tqdm=False)
        assert info.value.param == "pooling_params.dimensions"
    for got, got_raw, ref, prompt in zip(per_token, per_token_raw, want_tokens, texts, strict=True):
        assert got.prompt_token_ids == tok(prompt)["input_ids"]
        assert got_raw.outputs.data.shape == ref.shape == (len(got.prompt_token_ids), 384)
        assert np.allclose(got_raw.outputs.data.numpy(), ref.numpy(), atol=1e-4)
        unit = torch.nn.functional.normalize(ref, dim=1).numpy()
        assert np.allclose(got.outputs.data.numpy(), unit, atol=1e-5)
    assert all(isinstance(o.outputs.data, torch.Tensor) for o in encoded)
    assert np.allclose(torch.stack([o.outputs.data for o in encoded]).numpy(), want,
                       rtol=1e-4, atol=1e-5)
    assert np.allclose([o.outputs.embedding for o in raw], want_raw, rtol=1e-4, atol=1e-5)
    assert np.allclose(mixed[0].outputs.embedding, want_raw[0], rtol=1e-4, atol=1e-5)
    assert mixed[1].prompt_token_ids == cut_ids
    assert np.allclose(mixed[1].outputs.embedding, cut_want, atol=1e-6)
    assert not np.allclose(mixed[1].outputs.embedding, want[1], atol=1e-3)
    with pytest.raises(InvalidParamError):
        engine.PoolingParams(dimensions=0)

    hf = BertForSequenceClassification.from_pretrained(str(classifier)).eval()
    with torch.no_grad():
        logits = hf(**tok(texts, padding=True, return_tensors="pt")).logits
    with LLM(str(classifier), dtype="float32") as llm:
        probs = llm.classify(texts, use_tqdm=False)
        raw_logits = llm.classify(texts, use_tqdm=False,
                                  pooling_params=engine.PoolingParams(use_activation=False))
        with pytest.raises(BatchPromptError) as info:
            llm.classify(texts, pooling_params=engine.PoolingParams(normalize=True),
                         use_tqdm=False)
        assert info.value.param == "pooling_params.normalize"
        encoded = llm.encode(texts, pooling_task="classify", use_tqdm=False)
        for task in (None, "token_embed"):  # a classifier has no per-token task here
            with pytest.raises(InvalidParamError) as info:
                llm.encode(texts, pooling_task=task, use_tqdm=False)
            assert info.value.param in ("pooling_task", "model")
    assert np.allclose([o.outputs.probs for o in probs], torch.softmax(logits, -1).numpy(),
                       atol=1e-5)
    assert np.allclose(torch.stack([o.outputs.data for o in encoded]).numpy(),
                       torch.softmax(logits, -1).numpy(), atol=1e-5)
    assert np.allclose([o.outputs.probs for o in raw_logits], logits.numpy(), atol=1e-4)


# -- Ctrl-C --------------------------------------------------------------------------------

def _sigint_as_a_shell_leaves_it() -> None:
    # In the child, before exec: SIGINT handled by default and not blocked, as a script
    # started from a shell has it. An ignored SIGINT survives exec (and Python then
    # installs no KeyboardInterrupt handler); in the whole suite the script once ran to
    # "finished" with the signal sent, which only an inherited ignore or mask explains.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_mid_batch_leaves_no_thread_process_or_kv_block(model: Path) -> None:
    """SIGINT to a script in the middle of a 40-prompt batch whose engine core is a
    process of its own (so that a process could be left behind)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, str(DATA / "offline_interrupted.py"), str(model), "process"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=_sigint_as_a_shell_leaves_it)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends at EOF if the script dies before the batch runs
            if line.strip() == "running":
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGINT, (out, err)  # KeyboardInterrupt ended it, as any script
    assert "KeyboardInterrupt" in err and "finished" not in out.splitlines()
    stats, closed = (json.loads(line) for line in out.splitlines() if line.startswith("{"))
    # Every request left the engine and gave back its blocks; the batch (2 prefill steps
    # and ~2,000 decode steps' worth) stopped after its first few steps.
    assert (stats["running"], stats["waiting"]) == (0, 0)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["steps"] < 50
    assert stats["again"] == 3  # and the LLM still serves
    assert len(stats["children"]) == 1  # the engine core, while the LLM was open
    assert closed["children"] == []
    names = [name for name, _ in closed["threads"]]
    assert "engine.LLM" not in names
    # What stays are idle daemon pools: trio's thread cache (they exit after 10 s idle)
    # and the process's model thread; nothing keeps the process alive.
    assert all(daemon for name, daemon in closed["threads"] if name != "MainThread")


async def test_a_request_keeps_the_params_it_was_submitted_with(tmp_path_factory) -> None:
    """Setting a field of the params after submit (vLLM's params are mutable, and so are
    these) changes only what is submitted later, not the request in flight."""
    model = tiny_model(tmp_path_factory)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    async with engine.open_engine(str(model), dtype="float32", max_model_len=128,
                                  kv_cache_memory=8 * 2**20) as eng:
        stream = await eng.submit([5, 6, 7], params)
        params.max_tokens = 1
        async with stream:
            outputs = [out async for out in stream]
        later = await collect(eng, [5, 6, 7], params)
    assert sum(len(o.token_ids) for o in outputs) == 5
    assert sum(len(o.token_ids) for o in later) == 1
