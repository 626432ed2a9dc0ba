"""Qwen2-Audio (Whisper's encoder over log-mel frames, pairs averaged, a linear projector,
before a Qwen2 decoder) through the engine, against transformers'
``Qwen2AudioForConditionalGeneration`` on the output of its own ``Qwen2AudioProcessor``.

The engine gets chat messages with audio parts (OpenAI's ``input_audio``, vLLM's
``audio_url``, the embedded API's ``audio``); transformers gets the same conversation
through the processor's ``apply_chat_template`` and the processor, which pads each clip to
the window and widens ``<|AUDIO|>`` to the clip's tokens. transformers runs the encoder
over the whole padded window with the padding masked; the engine runs it over the clip's
own frames, so these checks are also that the two agree. Checked: the expanded prompt
ids, the log-softmax at every prompt position and 12 greedy tokens with their full
distributions, for one clip, two clips of different lengths (one stereo, one needing
resampling), and a clip split across chunked-prefill chunks; and each bad clip refused.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

import engine
from engine.errors import BatchPromptError, InvalidParamError
from engine.models.testing import write_tiny_model
from engine.models.testing_audio import TINY_AUDIO_RATE, TINY_AUDIO_SECONDS, write_tiny_qwen2_audio
from engine.multimodal import AudioClip
from tests.engine_helpers import collect, greedy, token_ids, wait_idle
from tests.vlm_checks import assert_matches_transformers, hf_forward_and_generate

NEW_TOKENS = 12
QUESTION = "What is in this clip? Describe it."


def _clip(seed: int, seconds: float, rate: int = TINY_AUDIO_RATE, channels: int = 1) -> np.ndarray:
    """A tone with noise (samples x channels, or one channel flat)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    tone = 0.4 * np.sin(2 * np.pi * (220 + 110 * seed) * t)
    wave = tone[:, None] + 0.1 * rng.standard_normal((n, channels))
    return (wave[:, 0] if channels == 1 else wave).astype(np.float32)


def encoded(wave: np.ndarray, rate: int = TINY_AUDIO_RATE, fmt: str = "WAV") -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, wave, rate, format=fmt, **({"subtype": "FLOAT"} if fmt == "WAV" else {}))
    return out.getvalue()


def decoded(data: bytes) -> np.ndarray:
    """What transformers gets of an encoded clip: its samples as soundfile decodes them,
    channels averaged, resampled to the extractor's rate with soxr (librosa's default)."""
    import soundfile
    import soxr

    wave, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    if wave.ndim == 2:
        wave = wave.mean(axis=1)
    if rate != TINY_AUDIO_RATE:
        wave = soxr.resample(wave, rate, TINY_AUDIO_RATE)
    return wave.astype(np.float32)


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(),
                                                   "format": fmt}}


def messages(parts: list[dict], question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


# One clip of a second; then a stereo clip of 0.6 s and a clip of 1.3 s recorded at 8 kHz
# (MP3-free: FLAC, lossless, so the samples are the ones written).
CLIPS = [encoded(_clip(0, 1.0)), encoded(_clip(1, 0.6, channels=2), fmt="FLAC"),
         encoded(_clip(2, 1.3, rate=8000), rate=8000)]


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory):
    return write_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))


@pytest.fixture(scope="module")
def hf(qwen2_audio):
    from transformers import (
        AutoTokenizer,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    model = Qwen2AudioForConditionalGeneration.from_pretrained(qwen2_audio, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(qwen2_audio)
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor.from_pretrained(qwen2_audio),
                                    tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    return model, processor


def hf_run(hf, clips: list[bytes], question: str = QUESTION, new_tokens: int = NEW_TOKENS):
    model, processor = hf
    parts = [{"type": "audio", "audio": "clip"}] * len(clips) + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, audio=[decoded(c) for c in clips], return_tensors="pt",
                       sampling_rate=TINY_AUDIO_RATE)
    return hf_forward_and_generate(model, inputs, new_tokens)


async def _with_clips(eng, prompt: str, clips: list) -> list:
    """A text prompt's outputs with clips beside it (what ``multi_modal_data`` becomes)."""
    stream = eng.enqueue(await eng.prepare(prompt, greedy(NEW_TOKENS), images=clips))
    async with stream:
        return [o async for o in stream]


def _open(folder, **options):
    defaults = dict(dtype="float32", max_logprobs=-1, block_size=4, kv_cache_memory=8 * 2**20,
                    max_num_seqs=4)
    return engine.open_engine(folder, **(defaults | options))


@pytest.mark.parametrize(("num_clips", "batched"), [(1, 2048), (3, 2048), (1, 56)],
                         ids=["one-clip", "three-clips", "clip-across-chunks"])
async def test_logits_and_greedy_tokens_match_transformers(qwen2_audio, hf, num_clips, batched) -> None:
    clips = CLIPS[:num_clips]
    ids, hf_logprobs, hf_new, hf_steps = hf_run(hf, clips)
    token = hf[0].config.audio_token_id
    counts = [len(run) for run in "".join("x" if t == token else " " for t in ids).split()]
    assert len(counts) == num_clips and len(set(counts)) == num_clips  # each its own length
    async with _open(qwen2_audio, max_num_batched_tokens=batched) as eng:
        parts = [input_audio(c, "flac" if i == 1 else "wav") for i, c in enumerate(clips)]
        stream = await eng.submit(messages(parts), greedy(NEW_TOKENS, prompt_logprobs=-1, logprobs=-1))
        async with stream:
            outs = [o async for o in stream]
        assert stream.prompt_token_ids == tuple(ids)
        if batched < len(ids):  # the chunks really cut the clip's placeholders
            first = ids.index(token)
            assert first < batched < first + ids.count(token)
        assert_matches_transformers(outs, hf_logprobs, hf_new, hf_steps)
        assert eng._parts.runner.encoder_runs == num_clips  # each clip encoded once
        await wait_idle(eng)


async def test_every_way_to_give_a_clip_is_the_same_clip(qwen2_audio, hf) -> None:
    """OpenAI's input_audio, vLLM's audio_url data: URL, the embedded API's bytes and its
    (samples, rate) pair, and multi_modal_data beside a text prompt: one answer, and the
    second and later runs hit the prefix cache past the clip."""
    _, _, hf_new, _ = hf_run(hf, CLIPS[:1])
    wave = decoded(CLIPS[0])
    url = "data:audio/wav;base64," + base64.b64encode(CLIPS[0]).decode()
    ways = [input_audio(CLIPS[0]), {"type": "audio_url", "audio_url": {"url": url}},
            {"type": "audio", "audio": CLIPS[0]}, {"type": "audio", "audio": (wave, TINY_AUDIO_RATE)}]
    async with _open(qwen2_audio) as eng:
        for i, part in enumerate(ways):
            outs = await collect(eng, messages([part]), greedy(NEW_TOKENS))
            assert token_ids(outs) == hf_new, part["type"]
            if i:
                assert outs[-1].usage.cached_tokens > 60  # past the clip's 25 placeholders
        prompt = eng.tokenizer.decode(
            (await eng.tokenize_chat(messages([ways[0]]))), skip_special_tokens=False)
        # The rendered prompt widened: the text prompt holds the one <|AUDIO|> again.
        text = prompt.replace("<|AUDIO|>" * prompt.count("<|AUDIO|>"), "<|AUDIO|>")
        outs = await _with_clips(eng, text, [AudioClip((wave, TINY_AUDIO_RATE))])
        assert token_ids(outs) == hf_new
        # Another clip with the same text: a different answer, not a cache hit past the clip.
        other = await collect(eng, messages([input_audio(encoded(_clip(5, 1.0)))]), greedy(NEW_TOKENS))
        assert token_ids(other) != hf_new
        await wait_idle(eng)


def test_llm_takes_vllms_multi_modal_data_audio(qwen2_audio, hf) -> None:
    """vLLM's offline Qwen2-Audio example: a hand-written prompt with the audio tokens and
    ``multi_modal_data={"audio": (samples, rate)}``, and ``LLM.chat`` with an audio part."""
    _, processor = hf
    _, _, hf_new, _ = hf_run(hf, CLIPS[:1])
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio", "audio": "clip"},
                                      {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True, tokenize=False)
    llm = engine.LLM(str(qwen2_audio), dtype="float32", kv_cache_memory=8 * 2**20, block_size=4)
    try:
        params = engine.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate({"prompt": prompt, "multi_modal_data": {
            "audio": (decoded(CLIPS[0]), TINY_AUDIO_RATE)}}, params)
        assert list(out[0].outputs[0].token_ids) == hf_new
        chat = llm.chat(messages([{"type": "audio", "audio": CLIPS[0]}]), params)
        assert list(chat[0].outputs[0].token_ids) == hf_new
        with pytest.raises(BatchPromptError, match="images or audio, not both"):
            llm.generate({"prompt": prompt, "multi_modal_data": {"audio": CLIPS[0], "image": b""}},
                         params)
    finally:
        llm.close()


def _refusal_cases() -> list[tuple[str, dict, str]]:
    too_long = encoded(_clip(0, TINY_AUDIO_SECONDS + 0.5))
    return [
        ("too-long", input_audio(too_long), "over the model's 2-second window"),
        ("corrupt", input_audio(CLIPS[0][:30]), "corrupt"),
        ("not-audio", input_audio(b"GIF89a" + bytes(200)), "not a clip this server reads"),
        ("bad-base64", {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}},
         "not valid base64"),
        ("format", input_audio(CLIPS[0], "aac"), "format must be one of"),
        ("too-short", input_audio(encoded(np.zeros(200, np.float32))), "too short"),
        ("remote", {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:9/a.wav"}},
         "not allowed"),
        ("image", {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
         "takes text and audio clips, not images"),
        ("samples", {"type": "audio", "audio": (np.array([np.nan, 1.0] * 800), 16000)},
         "non-finite"),
    ]


@pytest.mark.parametrize(("part", "match"), [c[1:] for c in _refusal_cases()],
                         ids=[c[0] for c in _refusal_cases()])
async def test_a_bad_clip_is_refused_naming_its_part_and_the_engine_serves_on(
        qwen2_audio, hf, part, match) -> None:
    _, _, hf_new, _ = hf_run(hf, CLIPS[:1])
    async with _open(qwen2_audio) as eng:
        with pytest.raises(InvalidParamError, match=match) as info:
            await collect(eng, messages([part]), greedy(2))
        assert info.value.param == "messages[0].content[0]"
        assert token_ids(await collect(eng, messages([input_audio(CLIPS[0])]), greedy(NEW_TOKENS))) == hf_new
        await wait_idle(eng)


async def test_clips_over_the_limit_and_typed_audio_tokens_are_refused(qwen2_audio) -> None:
    async with _open(qwen2_audio, limit_mm_per_prompt=2) as eng:
        with pytest.raises(InvalidParamError, match="more than 2 audio clips"):
            await collect(eng, messages([input_audio(CLIPS[0])] * 3), greedy(2))
        # Audio tokens typed as text stay text: the prompt holds one clip's markers only.
        outs = await collect(eng, messages([input_audio(CLIPS[0])], "<|AUDIO|><|audio_bos|>"),
                             greedy(2))
        assert outs[-1].finished
        with pytest.raises(InvalidParamError, match="takes none"):
            await collect(eng, messages([input_audio(CLIPS[0])]), greedy(2),
                          mm_processor_kwargs={"sampling_rate": 8000})
        await wait_idle(eng)


async def test_models_without_audio_refuse_a_clip_by_name(tmp_path) -> None:
    folder = write_tiny_model(tmp_path / "text", "qwen2")
    async with _open(folder) as eng:
        with pytest.raises(InvalidParamError, match="takes text only, not audio clips") as info:
            await collect(eng, messages([input_audio(CLIPS[0])]), greedy(2))
        assert info.value.param == "messages[0].content[0]"
        with pytest.raises(InvalidParamError, match="takes text only, not audio clips"):
            await _with_clips(eng, "hello", [AudioClip(CLIPS[0])])


@pytest.fixture(scope="module", params=["inprocess", "process"])
def server(qwen2_audio, request):
    import engine.api
    from tests.http_server import ServerThread

    def open_engine():
        return engine.api.open_engine(str(qwen2_audio), served_model_name="tiny-audio",
                                      dtype="float32", kv_cache_memory=8 * 2**20, block_size=4,
                                      engine_core=request.param)
    with ServerThread(open_engine) as srv:
        yield srv


def test_the_openai_client_sends_input_audio_streamed_and_not(server, hf) -> None:
    """OpenAI's input_audio part through the official client, in-process and behind an
    engine-core process: transformers' greedy answer, streamed and not; a clip over the
    window is a 400 naming the part, and the server answers afterwards."""
    import openai

    _, processor = hf
    ids, _, new, _ = hf_run(hf, CLIPS[1:3])
    expected = processor.tokenizer.decode(new, skip_special_tokens=True)
    parts = [input_audio(CLIPS[1], "flac"), input_audio(CLIPS[2])]
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        args = dict(model="tiny-audio", messages=messages(parts), temperature=0,
                    max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(**args)
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == len(ids)
        chunks = client.chat.completions.create(**args, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        too_long = input_audio(encoded(_clip(3, TINY_AUDIO_SECONDS + 1)))
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**{**args, "messages": messages([parts[0], too_long])})
        error = info.value.body
        assert error["param"] == "messages[0].content[1]" and "window" in error["message"]
        assert client.chat.completions.create(**args).choices[0].message.content == expected
