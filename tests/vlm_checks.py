"""What the vision-language tests (tests/test_llava.py, test_qwen_vl.py,
test_gemma3_vision.py) check alike: a request's logprobs and tokens against transformers',
and peft adapters over the language model (as vLLM serves them) against peft's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.engine_helpers import collect, greedy, token_ids, wait_idle

# The language model's projections only: the towers' layers are named alike.
LM_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def write_vlm_adapter(model: Any, out: Path, targets: str = LM_TARGETS, seed: int = 5) -> Any:
    """A rank-8 peft adapter over transformers' ``model`` (wrapped in place) with random A
    and B (peft starts B at zero, an adapter that changes nothing), saved to ``out``;
    the PeftModel, in eval mode."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(target_modules=targets, r=8, lora_alpha=16,
                                                  lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(out)
    return peft_model.eval()


def dense(entry: Any, vocab: int) -> torch.Tensor:
    """A logprobs entry's alternatives as a vocabulary-wide row (NaN where absent)."""
    row = torch.full((vocab,), float("nan"))
    for token, logprob in entry.top:
        row[token] = logprob
    return row


def hf_forward_and_generate(model: Any, inputs: Any, new_tokens: int):
    """transformers' side of a check: ``(prompt ids, log-softmax at every prompt
    position, greedy new tokens, each step's log-softmax)`` of the processor's ``inputs``."""
    with torch.no_grad():
        logits = model(**inputs).logits[0]
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    ids = inputs["input_ids"][0].tolist()
    new = out.sequences[0, len(ids):].tolist()
    steps = torch.stack([s[0] for s in out.logits])
    return ids, torch.log_softmax(logits.float(), -1), new, torch.log_softmax(steps.float(), -1)


def assert_matches_transformers(outs: list[Any], hf_logprobs: torch.Tensor, hf_new: list[int],
                                hf_steps: torch.Tensor) -> None:
    """One request's outputs (with ``prompt_logprobs`` and ``logprobs`` of the whole
    vocabulary) against transformers' prompt logprobs, greedy tokens and their logprobs."""
    vocab = hf_logprobs.shape[-1]
    got = torch.stack([dense(e, vocab) for e in outs[0].prompt_logprobs[1:]])
    torch.testing.assert_close(got, hf_logprobs[:-1], atol=2e-4, rtol=0)
    assert token_ids(outs) == hf_new
    sampled = torch.stack([dense(e, vocab) for o in outs for e in o.logprobs])
    torch.testing.assert_close(sampled, hf_steps, atol=2e-4, rtol=0)


async def tokens_with_adapter(opened: Any, messages: list[dict], new_tokens: int) -> dict:
    """Greedy tokens of ``messages`` through the engine ``opened`` (an ``open_engine``
    context serving adapter ``lm``): ``{None: the base's, "lm": the adapter's}``."""
    async with opened as eng:
        got = {lora: token_ids(await collect(eng, messages, greedy(new_tokens), lora=lora))
               for lora in (None, "lm")}
        await wait_idle(eng)
    return got


def image_only(processor_cls: type) -> type:
    """transformers' processor class ``processor_cls`` without its video half, whose video
    processor needs torchvision (not installed here); images need none of it."""

    class ImageOnly(processor_cls):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, name, arg):  # noqa: ANN001, ANN202
            if arg is not None:
                return super().check_argument_for_proper_class(name, arg)
            return None

    return ImageOnly


def assert_served_like_transformers(folder: Path, messages: list[dict], expected: str,
                                    prompt_tokens: int, new_tokens: int) -> None:
    """The official ``openai`` client against ``serve`` of ``folder`` with its engine core
    in a process of its own: the chat answer is transformers' text ``expected`` and the
    usage counts ``prompt_tokens``."""
    import openai

    import engine.api
    from tests.http_server import ServerThread

    def open_engine():  # noqa: ANN202
        return engine.api.open_engine(str(folder), served_model_name="tiny-vlm", dtype="float32",
                                      kv_cache_memory=8 * 2**20, block_size=4, engine_core="process")

    with ServerThread(open_engine) as server, openai.OpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(model="tiny-vlm", messages=messages, temperature=0,
                                               max_tokens=new_tokens, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == prompt_tokens

