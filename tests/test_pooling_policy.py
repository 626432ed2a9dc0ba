"""The pooling path's pure parts (issue 22): the scheduler's handling of pooling requests
(paged for a decoder embedder, KV-free for an encoder) and the task a model's files give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core.block_pool import BlockPool
from engine.core.scheduler import Scheduler, SchedulerConfig, run_with_pool
from engine.errors import ConfigError, InputTooLongError, UnsupportedModelError
from engine.messages import (
    AllocatorCall,
    PooledOutput,
    SchedulerRequest,
    StepPlan,
    StepResult,
)
from engine.models.config import ModelConfig
from engine.models.pooling import pooler_config
from engine.params import SamplingParams

PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def _scheduler(*, paged: bool, budget: int = 16, blocks: int = 32) -> tuple[Scheduler, BlockPool]:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, block_size=4,
                             max_model_len=64, num_kv_blocks=blocks, pooling=True,
                             paged_kv=paged)
    return Scheduler(config), BlockPool(blocks, 4)


def _add(sched: Scheduler, rid: str, length: int) -> None:
    sched.add_request(SchedulerRequest(rid, tuple(range(10, 10 + length)), PARAMS, (), 1, 0,
                                       0.0, None, None))


def _pooled(plan: StepPlan) -> StepResult:
    return StepResult(plan.step_id, (), 0.0, pooled=tuple(
        PooledOutput(c.sample_id, b"\0\0\0\0") for c in plan.chunks if c.sample))


def test_a_decoder_embedder_chunks_its_prompt_and_frees_its_blocks_when_pooled() -> None:
    sched, pool = _scheduler(paged=True, budget=8)
    _add(sched, "a", 20)
    finished = {}
    for _ in range(3):  # 8 + 8 + 4 tokens
        plan = run_with_pool(sched.schedule(), pool)
        assert all(c.block_ids for c in plan.chunks)
        update = sched.update_from_output(plan, _pooled(plan))
        for call in update.allocator_calls:
            pool.handle(call)
        finished.update({d.sample_id: d for d in update.deltas})
    assert [(c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(16, 4, True)]
    assert finished["a"].finish_reason == "stop" and finished["a"].pooled == b"\0\0\0\0"
    assert sched.get_request("a") is None and sched.statistics().running == 0
    assert pool.num_free_blocks == 32  # every block back once pooled


def test_an_encoder_runs_whole_prompts_and_never_calls_the_allocator() -> None:
    sched, _ = _scheduler(paged=False, budget=16)
    for rid, length in (("a", 10), ("b", 10), ("c", 4)):
        _add(sched, rid, length)

    def no_allocator(gen):
        try:
            call: AllocatorCall = next(gen)
        except StopIteration as stop:
            return stop.value
        raise AssertionError(f"an encoder's scheduler called the allocator: {call!r}")

    plan = no_allocator(sched.schedule())
    # "b" does not fit what "a" left (6 tokens) and cannot be split; "c" does not overtake it.
    assert [(c.sample_id, c.start, c.num_tokens, c.sample, c.block_ids) for c in plan.chunks] == [
        ("a", 0, 10, True, ())]
    update = sched.update_from_output(plan, _pooled(plan))
    assert update.allocator_calls == () and update.deltas[0].finish_reason == "stop"
    plan = no_allocator(sched.schedule())
    assert [c.sample_id for c in plan.chunks] == ["b", "c"]
    with pytest.raises(InputTooLongError, match="maximum input length is 16"):
        _add(sched, "d", 17)  # over the step budget: it could never run whole


def test_a_pooling_prompt_may_fill_the_context() -> None:
    sched, _ = _scheduler(paged=True, budget=64, blocks=32)
    _add(sched, "full", 64)
    with pytest.raises(InputTooLongError, match="64 tokens"):
        _add(sched, "over", 65)


# -- the task from the files ----------------------------------------------------------------

def _bert(arch: str = "BertModel", **extra) -> ModelConfig:
    return ModelConfig.from_hf({"architectures": [arch], "vocab_size": 100, "hidden_size": 8,
                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                "intermediate_size": 16, **extra})


def _llama(arch: str = "LlamaForCausalLM") -> ModelConfig:
    return ModelConfig.from_hf({"architectures": [arch], "vocab_size": 100,
                                "hidden_size": 8, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "intermediate_size": 16})


def _st_folder(path: Path, modules: list[str], pooling: dict | None = None) -> Path:
    entries = [{"idx": i, "name": str(i), "path": "1_Pooling" if m == "Pooling" else "",
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling or {
        "pooling_mode_max_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return path


def test_sentence_transformers_files_give_pooling_normalisation_and_length(tmp_path: Path) -> None:
    folder = _st_folder(tmp_path, ["Transformer", "Pooling"])
    pooler = pooler_config(_bert(), folder)
    assert (pooler.task, pooler.pooling, pooler.normalize, pooler.max_seq_length) == (
        "embed", "max", False, 128)
    assert pooler_config(_bert(), folder, pooling_type="cls", normalize=True).pooling == "cls"
    # Without sentence-transformers files: CLS for BERT, normalised (vLLM's defaults).
    bare = pooler_config(_bert(), tmp_path / "nothing-here")
    assert (bare.pooling, bare.normalize, bare.max_seq_length) == ("cls", True, None)
    # A causal LM with a sentence-transformers folder embeds; without one it generates.
    assert pooler_config(_llama(), folder).task == "embed"
    assert pooler_config(_llama(), tmp_path / "nothing-here") is None
    assert pooler_config(_llama(), tmp_path / "nothing-here", convert="embed").pooling == "last"
    # A decoder saved without its LM head (Qwen3-Embedding's Qwen3Model) embeds, only.
    assert pooler_config(_llama("Qwen3Model"), tmp_path / "nothing-here").task == "embed"
    with pytest.raises(ConfigError, match="cannot generate"):
        pooler_config(_llama("Qwen3Model"), tmp_path / "nothing-here", runner="generate")


def test_pipelines_and_flags_the_engine_cannot_honour_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="LayerNorm"):
        pooler_config(_bert(), _st_folder(tmp_path, ["Transformer", "Pooling", "LayerNorm"]))
    # Dense modules run on the pooled vector only, and with the activations read here.
    with pytest.raises(UnsupportedModelError, match="between the Pooling and the Normalize"):
        pooler_config(_bert(), _st_folder(tmp_path, ["Transformer", "Dense", "Pooling"]))
    dense = _st_folder(tmp_path, ["Transformer", "Pooling", "Dense"])
    (dense / "2_Dense").mkdir()
    (dense / "modules.json").write_text(json.dumps(
        [*json.loads((dense / "modules.json").read_text())[:2],
         {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (dense / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": 32, "out_features": 8, "bias": True,
        "activation_function": "torch.nn.modules.activation.ReLU"}))
    with pytest.raises(UnsupportedModelError, match="ReLU"):
        pooler_config(_bert(), dense)
    with pytest.raises(UnsupportedModelError, match="weightedmean"):
        pooler_config(_bert(), _st_folder(tmp_path, ["Transformer", "Pooling"], {
            "pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ConfigError) as info:
        pooler_config(_bert(), tmp_path, runner="generate")
    assert info.value.field == "runner"
    with pytest.raises(ConfigError):
        pooler_config(_bert("BertForSequenceClassification", num_labels=1), tmp_path,
                      pooling_type="mean")
    with pytest.raises(ConfigError):
        pooler_config(_llama(), tmp_path, runner="generate", convert="embed")
    assert pooler_config(_bert("BertForSequenceClassification", num_labels=1), tmp_path).size == 1
