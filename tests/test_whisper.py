"""Whisper (an audio encoder over the 30-second window and GPT-2's decoder with a
cross-attention to it) through the engine and ``/v1/audio/transcriptions``, against
transformers' ``WhisperForConditionalGeneration``.

The oracle: transformers' feature extractor on the same samples, its encoder, then its
model's logits for the decoder prompt and each greedy token fed back (teacher forcing
its own choices), to the end of text or of the 64 decoder positions. Checked: the
engine's tokens and their log-probabilities for one clip, two clips in one batch (each
row attends to its own request's clip), a previous-text prompt cut across prefill chunks;
the official ``openai`` client's transcription (json, text, streamed) against
transformers' text, in-process and behind an engine-core process; a clip longer than the
window cut into pieces, each transformers' transcription of its piece; and the refusals.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import torch

import engine
from engine import cli
from engine.api.transcription import cut_points, whisper_prompt
from engine.errors import InvalidParamError
from engine.models.testing import write_tiny_model
from engine.models.testing_audio import TINY_AUDIO_RATE, write_tiny_whisper
from engine.multimodal import AudioClip
from tests.engine_helpers import collect, greedy, native_threads, token_ids, wait_idle
from tests.http_server import ServerThread

MAX_POSITIONS = 64  # the tiny decoder's max_target_positions


def _clip(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * TINY_AUDIO_RATE)) / TINY_AUDIO_RATE
    return (0.4 * np.sin(2 * np.pi * (250 + 70 * seed) * t)
            + 0.1 * rng.standard_normal(len(t))).astype(np.float32)


def _wav(wave: np.ndarray) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, wave, TINY_AUDIO_RATE, format="WAV", subtype="FLOAT")
    return out.getvalue()


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return write_tiny_whisper(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="module")
def hf(whisper):
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
    return model, WhisperFeatureExtractor.from_pretrained(whisper), AutoTokenizer.from_pretrained(whisper)


def hf_greedy(hf, wave: np.ndarray, prompt: list[int], limit: int = MAX_POSITIONS):
    """transformers' greedy tokens after ``prompt`` and each step's log-softmax."""
    model, extractor, _ = hf
    features = extractor(wave, sampling_rate=TINY_AUDIO_RATE, return_tensors="pt").input_features
    ids = torch.tensor([prompt])
    steps = []
    with torch.no_grad():
        encoded = model.model.encoder(features).last_hidden_state
        while ids.shape[1] < limit:
            logits = model(encoder_outputs=(encoded,), decoder_input_ids=ids).logits[0, -1]
            steps.append(torch.log_softmax(logits.float(), -1))
            ids = torch.cat([ids, logits.argmax().view(1, 1)], 1)
            if int(ids[0, -1]) == model.config.eos_token_id:
                break
    return ids[0, len(prompt):].tolist(), torch.stack(steps)


def hf_language(hf, wave: np.ndarray) -> str:
    """The language transformers' ``detect_language`` finds in the clip."""
    model, extractor, tok = hf
    features = extractor(wave, sampling_rate=TINY_AUDIO_RATE, return_tensors="pt").input_features
    with torch.no_grad():
        token = model.detect_language(features)[0]
    return tok.convert_ids_to_tokens(int(token))[2:-2]


def _prompt(eng_or_folder, **kw) -> list[int]:
    """The decoder prompt the transcription route builds (engine.api.transcription)."""
    from engine.models.tokenizer import Tokenizer

    tok = getattr(eng_or_folder, "tokenizer", None) or Tokenizer.from_folder(eng_or_folder)
    return list(whisper_prompt(tok, language=kw.get("language"), task=kw.get("task", "transcribe"),
                               prompt=kw.get("prompt")))


def _open(folder, **options):
    defaults = dict(dtype="float32", max_logprobs=-1, block_size=4, kv_cache_memory=8 * 2**20,
                    max_num_seqs=4)
    return engine.open_engine(folder, **(defaults | options))


async def _run(eng, prompt: list[int], wave: np.ndarray, **params):
    stream = eng.enqueue(await eng.prepare(prompt, engine.SamplingParams(
        temperature=0, max_tokens=None, **params), images=[AudioClip((wave, TINY_AUDIO_RATE))]))
    async with stream:
        return [o async for o in stream]


async def test_tokens_and_logprobs_match_transformers_one_at_a_time_and_batched(whisper, hf) -> None:
    import trio

    waves = [_clip(0, 1.0), _clip(1, 1.7), _clip(7, 0.6)]
    async with _open(whisper) as eng:
        prompt = _prompt(eng)
        runs = eng._parts.runner.encoder_runs  # the warm-up's silent clip's
        expected = [hf_greedy(hf, w, prompt) for w in waves]
        assert expected[0][0] != expected[1][0]  # two clips, two answers
        outs = await _run(eng, prompt, waves[0], logprobs=-1)
        assert token_ids(outs) == expected[0][0]
        ours = torch.tensor([[lp for _, lp in sorted(e.top)] for o in outs for e in o.logprobs])
        assert torch.allclose(ours, expected[0][1], atol=2e-4)
        results: dict[int, list] = {}

        async def one(i: int) -> None:
            results[i] = await _run(eng, prompt, waves[i])

        async with trio.open_nursery() as nursery:  # one batch: each row its own clip
            for i in (1, 2):
                nursery.start_soon(one, i)
        for i in (1, 2):
            assert token_ids(results[i]) == expected[i][0]
        assert eng._parts.runner.encoder_runs - runs == 3  # each request's clip once
        await wait_idle(eng)


async def test_a_previous_text_prompt_cut_across_chunks_matches_transformers(whisper, hf) -> None:
    wave = _clip(2, 1.2)
    async with _open(whisper, max_num_batched_tokens=8) as eng:
        prompt = _prompt(eng, prompt="hello there, this is what came before the clip", language="fr")
        assert len(prompt) > 8  # the prompt's prefill takes several steps
        expected, _ = hf_greedy(hf, wave, prompt)
        assert token_ids(await _run(eng, prompt, wave)) == expected
        await wait_idle(eng)


async def test_a_whisper_request_needs_one_clip_and_other_models_do_not_transcribe(whisper, tmp_path) -> None:
    async with _open(whisper) as eng:
        with pytest.raises(InvalidParamError, match="transcribes one audio clip") as info:
            await collect(eng, _prompt(eng), greedy(2))
        assert info.value.param == "model"
        with pytest.raises(InvalidParamError, match="language 'xx'"):
            _prompt(eng, language="xx")
    from engine.api.transcription import transcribe

    async with _open(write_tiny_model(tmp_path / "text", "llama")) as eng:
        with pytest.raises(InvalidParamError, match="does not transcribe audio"):
            await transcribe(eng, _wav(_clip(0, 1.0)))


def test_cut_points_fall_in_each_windows_last_second_at_its_quietest() -> None:
    rate, window = 100, 3.0
    samples = np.ones(800, dtype=np.float32)
    samples[250:260] = 0  # a silence in the first window's last second
    cuts = cut_points(samples, rate, window)
    assert cuts[0] == 250
    pieces = np.diff([0, *cuts, len(samples)])
    assert all(0 < p <= window * rate for p in pieces)
    assert cut_points(samples[:300], rate, window) == []


@pytest.fixture(scope="module", params=["inprocess", "process"])
def server(whisper, request):
    import engine.api

    def open_engine():
        return engine.api.open_engine(str(whisper), served_model_name="tiny-whisper",
                                      dtype="float32", kv_cache_memory=8 * 2**20, block_size=4,
                                      engine_core=request.param)
    with ServerThread(open_engine) as srv:
        yield srv


def test_the_openai_client_transcribes_as_transformers_does(server, hf, whisper) -> None:
    """json, text and streamed transcriptions; a translation; a clip three windows long
    cut into pieces, each transcribed as transformers transcribes that piece."""
    tok = hf[2]  # transformers' tokenizer decodes the oracle's tokens
    wave = _clip(3, 1.5)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        new, _ = hf_greedy(hf, wave, _prompt(whisper, language="fr"))
        expected = tok.decode(new, skip_special_tokens=True)
        reply = client.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", _wav(wave)),
                                                   language="fr")
        assert reply.text == expected and reply.usage.seconds == 2
        text = client.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", _wav(wave)),
                                                  language="fr", response_format="text")
        assert text == expected
        events = list(client.audio.transcriptions.create(
            model="tiny-whisper", file=("a.wav", _wav(wave)), language="fr", stream=True))
        assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == expected
        assert events[-1].type == "transcript.text.done" and events[-1].text == expected
        lang = hf_language(hf, wave)  # no language given: detected, as transformers does
        new, _ = hf_greedy(hf, wave, _prompt(whisper, task="translate", language=lang))
        # (The openai client's translations call is deprecated: the form, as it sends it.)
        translated = httpx.post(server.base_url + "/v1/audio/translations",
                                files={"file": ("a.wav", _wav(wave))}, data={"model": "tiny-whisper"})
        assert translated.json()["text"] == tok.decode(new, skip_special_tokens=True)
        refused = httpx.post(server.base_url + "/v1/audio/translations", files={
            "file": ("a.wav", _wav(wave))}, data={"model": "tiny-whisper", "language": "fr"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "language"
        # Five seconds: three pieces of at most the two-second window.
        long = np.concatenate([_clip(4, 1.9), np.zeros(800, np.float32), _clip(5, 1.9),
                               np.zeros(800, np.float32), _clip(6, 0.9)])
        cuts = [0, *cut_points(long, TINY_AUDIO_RATE, 2.0), len(long)]
        assert len(cuts) == 4
        texts = [tok.decode(hf_greedy(hf, long[a:b], _prompt(whisper, language="de"))[0],
                            skip_special_tokens=True) for a, b in zip(cuts, cuts[1:], strict=False)]
        joined = texts[0]
        for t in texts[1:]:
            joined += t if not t or t[0].isspace() else " " + t
        reply = client.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", _wav(long)),
                                                   language="de")
        assert reply.text == joined


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(response_format="srt", stream=True), "response_format"),
    (dict(response_format="verbose_json", timestamp_granularities=["word"]), "timestamp_granularities[]"),
    (dict(language="xx"), "language"),
    (dict(model="another-model"), "model"),
    (dict(file=("a.wav", b"RIFF not really a wav")), "file"),
    (dict(temperature=3.5), "temperature"),
], ids=["streamed-srt", "word-timestamps", "language", "model", "corrupt", "temperature"])
def test_a_bad_transcription_is_refused_naming_the_field(server, kwargs, param) -> None:
    args = dict(model="tiny-whisper", file=("a.wav", _wav(_clip(0, 1.0)))) | kwargs
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as info:
            client.audio.transcriptions.create(**args)
        assert info.value.body["param"] == param
        with pytest.raises(openai.BadRequestError, match="transcribes one audio clip"):
            client.completions.create(model="tiny-whisper", prompt="hello", max_tokens=2)
        assert client.audio.transcriptions.create(model="tiny-whisper",
                                                  file=("a.wav", _wav(_clip(0, 1.0)))).text is not None


async def test_without_a_language_the_clip_s_is_detected_as_transformers_detects_it(whisper, hf) -> None:
    from engine.api.transcription import transcribe

    waves = [_clip(seed, 1.0) for seed in range(8)]
    langs = [hf_language(hf, w) for w in waves]
    assert len(set(langs)) > 1  # the tiny model tells these clips apart
    async with _open(whisper) as eng:
        for wave, lang in zip(waves, langs, strict=True):
            run = await transcribe(eng, (wave, TINY_AUDIO_RATE))
            assert run.streams[0].prompt_token_ids == tuple(_prompt(eng, language=lang))
            await run.aclose()
        await wait_idle(eng)


async def test_an_english_only_model_takes_neither_language_nor_task_tokens(whisper, hf, tmp_path) -> None:
    import json
    import shutil

    from engine.api.transcription import transcribe

    folder = tmp_path / "whisper.en"
    shutil.copytree(whisper, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"is_multilingual": False}))
    wave = _clip(3, 1.0)
    async with _open(folder) as eng:
        tok = eng.tokenizer
        prompt = [tok.token_to_id("<|startoftranscript|>"), tok.token_to_id("<|notimestamps|>")]
        run = await transcribe(eng, (wave, TINY_AUDIO_RATE))
        assert run.streams[0].prompt_token_ids == tuple(prompt)
        assert await run.text() == hf[2].decode(hf_greedy(hf, wave, prompt)[0], skip_special_tokens=True)
        with pytest.raises(InvalidParamError, match="English only") as info:
            await transcribe(eng, (wave, TINY_AUDIO_RATE), language="fr")
        assert info.value.param == "language"
        with pytest.raises(InvalidParamError, match="does not translate"):
            await transcribe(eng, (wave, TINY_AUDIO_RATE), task="translate")
        await wait_idle(eng)


def test_vllms_sampling_fields_reach_the_sampler(server, hf, whisper) -> None:
    """A seed makes a sampled transcription repeat; max_completion_tokens caps it; a bad
    value is a 400 naming the field."""
    form = {"model": "tiny-whisper", "language": "en", "temperature": "1.0", "seed": "7",
            "top_k": "50"}
    clip = {"file": ("a.wav", _wav(_clip(2, 1.0)))}
    url = server.base_url + "/v1/audio/transcriptions"
    first, again = (httpx.post(url, files=clip, data=form).json()["text"] for _ in range(2))
    assert first == again
    other = httpx.post(url, files=clip, data=form | {"seed": "8"}).json()["text"]
    assert other != first
    short = httpx.post(url, files=clip, data={"model": "tiny-whisper", "language": "en",
                                              "max_completion_tokens": "3"})
    new, _ = hf_greedy(hf, _clip(2, 1.0), _prompt(whisper, language="en"))
    assert short.json()["text"] == hf[2].decode(new[:3], skip_special_tokens=True)
    for field, value in (("top_p", "2.0"), ("seed", "x"), ("max_completion_tokens", "0")):
        refused = httpx.post(url, files=clip, data=form | {field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def hf_timestamped(hf, wave: np.ndarray, prompt: list[int], *, suppress: list[int] | None = None,
                   begin: list[int] | None = None, timestamps: bool = True) -> list[int]:
    """transformers' greedy tokens after ``prompt`` with its own logits processors over each
    step's logits, in the order its Whisper ``generate`` puts them: the tokens suppressed
    at the first step (``begin``) and at every step (``suppress``), then the
    ``WhisperTimeStampLogitsProcessor`` (one window: no seek)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    model, extractor, _ = hf
    rules = LogitsProcessorList()
    if begin:
        rules.append(SuppressTokensAtBeginLogitsProcessor(begin, begin_index=len(prompt)))
    if suppress:
        rules.append(SuppressTokensLogitsProcessor(suppress))
    if timestamps:
        rules.append(WhisperTimeStampLogitsProcessor(model.generation_config, begin_index=len(prompt)))
    features = extractor(wave, sampling_rate=TINY_AUDIO_RATE, return_tensors="pt").input_features
    ids = torch.tensor([prompt])
    with torch.no_grad():
        encoded = model.model.encoder(features).last_hidden_state
        while ids.shape[1] < MAX_POSITIONS:
            logits = model(encoder_outputs=(encoded,), decoder_input_ids=ids).logits[:, -1]
            token = rules(ids, logits).argmax(-1)
            ids = torch.cat([ids, token.view(1, 1)], 1)
            if int(token) == model.config.eos_token_id:
                break
    return ids[0, len(prompt):].tolist()


async def test_timestamps_follow_whispers_rules_as_transformers_applies_them(whisper, hf) -> None:
    """Token for token transformers' decoding under its WhisperTimeStampLogitsProcessor
    (the oracle of the engine's rules), the segments cut at the timestamps' pairs; clips
    whose outputs hold pairs and ones that do not."""
    from engine.api.transcription import transcribe

    eot = hf[0].generation_config.eos_token_id
    first = hf[2].convert_tokens_to_ids("<|notimestamps|>") + 1
    pairs = set()
    async with _open(whisper) as eng:
        prompt = _prompt(eng, language="en")[:-1]  # no <|notimestamps|>
        for seed, seconds in ((0, 0.8), (1, 1.0), (3, 1.4), (10, 1.5), (12, 1.5)):
            wave = _clip(seed, seconds)
            tokens = hf_timestamped(hf, wave, prompt)
            run = await transcribe(eng, (wave, TINY_AUDIO_RATE), language="en", timestamps=True)
            assert run.streams[0].prompt_token_ids == tuple(prompt)
            text, segments = await run.segments(eng.tokenizer)
            ours = [t for seg in segments for t in seg["tokens"]]
            assert ours == [t for t in tokens if t != eot]
            assert ours[0] >= first  # the first token is a timestamp
            stamped = [t >= first for t in ours]
            has_pair = any(a and b for a, b in zip(stamped, stamped[1:], strict=False))
            pairs.add(has_pair)
            for seg in segments[:-1] if has_pair else ():  # each opens on its timestamp
                assert seg["tokens"][0] >= first
                assert seg["start"] == pytest.approx((seg["tokens"][0] - first) * 0.02)
            assert text == hf[2].decode([t for t in tokens if t < first], skip_special_tokens=True)
            await run.aclose()
        await wait_idle(eng)
    assert pairs == {True, False}  # outputs with and without a pair of timestamps


def hf_no_speech(hf, wave: np.ndarray) -> float:
    """transformers' no-speech probability of a window: the softmax, at the
    ``<|startoftranscript|>`` position, of the token before ``<|notimestamps|>``."""
    model, extractor, tok = hf
    features = extractor(wave, sampling_rate=TINY_AUDIO_RATE, return_tensors="pt").input_features
    sot = torch.tensor([[tok.convert_tokens_to_ids("<|startoftranscript|>")]])
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=sot).logits[0, 0]
    return float(logits.float().softmax(-1)[tok.convert_tokens_to_ids("<|notimestamps|>") - 1])


def test_verbose_json_srt_and_vtt_carry_the_segments(server, hf) -> None:
    """verbose_json's segments (each window's no_speech_prob as transformers computes
    it), and srt and vtt cues at the same times."""
    import re

    url = server.base_url + "/v1/audio/transcriptions"
    wave = _clip(4, 1.6)
    clip = {"file": ("a.wav", _wav(wave))}
    form = {"model": "tiny-whisper", "language": "en"}
    verbose = httpx.post(url, files=clip, data=form | {"response_format": "verbose_json",
                                                       "timestamp_granularities[]": "segment"}).json()
    assert verbose["language"] == "en" and verbose["task"] == "transcribe"
    assert abs(verbose["duration"] - 1.6) < 1e-6 and verbose["segments"]
    for s in verbose["segments"]:
        assert 0 <= s["start"] <= s["end"] <= 2.0 and isinstance(s["avg_logprob"], float)
        assert s["no_speech_prob"] == pytest.approx(hf_no_speech(hf, wave), rel=1e-4)
    for fmt, header, mark in (("srt", "", ","), ("vtt", "WEBVTT\n\n", ".")):
        body = httpx.post(url, files=clip, data=form | {"response_format": fmt}).text
        assert body.startswith(header)
        stamps = re.findall(rf"(\d\d):(\d\d):(\d\d){re.escape(mark)}(\d\d\d) --> "
                            rf"(\d\d):(\d\d):(\d\d){re.escape(mark)}(\d\d\d)", body)
        assert len(stamps) == len(verbose["segments"])
        for (h, m, s, ms, *_), seg in zip(stamps, verbose["segments"], strict=True):
            assert int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000 == pytest.approx(seg["start"], abs=1e-3)
    words = httpx.post(url, files=clip, data=form | {"response_format": "verbose_json",
                                                     "timestamp_granularities[]": "word"})
    assert words.status_code == 400 and words.json()["error"]["param"] == "timestamp_granularities[]"
    two = httpx.post(url, data=form, files=[("file", clip["file"]), ("file", clip["file"])])
    assert two.status_code == 400 and two.json()["error"]["param"] == "file"
    twice = httpx.post(url, files=clip, data={"model": "tiny-whisper", "language": ["en", "fr"]})
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "language"


def test_llm_takes_vllms_offline_whisper_prompts(whisper, hf) -> None:
    """vLLM's offline Whisper forms on the LLM: the decoder prompt with the clip in
    multi_modal_data, and the explicit encoder/decoder prompt dict; a malformed one is
    refused naming its key."""
    from engine.errors import BatchPromptError

    wave = _clip(6, 1.2)
    prompt = _prompt(whisper, language="en")
    expected, _ = hf_greedy(hf, wave, prompt)
    text = hf[2].decode(prompt, skip_special_tokens=False)
    llm = engine.LLM(str(whisper), dtype="float32", kv_cache_memory=8 * 2**20, block_size=4)
    try:
        params = engine.SamplingParams(temperature=0, max_tokens=None)
        plain = llm.generate({"prompt": text, "multi_modal_data": {"audio": (wave, TINY_AUDIO_RATE)}},
                             params)
        split = llm.generate([
            {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (wave, TINY_AUDIO_RATE)}},
             "decoder_prompt": text},
            {"encoder_prompt": {"multi_modal_data": {"audio": _wav(wave)}},
             "decoder_prompt": {"prompt_token_ids": prompt}}], params)
        for out in (*plain, *split):
            assert list(out.outputs[0].token_ids) == expected
        with pytest.raises(BatchPromptError, match="encoder_prompt takes multi_modal_data"):
            llm.generate({"encoder_prompt": {"prompt": "hello", "multi_modal_data": {"audio": _wav(wave)}},
                          "decoder_prompt": text}, params)
        with pytest.raises(BatchPromptError, match="not 'cache_salt'"):
            llm.generate({"encoder_prompt": {"multi_modal_data": {"audio": _wav(wave)}},
                          "decoder_prompt": text, "cache_salt": "x"}, params)
    finally:
        llm.close()


async def test_the_clips_cross_attention_memory_is_counted_in_the_kv_budget(whisper, hf) -> None:
    """Each running request keeps its clip's keys and values (every decoder layer's K and
    V over the encoder's positions): max_num_seqs is lowered to what half the budget
    holds, and a budget that cannot hold one request's is refused at startup."""
    from engine.errors import ConfigError

    cfg = hf[0].config
    per = cfg.decoder_layers * 2 * cfg.d_model * cfg.max_source_positions * 4  # float32
    budget = 24 * per
    async with _open(whisper, kv_cache_memory=budget, max_num_seqs=64) as eng:
        assert eng.config.max_num_seqs == 12  # half of 24 requests' worth
        assert eng.statistics().kv_blocks_total * 4 * 2 * cfg.decoder_layers * cfg.d_model * 4 <= budget - 12 * per
        outs = await _run(eng, _prompt(eng, language="en"), _clip(0, 1.0))
        assert token_ids(outs) == hf_greedy(hf, _clip(0, 1.0), _prompt(eng, language="en"))[0]
    with pytest.raises(ConfigError, match="cross-attention keys and values"):
        async with _open(whisper, kv_cache_memory=per):
            pass


async def test_the_checkpoints_suppressed_tokens_are_not_transcribed(whisper, hf, tmp_path) -> None:
    """A checkpoint's ``suppress_tokens`` and ``begin_suppress_tokens`` (its
    generation_config.json) apply to every transcription as transformers' own processors
    apply them, before the timestamp rules; the lists are taken from transformers'
    unsuppressed answer, so they change it. Only Whisper takes the engine's own
    extra_args keys."""
    import json
    import shutil

    from engine.api.transcription import transcribe
    from engine.params import WHISPER_SUPPRESS

    eot = hf[0].generation_config.eos_token_id
    first = hf[2].convert_tokens_to_ids("<|notimestamps|>") + 1
    wave = _clip(4, 1.2)
    prompt = _prompt(whisper, language="en")
    plain = [t for t in hf_timestamped(hf, wave, prompt, timestamps=False) if t != eot]
    stamped = [t for t in hf_timestamped(hf, wave, prompt[:-1]) if t != eot]
    begin = [plain[0], stamped[0]]
    suppress = sorted({*plain[1:4], *[t for t in stamped if t < first][:2]} - set(begin))
    folder = tmp_path / "suppressing"
    shutil.copytree(whisper, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(suppress_tokens=suppress, begin_suppress_tokens=begin)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    want = hf_timestamped(hf, wave, prompt, suppress=suppress, begin=begin, timestamps=False)
    want_stamped = hf_timestamped(hf, wave, prompt[:-1], suppress=suppress, begin=begin)
    assert [t for t in want if t != eot] != plain and [t for t in want_stamped if t != eot] != stamped
    async with _open(folder) as eng:
        run = await transcribe(eng, (wave, TINY_AUDIO_RATE), language="en")
        async with run.streams[0] as stream:
            got = token_ids([o async for o in stream])
        assert got == want
        run = await transcribe(eng, (wave, TINY_AUDIO_RATE), language="en", timestamps=True)
        _, segments = await run.segments(eng.tokenizer)
        assert [t for seg in segments for t in seg["tokens"]] == [t for t in want_stamped if t != eot]
        await wait_idle(eng)
    async with _open(write_tiny_model(tmp_path / "llama", "llama")) as eng:
        with pytest.raises(InvalidParamError, match="engine's own") as info:
            await eng.submit("hello", engine.SamplingParams(max_tokens=2, extra_args={WHISPER_SUPPRESS: True}))
        assert info.value.param == "extra_args"


def test_run_batch_answers_vllms_speech_lines_as_transformers(whisper, hf, tmp_path) -> None:
    """vLLM's batch lines for the speech routes: the clip named by ``file_url`` (a base64
    data: URL), the other fields the form's; json, text and srt answers as transformers
    transcribes the clip, a translation too; a ``file`` field, a file: URL, a host not
    allowed, word timestamps, a stream and a field name that would break the form each
    refused, naming the field."""
    tok = hf[2]
    wave = _clip(3, 1.5)
    clip = "data:audio/wav;base64," + base64.b64encode(_wav(wave)).decode()
    speech, translate = "/v1/audio/transcriptions", "/v1/audio/translations"
    bodies = {
        "json": (speech, {"model": "tiny-whisper", "file_url": clip, "language": "fr"}),
        "text": (speech, {"file_url": clip, "language": "fr", "response_format": "text", "temperature": 0}),
        "srt": (speech, {"file_url": clip, "language": "fr", "response_format": "srt"}),
        "translated": (translate, {"file_url": clip}),
        "file": (speech, {"file": "a.wav", "language": "fr"}),
        "scheme": (speech, {"file_url": "file:///etc/passwd"}),
        "host": (speech, {"file_url": "http://example.com/a.wav"}),
        "words": (speech, {"file_url": clip, "response_format": "verbose_json",
                           "timestamp_granularities": ["word"]}),
        "stream": (speech, {"file_url": clip, "stream": True}),
        "name": (speech, {"file_url": clip, 'x"; name="language': "fr"}),
    }
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": url, "body": body}) + "\n"
                              for k, (url, body) in bodies.items()))
    out = tmp_path / "out.jsonl"
    assert cli.main(["run-batch", "-i", str(source), "-o", str(out), "--model", str(whisper),
                     "--served-model-name", "tiny-whisper", "--dtype", "float32", "--kv-cache-memory", "8MiB",
                     "--block-size", "4", "--no-progress"]) == 0
    got = {item["custom_id"]: item for item in map(json.loads, out.read_text().splitlines())}
    expected = tok.decode(hf_greedy(hf, wave, _prompt(whisper, language="fr"))[0], skip_special_tokens=True)
    assert got["json"]["response"]["body"]["text"] == expected and got["json"]["error"] is None
    assert got["text"]["response"]["body"] == expected
    srt = got["srt"]["response"]["body"]  # the subtitles as the route writes them (tested above), as text
    assert isinstance(srt, str) and srt.startswith("1\n00:00:") and " --> " in srt
    lang = hf_language(hf, wave)
    translated = tok.decode(hf_greedy(hf, wave, _prompt(whisper, task="translate", language=lang))[0],
                            skip_special_tokens=True)
    assert got["translated"]["response"]["body"]["text"] == translated
    for key, param in (("file", "file"), ("scheme", "file_url"), ("host", "file_url"),
                       ("words", "timestamp_granularities[]"), ("name", 'x"; name="language')):
        answer = got[key]
        assert answer["response"]["status_code"] == 400, key
        assert answer["response"]["body"]["error"]["param"] == param == answer["error"]["param"], key
    assert got["stream"]["response"] is None and got["stream"]["error"]["param"] == "body.stream"


async def test_a_clips_features_leave_no_openmp_team_behind(whisper) -> None:
    """Whisper's log-mel features are torch's STFT, run on one of trio's worker threads:
    over two torch threads that starts a team of its own, which (kept while trio keeps the
    thread) would slow every model step. The engine hands it back once the clip is
    preprocessed: a transcription leaves no new thread behind."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        async with _open(whisper) as eng:
            prompt = _prompt(eng, language="en")
            before = native_threads()  # the model thread's team among them (its warm-up's)
            for seed in (1, 2):
                await _run(eng, prompt, _clip(seed, 1.0))
            after = native_threads()
    finally:
        torch.set_num_threads(threads)
    assert not after - before
