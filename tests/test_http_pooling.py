"""/v1/embeddings, /v1/score and /v1/rerank over HTTP (issue 22), checked with the
official openai client, LangChain's OpenAIEmbeddings, sentence-transformers and
transformers as oracles."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from engine_helpers import tiny_model
from http_server import ServerThread
from pooling_fixtures import CLASSIFIER_TEXTS, cosines, sentences

import engine


@pytest.fixture(scope="module")
def server():
    # By its name: resolved to the package's zip, extracted once into the engine cache.
    opener = lambda: engine.open_engine("all-MiniLM-L6-v2", dtype="float32", max_num_seqs=32)  # noqa: E731
    with ServerThread(opener) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_openai_client_float_and_base64_match_sentence_transformers(
    client: openai.OpenAI, st_embeddings: np.ndarray
) -> None:
    corpus = sentences()
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=corpus,
                                      encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(corpus)))
    got = np.array([d.embedding for d in floats.data])
    assert cosines(got, st_embeddings).min() >= 0.9999
    # Left to itself the client asks for base64 and decodes it as float32.
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=corpus[:5])
    assert np.allclose([d.embedding for d in default.data], got[:5], atol=1e-7)
    # Asked for explicitly, it hands the base64 text over as it came.
    packed = client.embeddings.create(model="all-MiniLM-L6-v2", input=corpus[:5],
                                      encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in packed.data]
    assert np.allclose(decoded, got[:5], atol=1e-7)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(corpus) * 3


def test_embedding_inputs_usage_and_concurrency(
    server, client: openai.OpenAI, st_embeddings: np.ndarray
) -> None:
    corpus = sentences()
    tok = server.engine.tokenizer
    ids = [tok.encode(s) for s in corpus[:3]]
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=corpus[0], encoding_format="float")
    by_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids[0], encoding_format="float")
    many_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids, encoding_format="float")
    assert one.usage.prompt_tokens == len(ids[0]) == by_ids.usage.prompt_tokens
    assert many_ids.usage.prompt_tokens == sum(map(len, ids))
    assert np.allclose(one.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)
    assert cosines(np.array([d.embedding for d in many_ids.data]), st_embeddings[:3]).min() >= 0.9999

    def embed(i: int) -> list[float]:
        answer = client.embeddings.create(model="all-MiniLM-L6-v2", input=corpus[i],
                                          encoding_format="float")
        return answer.data[0].embedding

    with ThreadPoolExecutor(16) as pool:
        concurrent = np.array(list(pool.map(embed, range(48))))
    assert cosines(concurrent, st_embeddings[:48]).min() >= 0.9999


def test_embedding_refusals_name_their_field(server) -> None:
    url = server.base_url + "/v1/embeddings"

    def error(body: dict, status: int = 400) -> dict:
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == status, response.text
        return response.json()["error"]

    assert error({"input": "hi", "dimensions": 8})["param"] == "dimensions"
    too_long = error({"input": "word " * 300})
    assert "maximum input length is 256" in too_long["message"]
    assert too_long["code"] == "context_length_exceeded"
    assert error({"input": "hi", "embed_dtype": "int8"})["param"] == "embed_dtype"
    assert error({"input": "hi", "endianness": "middle"})["param"] == "endianness"
    assert error({"input": "hi", "truncation_side": "right"})["param"] == "truncation_side"
    assert error({"input": "hi", "use_activation": False})["param"] == "use_activation"
    assert error({"input": "hi", "normalize": "no"})["param"] == "normalize"
    assert error({"input": "hi", "encoding_format": "int8"})["param"] == "encoding_format"
    assert error({"input": []})["param"] == "input"
    assert error({"input": [5, 10**6]})["param"] == "input"  # past the vocabulary
    assert error({"input": "hi", "truncate_prompt_tokens": 0})["param"] == "truncate_prompt_tokens"
    cut = httpx.post(url, json={"input": "word " * 300, "truncate_prompt_tokens": 16}, timeout=30)
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 16
    chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "pooling model" in chat.json()["error"]["message"]


def test_normalize_false_gives_the_pipeline_without_its_normalize_module(
    client: openai.OpenAI, minilm: Path, st_embeddings: np.ndarray
) -> None:
    from sentence_transformers import SentenceTransformer

    corpus = sentences()[:12]
    full = SentenceTransformer(str(minilm), device="cpu")
    assert type(full[-1]).__name__ == "Normalize"
    # The same pipeline without its last module: the mean-pooled vectors as they come.
    raw_model = SentenceTransformer(modules=[full[0], full[1]], device="cpu")
    want = raw_model.encode(corpus, convert_to_numpy=True)
    assert not np.allclose(np.linalg.norm(want, axis=1), 1.0, atol=1e-3)
    raw = client.embeddings.create(model="all-MiniLM-L6-v2", input=corpus,
                                   encoding_format="float", extra_body={"normalize": False})
    got = np.array([d.embedding for d in raw.data])
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5)
    normalized = client.embeddings.create(model="all-MiniLM-L6-v2", input=corpus,
                                          encoding_format="float", extra_body={"normalize": True})
    assert np.allclose([d.embedding for d in normalized.data], st_embeddings[:12], atol=1e-5)
    assert np.allclose(np.linalg.norm([d.embedding for d in normalized.data], axis=1), 1.0,
                       atol=1e-6)


def test_add_special_tokens_false_embeds_the_text_without_cls_and_sep(
    client: openai.OpenAI, minilm: Path
) -> None:
    from transformers import AutoTokenizer

    texts = ["A short sentence to embed.", "Another one, with a comma."]
    tok = AutoTokenizer.from_pretrained(str(minilm))
    bare_ids = tok(texts, add_special_tokens=False)["input_ids"]
    assert all(tok.cls_token_id not in ids for ids in bare_ids)
    bare = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float",
                                    extra_body={"add_special_tokens": False})
    by_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=bare_ids,
                                      encoding_format="float")
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts,
                                       encoding_format="float")
    assert bare.usage.prompt_tokens == sum(map(len, bare_ids))
    assert default.usage.prompt_tokens == sum(map(len, tok(texts)["input_ids"]))
    got = np.array([d.embedding for d in bare.data])
    assert np.allclose(got, [d.embedding for d in by_ids.data], atol=1e-6)
    assert cosines(got, np.array([d.embedding for d in default.data])).max() < 0.999
    # With truncation the text keeps its last tokens, and no special token comes back.
    cut = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0], encoding_format="float",
                                   extra_body={"add_special_tokens": False,
                                               "truncate_prompt_tokens": 3})
    tail = client.embeddings.create(model="all-MiniLM-L6-v2", input=bare_ids[0][-3:],
                                    encoding_format="float")
    assert cut.usage.prompt_tokens == 3
    assert np.allclose(cut.data[0].embedding, tail.data[0].embedding, atol=1e-6)


def test_classify_matches_transformers_probabilities_and_labels(classifier: Path) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    texts = [*CLASSIFIER_TEXTS, "The train leaves at nine.", "x"]
    tok = AutoTokenizer.from_pretrained(str(classifier))
    hf = BertForSequenceClassification.from_pretrained(str(classifier)).eval()
    with torch.no_grad():
        logits = hf(**tok(texts, padding=True, return_tensors="pt")).logits.double()
    want = torch.softmax(logits, dim=-1).numpy()
    want_labels = [hf.config.id2label[int(i)] for i in logits.argmax(-1)]
    assert len(set(want_labels)) == 3  # the head tells these texts apart
    opener = lambda: engine.open_engine(str(classifier), dtype="float32")  # noqa: E731
    with ServerThread(opener) as srv:
        url = srv.base_url + "/classify"
        answer = httpx.post(url, json={"input": texts}, timeout=30).json()
        raw = httpx.post(srv.base_url + "/v1/classify", timeout=30,
                         json={"input": texts[:2], "use_activation": False}).json()
        ids = tok(texts[2])["input_ids"]
        by_ids = httpx.post(url, json={"input": ids}, timeout=30).json()
        refused = {field: httpx.post(url, json={"input": "hi", field: value}, timeout=30)
                   for field, value in (("dimensions", 2), ("normalize", True),
                                        ("encoding_format", "base64"), ("embed_dtype", "float16"))}
        embed = httpx.post(srv.base_url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
        spec = httpx.get(srv.base_url + "/openapi.json", timeout=30).json()
        # vLLM's /pooling: task classify gives the probabilities as float32; a classifier
        # has no per-token task here, so no task is a 400 naming it.
        pooled = httpx.post(srv.base_url + "/pooling", timeout=30,
                            json={"input": texts, "task": "classify"}).json()
        pooled_raw = httpx.post(srv.base_url + "/pooling", timeout=30, json={
            "input": texts[:2], "task": "classify", "use_activation": False}).json()
        untasked = httpx.post(srv.base_url + "/pooling", json={"input": "hi"}, timeout=30)
    assert answer["object"] == "list" and answer["id"].startswith("classify-")
    assert [d["index"] for d in answer["data"]] == list(range(len(texts)))
    assert [d["label"] for d in answer["data"]] == want_labels
    assert all(d["num_classes"] == 3 for d in answer["data"])
    assert np.allclose([d["probs"] for d in answer["data"]], want, atol=1e-5)
    tokens = sum(len(t) for t in tok(texts)["input_ids"])
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                               "completion_tokens": 0, "prompt_tokens_details": None}
    assert np.allclose([d["probs"] for d in raw["data"]], logits[:2].numpy(), atol=1e-4)
    assert np.allclose(by_ids["data"][0]["probs"], want[2], atol=1e-5)
    for field, response in refused.items():
        assert response.status_code == 400, field
        assert response.json()["error"]["param"] == field
    assert embed.status_code == 400 and embed.json()["error"]["param"] == "model"
    assert [d["object"] for d in pooled["data"]] == ["pooling"] * len(texts)
    assert np.allclose([d["data"] for d in pooled["data"]], want, atol=1e-5)
    assert np.allclose([d["data"] for d in pooled_raw["data"]], logits[:2].numpy(), atol=1e-4)
    assert untasked.status_code == 400 and untasked.json()["error"]["param"] == "task"
    assert "/classify" in spec["paths"]
    assert "use_activation" in spec["components"]["schemas"]["ClassificationRequest"]["properties"]


def test_classify_with_a_cross_encoder_and_an_embedder(server, cross_encoder: Path) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    texts = ["Berlin is the capital of Germany.", "A cat sat on the mat."]
    tok = AutoTokenizer.from_pretrained(str(cross_encoder))
    hf = BertForSequenceClassification.from_pretrained(str(cross_encoder)).eval()
    with torch.no_grad():
        want = torch.sigmoid(hf(**tok(texts, padding=True, return_tensors="pt")).logits[:, 0])
    opener = lambda: engine.open_engine(str(cross_encoder), dtype="float32")  # noqa: E731
    with ServerThread(opener) as srv:
        one_label = httpx.post(srv.base_url + "/classify", json={"input": texts}, timeout=30).json()
    assert [d["label"] for d in one_label["data"]] == [hf.config.id2label[0]] * 2
    assert np.allclose([d["probs"][0] for d in one_label["data"]], want.numpy(), atol=1e-5)
    # An embedding model has no classes to give.
    refused = httpx.post(server.base_url + "/classify", json={"input": "hi"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_langchain_openai_embeddings(server, st_embeddings: np.ndarray) -> None:
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts, not tiktoken ids of another vocabulary.
    lc = OpenAIEmbeddings(model="all-MiniLM-L6-v2", base_url=server.base_url + "/v1",
                          api_key="unused", check_embedding_ctx_length=False, max_retries=0)
    corpus = sentences()
    docs = np.array(lc.embed_documents(corpus[:10]))
    query = np.array([lc.embed_query(corpus[10])])
    assert cosines(docs, st_embeddings[:10]).min() >= 0.9999
    assert cosines(query, st_embeddings[10:11]).min() >= 0.9999


def test_score_and_rerank_with_an_embedder_are_cosines(server, st_embeddings: np.ndarray) -> None:
    corpus = sentences()
    query, docs = corpus[0], corpus[1:6]
    want = cosines(np.repeat(st_embeddings[:1], 5, axis=0), st_embeddings[1:6])
    score = httpx.post(server.base_url + "/v1/score", timeout=30,
                       json={"text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in score["data"]] == list(range(5))
    assert np.allclose([d["score"] for d in score["data"]], want, atol=1e-4)
    rerank = httpx.post(server.base_url + "/v1/rerank", timeout=30,
                        json={"query": query, "documents": docs, "top_n": 3}).json()
    order = list(np.argsort(-want, kind="stable")[:3])
    assert [r["index"] for r in rerank["results"]] == order
    assert [r["document"]["text"] for r in rerank["results"]] == [docs[i] for i in order]
    assert np.allclose([r["relevance_score"] for r in rerank["results"]], want[order], atol=1e-4)


def test_rerank_with_a_cross_encoder_matches_transformers(cross_encoder: Path) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    query = "How many people live in Berlin?"
    docs = ["Berlin has a population of 3,520,031 registered inhabitants.",
            "New York City is famous for the Metropolitan Museum of Art.",
            "Berlin is the capital of Germany."]
    opener = lambda: engine.open_engine(str(cross_encoder), dtype="float32")  # noqa: E731
    with ServerThread(opener) as srv:
        rerank = httpx.post(srv.base_url + "/rerank", timeout=30, json={
            "query": query, "documents": [{"text": d} for d in docs],
            "return_documents": False}).json()
        score = httpx.post(srv.base_url + "/score", timeout=30,
                           json={"text_1": [query, query], "text_2": docs[:2]}).json()
        embed = httpx.post(srv.base_url + "/v1/embeddings", timeout=30, json={"input": "x"})
    tok = AutoTokenizer.from_pretrained(str(cross_encoder))
    model = BertForSequenceClassification.from_pretrained(str(cross_encoder)).eval()
    with torch.no_grad():
        batch = tok([query] * 3, docs, padding=True, return_tensors="pt")
        want = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
    order = list(np.argsort(-want, kind="stable"))
    assert [r["index"] for r in rerank["results"]] == order
    assert "document" not in rerank["results"][0]
    assert np.allclose([r["relevance_score"] for r in rerank["results"]], want[order], atol=1e-5)
    assert np.allclose([d["score"] for d in score["data"]], want[:2], atol=1e-5)
    assert embed.status_code == 400 and embed.json()["error"]["param"] == "model"


def test_a_generation_model_refuses_embeddings(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = tiny_model(tmp_path_factory)
    opener = lambda: engine.open_engine(str(model), dtype="float32",  # noqa: E731
                                        kv_cache_memory=4 * 1024 * 1024)
    with ServerThread(opener) as srv:
        response = httpx.post(srv.base_url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert response.status_code == 400
    assert "--convert embed" in response.json()["error"]["message"]


def _prompt_tokens_total(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("engine:prompt_tokens_total"))
    return float(line.split()[-1])


def test_pooling_requests_count_their_input_tokens_in_the_metrics(server) -> None:
    before = _prompt_tokens_total(server)
    answer = httpx.post(server.base_url + "/v1/embeddings", timeout=30,
                        json={"input": ["one two three", "four"]}).json()
    assert _prompt_tokens_total(server) - before == answer["usage"]["prompt_tokens"]


def test_base64_is_little_endian_float32(server) -> None:
    body = httpx.post(server.base_url + "/v1/embeddings", timeout=30,
                      json={"input": "hello", "encoding_format": "base64"}).json()
    floats = httpx.post(server.base_url + "/v1/embeddings", timeout=30,
                        json={"input": "hello"}).json()
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (384,)
    assert np.array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype="<f4"))
    # The float text is each float32 value exactly, widened to a double: read as doubles
    # (as json and the openai client read it), the floats equal the base64's values.
    assert np.array_equal(decoded.astype(np.float64),
                          np.array(floats["data"][0]["embedding"], dtype=np.float64))


def _steps(server) -> float:
    """Engine steps so far: the count of the per-step token histogram."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines()
                if x.startswith("engine:iteration_tokens_total_count"))
    return float(line.split()[-1])


def test_concurrent_requests_share_steps_and_get_the_vectors_they_get_alone(
    server, st_embeddings: np.ndarray
) -> None:
    # Requests from different connections that arrive together are batched into one
    # encoder step (up to the token budget); each must still get its own sentence's vector,
    # whatever the lengths beside it (the encoder attends within each sequence only).
    corpus = sentences()
    picks = list(range(0, 96, 4))  # 24 sentences of 2 to ~60 tokens

    def post(i: int) -> np.ndarray:
        body = httpx.post(server.base_url + "/v1/embeddings", timeout=60,
                          json={"input": corpus[i], "encoding_format": "base64"}).json()
        return np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")

    alone = np.stack([post(i) for i in picks])
    before = _steps(server)
    with ThreadPoolExecutor(len(picks)) as pool:
        together = np.stack(list(pool.map(post, picks)))
    steps = _steps(server) - before
    assert steps < len(picks)  # some requests shared a step
    assert cosines(together, st_embeddings[picks]).min() >= 0.9999
    assert cosines(alone, st_embeddings[picks]).min() >= 0.9999
    # The same vectors, to float32 rounding of a matmul run over a different number of rows.
    assert np.abs(together - alone).max() <= 1e-6


# -- chat-style embeddings (vLLM's `messages` on /v1/embeddings) ----------------------------

CHAT = [{"role": "system", "content": "You embed support tickets."},
        {"role": "user", "content": "My order arrived broken; I want a refund."}]


@pytest.fixture(scope="module")
def chat_embedder(tmp_path_factory: pytest.TempPathFactory):
    """A decoder with a chat template, served as an embedding model (last-token pooling)."""
    from engine.models.testing import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("chat-embed") / "llama", "llama")
    opener = lambda: engine.open_engine(model=str(folder), runner="pooling", convert="embed")  # noqa: E731
    with ServerThread(opener) as srv:
        yield srv, folder


@pytest.mark.parametrize("generation_prompt", [None, True])
def test_chat_messages_embed_as_the_templates_tokens_do(chat_embedder, generation_prompt) -> None:
    from transformers import AutoTokenizer

    server, folder = chat_embedder
    extra = {} if generation_prompt is None else {"add_generation_prompt": generation_prompt}
    # transformers renders the messages (vLLM's default for embeddings: no generation
    # prompt), and the same server embeds those ids given as input.
    ids = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=bool(generation_prompt), return_dict=False)
    url = f"{server.base_url}/v1/embeddings"
    by_chat = httpx.post(url, json={"messages": CHAT, **extra}, timeout=60).json()
    by_ids = httpx.post(url, json={"input": [list(ids)]}, timeout=60).json()
    assert by_chat["usage"]["prompt_tokens"] == len(ids)
    assert by_chat["data"][0]["embedding"] == by_ids["data"][0]["embedding"]


def test_chat_embeddings_refuse_what_they_cannot_render(chat_embedder, server) -> None:
    chat_server, _ = chat_embedder
    url = f"{chat_server.base_url}/v1/embeddings"
    for body, param in (({"messages": CHAT, "input": "both"}, "messages"),
                        ({"encoding_format": "float"}, "input"),
                        ({"messages": CHAT, "continue_final_message": True,
                          "add_generation_prompt": True}, "continue_final_message")):
        reply = httpx.post(url, json=body, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    # MiniLM has no chat template: a 400, and the server embeds on.
    reply = httpx.post(f"{server.base_url}/v1/embeddings", json={"messages": CHAT}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "ok"},
                      timeout=60).status_code == 200


# -- vLLM's /pooling and the base64 encodings ---------------------------------------------

def test_pooling_route_gives_sentence_transformers_token_embeddings(server, minilm: Path) -> None:
    from sentence_transformers import SentenceTransformer

    texts = sentences()[:3]
    st = SentenceTransformer(str(minilm), device="cpu")
    rows = st.encode(texts, output_value="token_embeddings")
    url = server.base_url + "/pooling"
    # No task: an embedding model's per-token task, each row normalised as the model's
    # embeddings are (MiniLM's pipeline ends with Normalize).
    default = httpx.post(url, json={"input": texts}, timeout=30).json()
    raw = httpx.post(url, json={"input": texts, "task": "token_embed", "normalize": False},
                     timeout=30).json()
    packed = httpx.post(url, json={"input": texts, "encoding_format": "base64"}, timeout=30).json()
    assert default["object"] == "list" and default["id"].startswith("pool-")
    assert default["usage"]["prompt_tokens"] == sum(len(r) for r in rows)
    for i, want in enumerate(rows):
        got = np.array(default["data"][i]["data"])
        assert default["data"][i]["object"] == "pooling" and got.shape == tuple(want.shape)
        assert np.allclose(got, torch.nn.functional.normalize(want, dim=1).numpy(), atol=1e-5)
        assert np.allclose(raw["data"][i]["data"], want.numpy(), atol=1e-4)
        unpacked = np.frombuffer(base64.b64decode(packed["data"][i]["data"]), dtype="<f4")
        assert np.array_equal(unpacked.reshape(got.shape), got.astype("<f4"))
    # task embed: what /v1/embeddings gives.
    one = httpx.post(url, json={"input": texts[0], "task": "embed"}, timeout=30).json()
    same = httpx.post(server.base_url + "/v1/embeddings", json={"input": texts[0]}, timeout=30).json()
    assert one["data"][0]["data"] == same["data"][0]["embedding"]
    for body, param in (({"input": "hi", "task": "token_classify"}, "task"),
                        ({"input": "hi", "task": "score"}, "task"),
                        ({"input": "hi", "task": "classify"}, "task"),
                        ({"input": "hi", "dimensions": 8}, "dimensions"),
                        ({"input": "hi", "task": "embed", "use_activation": True}, "use_activation"),
                        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": "hi", "softmax": True}, "softmax")):
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    spec = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    assert "/pooling" in spec["paths"]
    assert "task" in spec["components"]["schemas"]["PoolingRequest"]["properties"]


@pytest.mark.parametrize("endianness", ["native", "little", "big"])
def test_embed_dtype_and_endianness_write_each_value_as_asked(server, endianness: str) -> None:
    """vLLM's base64 options, decoded as a client decodes them: numpy's float16 and
    torch's bfloat16 and fp8 casts of the float32 values the float format gives."""
    import sys

    url = server.base_url + "/v1/embeddings"
    floats = np.array(httpx.post(url, json={"input": "hello there"}, timeout=30)
                      .json()["data"][0]["embedding"], dtype=np.float32)
    order = {"native": "<" if sys.byteorder == "little" else ">", "little": "<", "big": ">"}[endianness]

    def fetch(dtype: str) -> bytes:
        body = {"input": "hello there", "encoding_format": "base64", "embed_dtype": dtype,
                "endianness": endianness}
        return base64.b64decode(httpx.post(url, json=body, timeout=30).json()["data"][0]["embedding"])

    assert np.array_equal(np.frombuffer(fetch("float32"), dtype=order + "f4"), floats)
    half = np.frombuffer(fetch("float16"), dtype=order + "f2")
    assert np.array_equal(half, floats.astype(np.float16))
    # bfloat16: the top half of each float32's bits.
    top = np.frombuffer(fetch("bfloat16"), dtype=order + "u2").astype(np.uint32) << 16
    want = torch.from_numpy(floats).to(torch.bfloat16).float().numpy()
    assert np.array_equal(top.view(np.float32), want)
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        raw = torch.from_numpy(np.frombuffer(fetch(name), dtype=np.uint8).copy())
        assert torch.equal(raw.view(dtype).float(), torch.from_numpy(floats).to(dtype).float())
    # The same options on /pooling's per-token rows.
    rows = httpx.post(server.base_url + "/pooling", timeout=30,
                      json={"input": "hello there"}).json()["data"][0]["data"]
    packed = httpx.post(server.base_url + "/pooling", timeout=30, json={
        "input": "hello there", "encoding_format": "base64", "embed_dtype": "float16",
        "endianness": endianness}).json()["data"][0]["data"]
    got = np.frombuffer(base64.b64decode(packed), dtype=order + "f2").reshape(len(rows), -1)
    assert np.array_equal(got, np.array(rows, dtype=np.float32).astype(np.float16))


def test_pooling_route_runs_a_token_classifier_as_transformers(tagger: Path) -> None:
    """vLLM's token_classify: the default task of /pooling for a token classifier, and of
    LLM.encode; every token's probabilities against transformers' softmax."""
    from transformers import AutoTokenizer, BertForTokenClassification

    texts = ["Ada Lovelace was born in London.", "Paris"]
    tok = AutoTokenizer.from_pretrained(str(tagger))
    hf = BertForTokenClassification.from_pretrained(str(tagger)).eval()
    with torch.no_grad():
        logits = [hf(**tok(t, return_tensors="pt")).logits[0] for t in texts]
    opener = lambda: engine.open_engine(str(tagger), dtype="float32")  # noqa: E731
    with ServerThread(opener) as srv:
        url = srv.base_url + "/pooling"
        default = httpx.post(url, json={"input": texts}, timeout=30).json()
        raw = httpx.post(url, json={"input": texts[0], "task": "token_classify",
                                    "use_activation": False, "encoding_format": "base64"},
                         timeout=30).json()
        refused = [(httpx.post(url, json=body, timeout=30), param) for body, param in (
            ({"input": "hi", "task": "classify"}, "task"),
            ({"input": "hi", "normalize": True}, "normalize"),
            ({"input": "hi", "dimensions": 2}, "dimensions"))]
        classify = httpx.post(srv.base_url + "/classify", json={"input": "hi"}, timeout=30)
    for item, want in zip(default["data"], logits, strict=True):
        assert np.allclose(item["data"], torch.softmax(want.double(), -1).numpy(), atol=1e-5)
    unpacked = np.frombuffer(base64.b64decode(raw["data"][0]["data"]), dtype="<f4")
    assert np.allclose(unpacked.reshape(logits[0].shape), logits[0].numpy(), atol=1e-4)
    assert default["usage"]["prompt_tokens"] == sum(len(w) for w in logits)
    for reply, param in refused:
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert classify.status_code == 400 and classify.json()["error"]["param"] == "model"
    with engine.LLM(str(tagger), dtype="float32") as llm:
        encoded = llm.encode(texts, use_tqdm=False)
        raw_encoded = llm.encode(texts, engine.PoolingParams(use_activation=False),
                                 pooling_task="token_classify", use_tqdm=False)
    for out, out_raw, want in zip(encoded, raw_encoded, logits, strict=True):
        assert np.allclose(out.outputs.data.numpy(), torch.softmax(want.double(), -1).numpy(),
                           atol=1e-5)
        assert np.allclose(out_raw.outputs.data.numpy(), want.numpy(), atol=1e-4)


def test_embeddings_with_a_lora_adapter_name_match_peft(tmp_path: Path) -> None:
    """A decoder embedder with --enable-lora: /v1/embeddings and /pooling answer an
    adapter's name with its embeddings (peft's hidden states), named for it."""
    from test_lora import write_peft_adapters

    from engine.models.testing import write_tiny_model

    base = write_tiny_model(tmp_path / "base", "llama")
    peft = write_peft_adapters(base, tmp_path, {"aa": dict(r=8, lora_alpha=16)}, seed=4)
    ids = [5, 17, 42, 99, 123, 7, 64]
    with torch.no_grad():
        rows = peft.base_model.model.model(torch.tensor([ids])).last_hidden_state[0]
    want = torch.nn.functional.normalize(rows[-1], dim=0).numpy()
    opener = lambda: engine.open_engine(  # noqa: E731
        str(base), dtype="float32", runner="pooling", enable_lora=True,
        lora_modules=[f"aa={tmp_path / 'aa'}"], kv_cache_memory=4 * 2**20)
    with ServerThread(opener) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model="aa", input=[ids], encoding_format="float")
        plain = client.embeddings.create(model=srv.engine.model_name, input=[ids],
                                         encoding_format="float")
        tokens = httpx.post(srv.base_url + "/pooling", timeout=30, json={
            "model": "aa", "input": [ids], "normalize": False}).json()
        unknown = httpx.post(srv.base_url + "/v1/embeddings", json={"model": "zz", "input": "x"},
                             timeout=30)
        texts = ["the cat sat", "a dog ran off"]
        score = httpx.post(srv.base_url + "/score", timeout=30, json={
            "model": "aa", "text_1": texts[0], "text_2": texts[1]}).json()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    with torch.no_grad():
        vectors = [torch.nn.functional.normalize(peft.base_model.model.model(
            torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0, -1], dim=0) for t in texts]
    assert score["model"] == "aa"
    assert score["data"][0]["score"] == pytest.approx(float(vectors[0] @ vectors[1]), abs=1e-5)
    assert got.model == "aa" and tokens["model"] == "aa"
    assert np.allclose(got.data[0].embedding, want, atol=1e-5)
    assert not np.allclose(plain.data[0].embedding, want, atol=1e-3)
    assert np.allclose(tokens["data"][0]["data"], rows.numpy(), atol=1e-4)
    assert unknown.status_code == 404


def test_bytes_encoding_sends_the_values_as_the_body_with_their_metadata(server) -> None:
    """vLLM's encoding_format "bytes": the body is every input's values back to back, the
    metadata header says where each one lies and its shape; "bytes_only" leaves it out."""
    import json

    texts = ["hello there", "a second, longer input to embed"]
    url = server.base_url + "/v1/embeddings"
    floats = [np.array(d["embedding"], dtype=np.float32) for d in
              httpx.post(url, json={"input": texts}, timeout=30).json()["data"]]
    reply = httpx.post(url, timeout=30, json={"input": texts, "encoding_format": "bytes",
                                              "embed_dtype": "float16", "endianness": "big"})
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/octet-stream"
    meta = json.loads(reply.headers["metadata"])
    assert meta["usage"]["prompt_tokens"] > 0 and meta["id"].startswith("embd-")
    for item, want in zip(meta["data"], floats, strict=True):
        assert (item["embed_dtype"], item["endianness"], item["shape"]) == ("float16", "big", [384])
        got = np.frombuffer(reply.content[item["start"]:item["end"]], dtype=">f2")
        assert np.array_equal(got, want.astype(np.float16))
    bare = httpx.post(url, timeout=30, json={"input": texts, "encoding_format": "bytes_only",
                                             "embed_dtype": "float16", "endianness": "big"})
    assert "metadata" not in bare.headers and bare.content == reply.content
    # /pooling's per-token rows: a [tokens, width] shape each.
    rows = httpx.post(server.base_url + "/pooling", json={"input": texts[0]}, timeout=30).json()
    packed = httpx.post(server.base_url + "/pooling", timeout=30,
                        json={"input": texts[0], "encoding_format": "bytes"})
    (item,) = json.loads(packed.headers["metadata"])["data"]
    matrix = np.array(rows["data"][0]["data"], dtype=np.float32)
    assert item["shape"] == list(matrix.shape)
    assert np.array_equal(np.frombuffer(packed.content, dtype="<f4").reshape(matrix.shape), matrix)
