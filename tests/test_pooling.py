"""Pooling models through the engine (issue 22): all-MiniLM-L6-v2 against
sentence-transformers, a tiny random decoder run as an embedder against transformers'
hidden states, a tiny random cross-encoder against transformers' logits."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from engine_helpers import random_prompts, tiny_model, wait_idle, wait_until
from pooling_fixtures import cosines, sentences

import engine
from engine.errors import InputTooLongError, InvalidParamError, UnknownLoraAdapterError
from engine.params import SamplingParams


async def test_minilm_matches_sentence_transformers_single_batched_and_concurrent(
    minilm: Path, st_embeddings: np.ndarray
) -> None:
    corpus = sentences()
    assert len(corpus) >= 100
    async with engine.open_engine(minilm, dtype="float32", max_num_seqs=32) as eng:
        assert eng.pooler.task == "embed" and eng.pooler.normalize and eng.pooler.pooling == "mean"
        assert eng.max_model_len == 256  # sentence_bert_config.json's max_seq_length
        batched = np.stack([p.vector() for p in await eng.embed(corpus)])
        singles = np.stack([(await eng.embed(s))[0].vector() for s in corpus[:20]])
        concurrent: list[np.ndarray] = [np.empty(0)] * len(corpus)

        async def one(i: int) -> None:
            concurrent[i] = (await eng.embed([corpus[i]]))[0].vector()

        async with trio.open_nursery() as nursery:
            for i in range(len(corpus)):
                nursery.start_soon(one, i)
        stats = eng.statistics()
        assert stats.running == 0 and stats.waiting == 0
    assert cosines(batched, st_embeddings).min() >= 0.9999
    assert cosines(singles, st_embeddings[:20]).min() >= 0.9999
    assert cosines(np.stack(concurrent), st_embeddings).min() >= 0.9999
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)


async def test_embeddings_and_scores_through_an_engine_core_process(
    minilm: Path, st_embeddings: np.ndarray, cross_encoder: Path
) -> None:
    # Regression: a core in its own process scheduled a pooling model's requests as
    # generations, and its first embedding request killed it ("drew no token").
    from transformers import AutoTokenizer, BertForSequenceClassification

    corpus = sentences()
    async with engine.open_engine(minilm, dtype="float32", max_num_seqs=32,
                                  engine_core="process") as eng:
        batched = np.stack([p.vector() for p in await eng.embed(corpus)])
        single = (await eng.embed(corpus[3]))[0].vector()
        assert eng.statistics().requests_finished == len(corpus) + 1
        # token_embed's flag crosses the wire with the request.
        rows = (await eng.embed_tokens(corpus[3], normalize=False))[0].matrix()
    from sentence_transformers import SentenceTransformer

    want_rows = SentenceTransformer(str(minilm), device="cpu").encode(
        corpus[3], output_value="token_embeddings").numpy()
    assert rows.shape == want_rows.shape and np.allclose(rows, want_rows, atol=1e-4)
    assert cosines(batched, st_embeddings).min() >= 0.9999
    assert np.allclose(batched, st_embeddings, atol=1e-5)  # normalised, as the pipeline does
    assert cosines(single[None], st_embeddings[3:4]).min() >= 0.9999
    query, docs = "Where is Berlin?", ["Berlin is the capital of Germany.", "A cat sat."]
    async with engine.open_engine(cross_encoder, dtype="float32", engine_core="process") as eng:
        scores = [s for s, _ in await eng.score(query, docs)]
        classified = [probs for probs, _ in await eng.classify(docs)]
        # The label names cross the process boundary with the pooler.
        assert eng.pooler.labels == tuple(BertForSequenceClassification.from_pretrained(
            str(cross_encoder)).config.id2label.values())
    tok = AutoTokenizer.from_pretrained(str(cross_encoder))
    model = BertForSequenceClassification.from_pretrained(str(cross_encoder)).eval()
    with torch.no_grad():
        batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        want = torch.sigmoid(model(**batch).logits[:, 0]).tolist()
        alone = torch.sigmoid(model(**tok(docs, padding=True, return_tensors="pt")).logits)
    assert np.allclose(scores, want, atol=1e-5)
    assert np.allclose(classified, alone.numpy(), atol=1e-5)


async def test_minilm_refuses_long_inputs_generation_and_dimensions(minilm: Path) -> None:
    async with engine.open_engine(minilm, dtype="float32", max_num_seqs=4,
                                  max_queued_requests=64) as eng:
        with pytest.raises(InvalidParamError, match="65 inputs") as info:
            await eng.embed(["a"] * 65)  # more than the queue ever holds: a 400, not a 429
        assert info.value.param == "input"
        # 40 inputs of 200 words (41k characters) are tokenized in a worker thread.
        many = await eng.embed(["word " * 200] * 40)
        one = (await eng.embed("word " * 200))[0]
        assert all(p.prompt_tokens == 202 for p in many)
        assert np.allclose(np.stack([p.vector() for p in many]), one.vector(), atol=1e-6)
        long = " ".join(["word"] * 300)
        with pytest.raises(InputTooLongError, match="maximum input length is 256"):
            await eng.embed(long)
        # truncate_prompt_tokens keeps the special tokens and the last content tokens.
        cut = await eng.embed(long, truncate_prompt_tokens=10)
        assert cut[0].prompt_tokens == 10
        assert (await eng.embed(long, truncate_prompt_tokens=-1))[0].prompt_tokens == 256
        with pytest.raises(InvalidParamError, match="dimensions") as info:
            await eng.embed("hello", dimensions=8)
        assert info.value.param == "dimensions"
        with pytest.raises(InvalidParamError, match="pooling model") as info:
            await eng.submit("hello", SamplingParams(max_tokens=2))
        assert info.value.param == "model"
        with pytest.raises(InvalidParamError, match="non-empty"):
            await eng.score("a", [])
        # The switches are bools, refused by name otherwise (never read as a truth value);
        # the engine serves on.
        for call, name in ((lambda: eng.embed("hi", normalize="no"), "normalize"),
                           (lambda: eng.embed("hi", add_special_tokens=0), "add_special_tokens"),
                           (lambda: eng.classify("hi"), "model")):
            with pytest.raises(InvalidParamError) as info:
                await call()
            assert info.value.param == name
        assert len(await eng.embed(["still", "serving"])) == 2
        assert eng.statistics().running == 0 and eng.statistics().waiting == 0


def test_left_truncation_matches_the_tokenizers_own(minilm: Path) -> None:
    from transformers import AutoTokenizer

    from engine.core.pooling import input_ids
    from engine.models.tokenizer import Tokenizer

    ours = Tokenizer.from_folder(minilm)
    theirs = AutoTokenizer.from_pretrained(str(minilm), truncation_side="left")
    text = "the quick brown fox jumps over the lazy dog " * 5
    for k in (3, 7, 20):
        want = theirs(text, truncation=True, max_length=k)["input_ids"]
        assert list(input_ids(ours, text, truncate=k, max_model_len=256)) == want


def test_many_inputs_in_one_tokenizer_call_are_the_tokenizers_own_one_by_one(minilm: Path) -> None:
    """input_ids_many (texts in one call, id lists beside them, a limit for all or one
    each) against transformers' tokenizer, input by input: whole, left-truncated to k, and
    without the special tokens."""
    from transformers import AutoTokenizer

    from engine.core.pooling import input_ids_many
    from engine.models.tokenizer import Tokenizer

    ours = Tokenizer.from_folder(minilm)
    theirs = AutoTokenizer.from_pretrained(str(minilm), truncation_side="left")
    texts = sentences()[:12] + ["the quick brown fox jumps over the lazy dog " * 5]
    ids_items = [tuple(range(1000, 1040)), (7, 8)]
    items: list = texts[:6] + [ids_items[0]] + texts[6:] + [ids_items[1]]

    def want(item: object, k: int | None, specials: bool = True) -> list[int]:
        if not isinstance(item, str):
            return list(item)[-k:] if k is not None else list(item)
        if k is None:
            return theirs(item, add_special_tokens=specials)["input_ids"]
        return theirs(item, truncation=True, max_length=k)["input_ids"]

    got = input_ids_many(ours, items, truncate=None, max_model_len=256)
    assert [list(g) for g in got] == [want(i, None) for i in items]
    bare = input_ids_many(ours, items, truncate=None, max_model_len=256, add_special_tokens=False)
    assert [list(g) for g in bare] == [want(i, None, specials=False) for i in items]
    assert [list(g) for g in input_ids_many(ours, items, truncate=9, max_model_len=256)] == [
        want(i, 9) for i in items]
    limits = [None if n % 3 == 0 else 4 + n for n in range(len(items))]
    mixed = input_ids_many(ours, items, truncate=limits, max_model_len=256)
    assert [list(g) for g in mixed] == [want(i, k) for i, k in zip(items, limits, strict=True)]
    with pytest.raises(InvalidParamError) as info:
        input_ids_many(ours, ["fine", "bad \ud800 text"], truncate=None, max_model_len=256)
    assert info.value.param == "input"

# -- a causal LM as an embedder ---------------------------------------------------------

@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tiny_model(tmp_path_factory)
    config = json.loads((path / "config.json").read_text())
    config["is_matryoshka"] = True
    (path / "config.json").write_text(json.dumps(config))
    return path


def _hf_hidden(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
async def test_decoder_embedder_matches_transformers_hidden_states_across_chunks(
    decoder: Path, pooling_type: str
) -> None:
    # A 16-token step budget: prompts up to 60 tokens are computed over several steps.
    prompts = random_prompts(12, vocab=300, lo=1, hi=60, seed=3)
    async with engine.open_engine(
        decoder, dtype="float32", runner="pooling", pooling_type=pooling_type,
        max_num_batched_tokens=16, block_size=16, kv_cache_memory=4 * 1024 * 1024,
    ) as eng:
        assert eng.pooler.task == "embed" and eng.pooler.normalize
        got = [p.vector() for p in await eng.embed(prompts)]
        cut = [p.vector() for p in await eng.embed(prompts[:3], dimensions=8)]
        # vLLM's token_embed: every token's row, gathered over the prompt's chunks.
        rows = [p.matrix() for p in await eng.embed_tokens(prompts, normalize=False)]
        unit_rows = [p.matrix() for p in await eng.embed_tokens(prompts[:2])]
        await wait_idle(eng)
        stats = eng.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks_total  # nothing held once done
    hf = _hf_hidden(decoder, prompts)
    for vector, hidden in zip(got, hf, strict=True):
        pooled = hidden[-1] if pooling_type == "last" else hidden.mean(0)
        want = torch.nn.functional.normalize(pooled, dim=0).numpy()
        assert np.allclose(vector, want, atol=1e-5)
    for matrix, hidden in zip(rows, hf, strict=True):
        assert matrix.shape == tuple(hidden.shape) and np.allclose(matrix, hidden.numpy(), atol=1e-4)
    for matrix, hidden in zip(unit_rows, hf[:2], strict=True):
        want = torch.nn.functional.normalize(hidden, dim=1).numpy()
        assert np.allclose(matrix, want, atol=1e-5)
    for vector, full in zip(cut, got[:3], strict=True):
        want = full[:8] / np.linalg.norm(full[:8])
        assert vector.shape == (8,) and np.allclose(vector, want, atol=1e-6)


async def test_an_embed_cancelled_mid_way_frees_every_request_and_block(decoder: Path) -> None:
    prompts = random_prompts(24, vocab=300, lo=30, hi=60, seed=5)  # ~70 steps of 16 tokens
    async with engine.open_engine(
        decoder, dtype="float32", runner="pooling", max_num_batched_tokens=16, block_size=16,
        kv_cache_memory=4 * 1024 * 1024,
    ) as eng:
        scope = trio.CancelScope()

        async def embed_all() -> None:
            with scope:
                await eng.embed(prompts)

        async with trio.open_nursery() as nursery:
            start = eng.statistics().steps
            nursery.start_soon(embed_all)
            await wait_until(lambda: eng.statistics().steps >= start + 3)
            scope.cancel()
        assert scope.cancelled_caught
        await wait_idle(eng)  # nothing running or waiting, every block free
        assert len(await eng.embed(prompts[:2])) == 2  # and it still serves


async def test_a_decoder_saved_without_its_lm_head_embeds_by_default(
    decoder: Path, tmp_path: Path
) -> None:
    """As Qwen3-Embedding ships: the base model's class, no "model." prefix, no lm_head."""
    from safetensors.torch import load_file, save_file

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((decoder / name).read_bytes())
    config = json.loads((decoder / "config.json").read_text())
    config["architectures"] = ["LlamaModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(str(decoder / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    prompts = random_prompts(4, vocab=300, lo=1, hi=30, seed=4)
    async with engine.open_engine(tmp_path, dtype="float32", kv_cache_memory=4 * 1024 * 1024) as eng:
        assert (eng.pooler.task, eng.pooler.pooling) == ("embed", "last")
        got = [p.vector() for p in await eng.embed(prompts)]
        with pytest.raises(InvalidParamError, match="pooling model"):
            await eng.submit(prompts[0], SamplingParams(max_tokens=2))
    for vector, hidden in zip(got, _hf_hidden(tmp_path, prompts), strict=True):
        want = torch.nn.functional.normalize(hidden[-1], dim=0).numpy()
        assert np.allclose(vector, want, atol=1e-5)


async def test_a_causal_lm_generates_unless_converted(decoder: Path) -> None:
    async with engine.open_engine(decoder, dtype="float32", kv_cache_memory=4 * 1024 * 1024) as eng:
        assert eng.pooler is None
        with pytest.raises(InvalidParamError, match="convert embed"):
            await eng.embed("hello")


# -- a cross-encoder ----------------------------------------------------------------------

async def test_cross_encoder_scores_match_transformers(cross_encoder: Path) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    query = "How many people live in Berlin?"
    docs = ["Berlin has a population of 3,520,031 registered inhabitants.",
            "New York City is famous for the Metropolitan Museum of Art.",
            "Berlin is the capital of Germany.", "x"]
    async with engine.open_engine(cross_encoder, dtype="float32") as eng:
        assert eng.pooler.task == "classify"
        scores = await eng.score(query, docs)
        pairwise = await eng.score([query, docs[0]], [docs[0], query])
        with pytest.raises(InvalidParamError, match="not embed"):
            await eng.embed("hello")
    tok = AutoTokenizer.from_pretrained(str(cross_encoder))
    model = BertForSequenceClassification.from_pretrained(str(cross_encoder)).eval()
    with torch.no_grad():
        batch = tok([query] * len(docs) + [docs[0]], docs + [query], padding=True,
                    return_tensors="pt")
        want = torch.sigmoid(model(**batch).logits[:, 0]).tolist()
    assert np.allclose([s for s, _ in scores], want[: len(docs)], atol=1e-5)
    assert np.allclose([s for s, _ in pairwise], [want[0], want[-1]], atol=1e-5)
    # The random token-type embeddings make segment B's tokens count: the match above
    # holds only if the engine types them as the tokenizer does.
    assert [n for _, n in scores] == batch["attention_mask"][: len(docs)].sum(1).tolist()


# -- a token classifier (vLLM's token_classify) --------------------------------------------

async def test_a_token_classifier_gives_transformers_probabilities_for_every_token(
    tagger: Path
) -> None:
    from transformers import AutoTokenizer, BertForTokenClassification

    texts = ["Ada Lovelace was born in London.", "Paris", "No names here at all, only words."]
    tok = AutoTokenizer.from_pretrained(str(tagger))
    hf = BertForTokenClassification.from_pretrained(str(tagger)).eval()
    async with engine.open_engine(tagger, dtype="float32") as eng:
        assert eng.pooler.task == "token_classify"
        assert eng.pooler.labels == tuple(hf.config.id2label[i] for i in range(hf.config.num_labels))
        probs = [p.matrix() for p in await eng.classify_tokens(texts)]
        logits = [p.matrix() for p in await eng.classify_tokens(texts[:1], use_activation=False)]
        # A sequence's routes are not a tagger's.
        for call in (eng.classify(texts[0]), eng.embed(texts[0]), eng.score(texts[0], texts[1])):
            with pytest.raises(InvalidParamError) as info:
                await call
            assert info.value.param == "model"
    for got, text in zip(probs, texts, strict=True):
        with torch.no_grad():
            want = hf(**tok(text, return_tensors="pt")).logits[0].double()
        assert got.shape == tuple(want.shape)
        assert np.allclose(got, torch.softmax(want, -1).numpy(), atol=1e-5)
    with torch.no_grad():
        want = hf(**tok(texts[0], return_tensors="pt")).logits[0]
    assert np.allclose(logits[0], want.numpy(), atol=1e-4)
    # Each token has its own row (one row copied to all would not match above).
    assert not np.allclose(probs[0][0], probs[0][1:], atol=1e-3)


def test_a_per_token_output_past_the_bound_is_refused_naming_the_input() -> None:
    from engine.core.pooling import MAX_TOKEN_OUTPUT_BYTES, check_token_output

    width = 4096  # Qwen3-Embedding-8B's hidden size: 2,048 tokens fill the bound
    check_token_output(MAX_TOKEN_OUTPUT_BYTES // (4 * width), width)
    with pytest.raises(InvalidParamError, match="at most 2048 tokens") as info:
        check_token_output(MAX_TOKEN_OUTPUT_BYTES // (4 * width) + 1, width)
    assert info.value.param == "input"


# -- LoRA adapters on a decoder embedder -----------------------------------------------------

async def test_a_decoder_embedder_runs_lora_adapters_as_peft_does(tmp_path: Path) -> None:
    from test_lora import write_peft_adapters

    from engine.models.testing import write_tiny_model

    base = write_tiny_model(tmp_path / "base", "llama")
    peft = write_peft_adapters(base, tmp_path, {"aa": dict(r=8, lora_alpha=16)}, seed=3)
    prompts = random_prompts(5, vocab=300, lo=3, hi=40, seed=9)

    def hidden(adapter: bool) -> list[torch.Tensor]:
        with torch.no_grad():
            if adapter:
                return [peft.base_model.model.model(torch.tensor([p])).last_hidden_state[0]
                        for p in prompts]
            with peft.disable_adapter():
                return [peft.base_model.model.model(torch.tensor([p])).last_hidden_state[0]
                        for p in prompts]

    async with engine.open_engine(
        base, dtype="float32", runner="pooling", enable_lora=True,
        lora_modules=[f"aa={tmp_path / 'aa'}"], max_num_batched_tokens=16, block_size=16,
        kv_cache_memory=4 * 1024 * 1024,
    ) as eng:
        # Adapter and base requests side by side, over several chunks each.
        with_adapter, plain = await _both(eng.embed(prompts, lora="aa"), eng.embed(prompts))
        rows = [p.matrix() for p in await eng.embed_tokens(prompts[:2], lora="aa", normalize=False)]
        with pytest.raises(UnknownLoraAdapterError):
            await eng.embed(prompts[0], lora="zz")
        await wait_idle(eng)
    for got, want in zip(with_adapter, hidden(adapter=True), strict=True):
        assert np.allclose(got.vector(), torch.nn.functional.normalize(want[-1], dim=0).numpy(),
                           atol=1e-5)
    for got, want in zip(plain, hidden(adapter=False), strict=True):
        assert np.allclose(got.vector(), torch.nn.functional.normalize(want[-1], dim=0).numpy(),
                           atol=1e-5)
    assert not np.allclose(with_adapter[0].vector(), plain[0].vector(), atol=1e-3)
    for got, want in zip(rows, hidden(adapter=True)[:2], strict=False):
        assert np.allclose(got, want.numpy(), atol=1e-4)


def test_llm_embed_takes_a_lora_request_as_generate_does(tmp_path: Path) -> None:
    """LLM.embed and LLM.encode(token_embed) with vLLM's LoRARequest (loaded on first
    use): peft's hidden states; a list gives each prompt its own (None: the base). LLM.score
    with adapters: the cosines of peft's hidden states of each pair."""
    from test_lora import write_peft_adapters
    from transformers import AutoTokenizer

    from engine.models.testing import write_tiny_model

    base = write_tiny_model(tmp_path / "base", "llama")
    peft = write_peft_adapters(base, tmp_path, {"aa": dict(r=8, lora_alpha=16)}, seed=5)
    prompts = random_prompts(2, vocab=300, lo=4, hi=20, seed=2)
    with torch.no_grad():
        tuned = [peft.base_model.model.model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
        with peft.disable_adapter():
            plain = [peft.base_model.model.model(torch.tensor([p])).last_hidden_state[0]
                     for p in prompts]
    request = engine.LoRARequest("aa", 1, str(tmp_path / "aa"))
    with engine.LLM(str(base), dtype="float32", runner="pooling", enable_lora=True,
                    kv_cache_memory=4 * 2**20) as llm:
        mixed = llm.embed([{"prompt_token_ids": p} for p in prompts],
                          lora_request=[request, None], use_tqdm=False)
        rows = llm.encode([{"prompt_token_ids": prompts[0]}], engine.PoolingParams(normalize=False),
                          pooling_task="token_embed", lora_request=request, use_tqdm=False)
        # score: each pair's two texts embedded with the pair's adapter (None: the base).
        texts = sentences()[:3]
        scores = llm.score(texts[0], texts[1:3], lora_request=[request, None], use_tqdm=False)
    unit = [torch.nn.functional.normalize(h[-1], dim=0).numpy() for h in (tuned[0], plain[1])]
    assert np.allclose(mixed[0].outputs.embedding, unit[0], atol=1e-5)
    assert np.allclose(mixed[1].outputs.embedding, unit[1], atol=1e-5)
    assert np.allclose(rows[0].outputs.data.numpy(), tuned[0].numpy(), atol=1e-4)
    tok = AutoTokenizer.from_pretrained(str(base))
    for got, second, adapter in zip(scores, texts[1:3], (True, False), strict=True):
        pair = [tok(t).input_ids for t in (texts[0], second)]
        assert got.prompt_token_ids == pair[0] + pair[1]
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if not adapter:
                stack.enter_context(peft.disable_adapter())
            a, b = (peft.base_model.model.model(torch.tensor([i])).last_hidden_state[0, -1]
                    for i in pair)
        assert abs(got.outputs.score - torch.nn.functional.cosine_similarity(a, b, dim=0).item()) < 1e-5
    assert abs(scores[0].outputs.score - scores[1].outputs.score) > 1e-4  # the adapter counts


async def _both(first, second) -> tuple:
    """Two coroutines run side by side; their results."""
    results: list = [None, None]

    async def run(i: int, coro) -> None:
        results[i] = await coro

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, 0, first)
        nursery.start_soon(run, 1, second)
    return tuple(results)


async def test_a_preempting_reset_leaves_an_encoders_requests_running(
    minilm: Path, st_embeddings: np.ndarray
) -> None:
    """reset_running_requests on an encoder (no KV blocks to free): nothing is preempted,
    the reset happens, and the embeddings in flight come back as they would have."""
    corpus = sentences()
    async with engine.open_engine(minilm, dtype="float32", max_num_seqs=8) as eng:
        results: list = []

        async def embed_all() -> None:
            results.extend(await eng.embed(corpus))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(embed_all)
            await wait_until(lambda: eng.statistics().steps >= 2)
            assert await eng.reset_prefix_cache(reset_running_requests=True) is True
        assert eng.statistics().preemptions == 0
    assert cosines(np.stack([p.vector() for p in results]), st_embeddings).min() >= 0.9999
