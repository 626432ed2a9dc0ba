"""Vision-language checkpoints on text prompts (Gemma 3 4B+'s
``Gemma3ForConditionalGeneration``, whose images tests/test_gemma3_vision.py checks, and
Mistral Small 3.x's ``Mistral3ForConditionalGeneration``, served as its text model): tiny
ones written by transformers around the tiny text models' weights, their greedy tokens on
text prompts against transformers' own vision-language class, and for Mistral 3 an image in
a chat request refused (its tower is not loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import collect, token_ids
from safetensors.torch import load_file

import engine
from engine.errors import InvalidParamError, UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.models.testing import write_tiny_model
from engine.models.vision_config import Gemma3VisionConfig
from engine.params import SamplingParams

NEW_TOKENS = 16


def _vlm(tmp_path: Path, kind: str) -> Path:
    """A tiny vision-language checkpoint whose language model holds the tiny text model's
    weights (so its greedy text varies); the tower random at transformers' init."""
    import transformers

    text_arch = "gemma3" if kind == "gemma3" else "mistral"
    folder = write_tiny_model(tmp_path / kind, text_arch)
    text = json.loads((folder / "config.json").read_text())
    text = {k: v for k, v in text.items() if k not in ("architectures",)}
    if kind == "gemma3":
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                           image_token_index=380, boi_token_index=381, eoi_token_index=382,
                                           tie_word_embeddings=text["tie_word_embeddings"])
    else:
        vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14, head_dim=16)
        config = transformers.Mistral3Config(text_config=text, vision_config=vision.to_dict(),
                                             image_token_index=380, spatial_merge_size=1,
                                             tie_word_embeddings=text["tie_word_embeddings"])
    cls = getattr(transformers, "Gemma3ForConditionalGeneration" if kind == "gemma3" else "Mistral3ForConditionalGeneration")
    torch.manual_seed(0)
    model = cls(config).eval()
    weights = load_file(str(folder / "model.safetensors"))
    language = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    missing, unexpected = model.model.language_model.load_state_dict(language, strict=False)
    assert not unexpected and not missing
    if "lm_head.weight" in weights:
        model.lm_head.weight.data.copy_(weights["lm_head.weight"])
    (folder / "model.safetensors").unlink()
    (folder / "config.json").unlink()
    model.save_pretrained(str(folder))
    if kind == "gemma3":  # its image processor, which the engine loads with the tower
        transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28}).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize(("kind", "v4_names"), [("gemma3", False), ("mistral3", False), ("mistral3", True)])
async def test_a_vision_language_checkpoint_serves_its_text_model_as_transformers_does(
    tmp_path: Path, kind: str, v4_names: bool
) -> None:
    import transformers
    from safetensors.torch import save_file

    folder = _vlm(tmp_path, kind)
    if v4_names:  # transformers 4 saved the language model as language_model.model.* / .lm_head
        def v4(name: str) -> str:
            if name.startswith("model.language_model."):
                return "language_model.model." + name.removeprefix("model.language_model.")
            return "language_model." + name if name.startswith("lm_head.") else name

        for f in sorted(folder.glob("*.safetensors")):
            renamed = {v4(k): v for k, v in load_file(str(f)).items()}
            save_file(renamed, str(f), metadata={"format": "pt"})
    saved = json.loads((folder / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, saved).from_pretrained(str(folder)).eval()
    prompts = [[5, 17, 33, 101, 7, 9, 250], [44, 3, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    config = load_model(folder).config
    assert config.text_of == saved
    assert isinstance(config.vision, Gemma3VisionConfig) if kind == "gemma3" else config.vision is None
    async with engine.open_engine(folder, dtype="float32") as eng:
        got = [token_ids(await collect(eng, p, params)) for p in prompts]
        if kind == "mistral3":
            with pytest.raises(InvalidParamError, match="takes text only, not images"):
                await eng.chat([{"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], params)
    with torch.no_grad():
        for p, tokens in zip(prompts, got, strict=True):
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False)
            assert tokens == out[0, len(p):].tolist()
    assert len({tuple(t) for t in got}) == len(got) and len(set(got[0])) > 2  # not one token repeated


def test_a_text_model_the_engine_does_not_compute_is_refused_by_name(tmp_path: Path) -> None:
    raw = {"architectures": ["Mistral3ForConditionalGeneration"],
           "text_config": {"model_type": "ministral3", "vocab_size": 10}}
    with pytest.raises(UnsupportedModelError, match="'ministral3'"):
        ModelConfig.from_hf(raw)
