"""A tiny random Qwen2-Audio for the tests: the tiny Qwen2 decoder (engine.models.testing)
behind a two-layer Whisper-style audio tower, with a Whisper feature extractor whose
window is two seconds (200 log-mel frames of 16 bins), so a clip costs little to encode."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from engine.models.testing import _weights, write_tiny_model

AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
TINY_AUDIO_SECONDS = 2
TINY_AUDIO_RATE = 16000
TINY_MEL_BINS = 16

# Qwen2-Audio-Instruct's conversation format: ChatML with a default system turn, each
# clip written as "Audio N: " and its three tokens on a line of its own.
QWEN2_AUDIO_TEMPLATE = (
    "{% set clips = namespace(n=0) %}"
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if 'audio' in part or 'audio_url' in part or part['type'] == 'audio' %}"
    "{% set clips.n = clips.n + 1 %}"
    "Audio {{ clips.n }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_qwen2_audio(path: str | Path, *, seed: int = 0, d_model: int = 32, layers: int = 2,
                           heads: int = 4, ffn: int = 64, mel_bins: int = TINY_MEL_BINS,
                           seconds: int = TINY_AUDIO_SECONDS,
                           text_overrides: dict | None = None) -> Path:
    """A tiny random Qwen2-Audio in folder ``path``, in the layout of the released
    checkpoints (transformers 4's names: ``audio_tower.*``, ``multi_modal_projector.*``,
    ``language_model.*``): config.json from ``Qwen2AudioConfig``, model.safetensors, the
    tiny tokenizer with the three audio tokens and the template above, and a
    ``WhisperFeatureExtractor`` (preprocessor_config.json). The tower's shape and window
    may be set (bench/audio.py writes the released one: 1,280 wide, 32 layers of 20 heads,
    5,120 in the MLP, 128 bins, 30 seconds); ``text_overrides`` are the decoder's
    (:func:`write_tiny_model`'s ``overrides``)."""
    # transformers is heavy and only the audio tests need it: imported here, on use.
    from transformers import Qwen2AudioConfig, WhisperFeatureExtractor

    path = Path(path)
    write_tiny_model(path, "qwen2", seed=seed, chat_template=QWEN2_AUDIO_TEMPLATE,
                     overrides=text_overrides)
    tok = Tokenizer.from_str((path / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(t, special=True) for t in AUDIO_TOKENS])
    ids = {t: tok.token_to_id(t) for t in AUDIO_TOKENS}
    (path / "tokenizer.json").write_text(tok.to_str())
    text = json.loads((path / "config.json").read_text())
    # Untied: with a tied head these random weights mostly repeat the last token.
    text.update(vocab_size=max(ids.values()) + 1, tie_word_embeddings=False)
    frames = seconds * TINY_AUDIO_RATE // 160
    d = d_model
    audio = dict(num_mel_bins=mel_bins, d_model=d, encoder_layers=layers,
                 encoder_attention_heads=heads, encoder_ffn_dim=ffn, max_source_positions=frames // 2)
    text_cfg = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")}
    cfg = Qwen2AudioConfig(audio_config=audio, text_config=text_cfg,
                           audio_token_index=ids["<|AUDIO|>"])
    cfg.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["Qwen2AudioForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int, std: float = 0.2, fan: int = 0) -> torch.Tensor:
        # Scaled down by the inputs summed (``fan``) past the tiny tower's widest (96), so
        # a wide tower's activations stay in range; the tiny one's weights are as drawn.
        return torch.randn(*shape, generator=gen) * (std * min(1.0, (96 / max(fan, 1)) ** 0.5))

    weights = {}
    for k, v in _weights(text, seed).items():
        weights[k.replace("model.", "language_model.model.", 1) if k.startswith("model.")
                else "language_model." + k] = v
    t = "audio_tower."

    def linear(name: str, out: int, inp: int, bias: bool = True, std: float = 0.2) -> None:
        weights[name + ".weight"] = rand(out, inp, std=std, fan=inp)
        if bias:
            weights[name + ".bias"] = rand(out, std=0.1)

    def norm(name: str, n: int) -> None:
        weights[name + ".weight"] = 1 + rand(n, std=0.1)
        weights[name + ".bias"] = rand(n, std=0.1)

    weights[t + "conv1.weight"] = rand(d, mel_bins, 3, std=0.3, fan=3 * mel_bins)
    weights[t + "conv1.bias"] = rand(d, std=0.1)
    weights[t + "conv2.weight"] = rand(d, d, 3, std=0.2, fan=3 * d)
    weights[t + "conv2.bias"] = rand(d, std=0.1)
    weights[t + "embed_positions.weight"] = rand(frames // 2, d, std=0.5)
    for i in range(layers):
        p = f"{t}layers.{i}."
        norm(p + "self_attn_layer_norm", d)
        norm(p + "final_layer_norm", d)
        linear(p + "self_attn.q_proj", d, d)
        linear(p + "self_attn.k_proj", d, d, bias=False)
        linear(p + "self_attn.v_proj", d, d)
        linear(p + "self_attn.out_proj", d, d)
        linear(p + "fc1", ffn, d)
        linear(p + "fc2", d, ffn)
    norm(t + "layer_norm", d)
    linear("multi_modal_projector.linear", text["hidden_size"], d, std=1.0)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=TINY_AUDIO_RATE,
                            hop_length=160, chunk_length=seconds,
                            n_fft=400).save_pretrained(path)
    return path


# Whisper's special tokens, as its tokenizer has them (a few of its 99 languages), after
# the text's and the end of text (<|eot|> here: the tiny tokenizer's <|endoftext|> is its
# first id, and Whisper's timestamp rules tell text from the rest by the end's id).
WHISPER_TOKENS = ("<|eot|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|de|>", "<|translate|>",
                  "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                  "<|notimestamps|>")


def write_tiny_whisper(path: str | Path, *, seed: int = 0, d_model: int = 32, layers: int = 2,
                       heads: int = 4, ffn: int = 64, mel_bins: int = TINY_MEL_BINS,
                       seconds: int = TINY_AUDIO_SECONDS, positions: int = 64) -> Path:
    """A tiny random Whisper in folder ``path``: config.json from ``WhisperConfig`` (two
    encoder and two decoder layers 32 wide, a two-second window of 16 log-mel bins, 64
    decoder positions), model.safetensors under transformers' names (``model.encoder.*``,
    ``model.decoder.*``; the head tied to the token table), the tiny tokenizer with
    Whisper's special tokens, generation_config.json and a ``WhisperFeatureExtractor``. The
    shape may be set (bench/whisper.py writes whisper-base's: 512 wide, 6 + 6 layers of 8
    heads, 2,048 in the MLPs, 80 bins, the 30-second window, 448 positions)."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    path = Path(path)
    write_tiny_model(path, "llama", seed=seed)
    tok = Tokenizer.from_str((path / "tokenizer.json").read_text())
    # Then a timestamp token every 20 ms of the window, <|0.00|> to <|30.00|> (Whisper's).
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(seconds * 50 + 1)]
    tok.add_special_tokens([AddedToken(t, special=True) for t in (*WHISPER_TOKENS, *stamps)])
    ids = {t: tok.token_to_id(t) for t in WHISPER_TOKENS}
    last = tok.token_to_id(stamps[-1])
    (path / "tokenizer.json").write_text(tok.to_str())
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(eos_token="<|eot|>", chat_template=None)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    frames = seconds * TINY_AUDIO_RATE // 160
    eos, start = ids["<|eot|>"], ids["<|startoftranscript|>"]
    cfg = WhisperConfig(vocab_size=last + 1, num_mel_bins=mel_bins, d_model=d_model,
                        encoder_layers=layers, encoder_attention_heads=heads, encoder_ffn_dim=ffn,
                        decoder_layers=layers, decoder_attention_heads=heads, decoder_ffn_dim=ffn,
                        max_source_positions=frames // 2, max_target_positions=positions,
                        eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
                        decoder_start_token_id=start, suppress_tokens=[], begin_suppress_tokens=[])
    (path / "config.json").unlink()
    cfg.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["WhisperForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    shapes = {k: v.shape for k, v in WhisperForConditionalGeneration(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    weights = {}
    for name, shape in shapes.items():
        if name == "proj_out.weight":
            continue  # tied to model.decoder.embed_tokens
        if "layer_norm" in name:
            w = (1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            w = 0.1 * torch.randn(shape, generator=gen)
        elif "embed" in name:
            w = 0.3 * torch.randn(shape, generator=gen)
        else:  # a projection or convolution: scaled by its inputs
            fan = shape[1] * (shape[2] if len(shape) == 3 else 1)
            w = torch.randn(shape, generator=gen) * (1.5 / fan**0.5)
        weights[name] = w.contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    langs = {t: ids[t] for t in WHISPER_TOKENS if t[2:-2] in ("en", "fr", "de")}
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "decoder_start_token_id": start,
         "is_multilingual": True, "lang_to_id": langs,
         "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
         "no_timestamps_token_id": ids["<|notimestamps|>"], "max_initial_timestamp_index": 50,
         "suppress_tokens": [], "begin_suppress_tokens": []}, indent=2))
    WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=TINY_AUDIO_RATE,
                            hop_length=160, chunk_length=seconds, n_fft=400).save_pretrained(path)
    return path


__all__ = ["AUDIO_TOKENS", "QWEN2_AUDIO_TEMPLATE", "TINY_AUDIO_RATE", "TINY_AUDIO_SECONDS",
           "WHISPER_TOKENS", "write_tiny_qwen2_audio", "write_tiny_whisper"]
