"""vLLM's engine arguments that reshape the model or its KV pool: ``hf_overrides``
(``--hf-overrides``) and ``num_gpu_blocks_override`` (``--num-gpu-blocks-override``).

The oracle of an override is transformers: the same weights under a config that
transformers builds from config.json's keys with the same overrides set over them, run on
the same prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 12, 30, 4, 77]
NEW_TOKENS = 8
# A rope the folder's config does not have: linear scaling by 4 changes every position's
# rotation, so a model that ignored the override would give other logits at once.
ROPE = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500.0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hf-overrides") / "llama", "llama")


def _transformers_greedy(folder: Path, overrides: dict[str, Any]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after PROMPT, and the log-probabilities of the first."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    # config.json's keys with the overrides set over them, built by transformers (its
    # from_pretrained(**kwargs) sets attributes after the rope parameters are read).
    raw, _ = PretrainedConfig.get_config_dict(str(folder))
    config = AutoConfig.for_model(**{**raw, **overrides})
    hf = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(PROMPT):].tolist(), torch.log_softmax(out.logits[0][0].double(), -1)


def _engine_greedy(llm: LLM) -> tuple[list[int], dict[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    first = {token: p.logprob for token, p in out.outputs[0].logprobs[0].items()}
    return list(out.outputs[0].token_ids), first


@pytest.mark.parametrize("given", ["dict", "json"])
def test_hf_overrides_run_the_model_transformers_builds_from_the_same_overrides(
    folder: Path, given: str,
) -> None:
    want_tokens, want_first = _transformers_greedy(folder, ROPE)
    plain_tokens, plain_first = _transformers_greedy(folder, {})
    # The override changes the model: otherwise this test could not tell it was applied.
    assert not torch.allclose(want_first, plain_first, atol=1e-3)
    overrides = ROPE if given == "dict" else json.dumps(ROPE)  # LLM(...) and --hf-overrides
    with LLM(str(folder), dtype="float32", hf_overrides=overrides, max_model_len=128) as llm:
        tokens, first = _engine_greedy(llm)
    assert tokens == want_tokens
    for token, logprob in first.items():
        assert abs(logprob - float(want_first[token])) < 1e-4


def test_hf_overrides_reach_an_engine_core_process(folder: Path) -> None:
    want_tokens, _ = _transformers_greedy(folder, ROPE)
    with LLM(str(folder), dtype="float32", hf_overrides=ROPE, max_model_len=128,
             engine_core="process") as llm:
        tokens, _ = _engine_greedy(llm)
    assert tokens == want_tokens


def test_an_override_the_engine_cannot_run_is_refused_at_startup_as_config_json_would_be(
    folder: Path,
) -> None:
    with pytest.raises(ConfigError, match="hf_overrides"):
        LLM(str(folder), hf_overrides=["not", "an", "object"])
    with pytest.raises(ConfigError, match="hf_overrides is not JSON"):
        LLM(str(folder), hf_overrides="{rope_theta: 1}")
    # A length past the model's (its max_position_embeddings) is refused; with the
    # override lifting it, the same length loads.
    config = json.loads((folder / "config.json").read_text())
    longer = 2 * config["max_position_embeddings"]
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(str(folder), max_model_len=longer)
    with LLM(str(folder), max_model_len=longer, hf_overrides={"max_position_embeddings": longer}) as llm:
        assert llm._engine.config.max_model_len == longer


def test_num_gpu_blocks_override_sizes_the_pool_and_a_pool_too_small_is_refused(folder: Path) -> None:
    with LLM(str(folder), num_gpu_blocks_override=11, block_size=16) as llm:
        assert (llm.statistics().kv_blocks_total, llm._engine.config.max_model_len) == (11, 11 * 16)
        # Four requests of 5 blocks each in a pool of 11: they wait for blocks or are
        # preempted, and each still gives the tokens it gives alone.
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        (solo,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 4, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [solo.outputs[0].token_ids] * 4
        after = llm.statistics()
        assert after.preemptions > 0 and after.kv_blocks_free == 11
    with pytest.raises(ConfigError, match="num_gpu_blocks_override 2 blocks"):
        LLM(str(folder), num_gpu_blocks_override=2, block_size=16, max_model_len=64)
    with pytest.raises(ConfigError, match="num_gpu_blocks_override"):
        LLM(str(folder), num_gpu_blocks_override=0)
