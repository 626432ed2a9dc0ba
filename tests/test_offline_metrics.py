"""vLLM's ``LLM.get_metrics()``: the engine's Prometheus series under vLLM's names, read
as vLLM's reader gives them (counters, gauges, histograms, the accepted-per-position
vector), with the LLM's generate and chat requests timed into the request histograms.

Two oracles: prometheus_client's own parser of the same registry's text exposition (what
a server's ``/metrics`` gives), and the outputs the calls returned (their prompt and
output token counts, samples and finish reasons)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from engine.api.metrics import CounterValue, GaugeValue, HistogramValue, VectorValue
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("metrics") / "llama", "llama")


def by_name(metrics: list, name: str, cls: type) -> list:
    found = [m for m in metrics if m.name == name]
    assert found and all(isinstance(m, cls) for m in found), (name, found)
    return found


def test_get_metrics_counts_what_the_calls_returned(folder: Path) -> None:
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9, 10, 11, 12]}]
    with LLM(str(folder)) as llm:
        outputs = llm.generate(prompts, SamplingParams(n=2, max_tokens=4, temperature=0.8, seed=3,
                                                       ignore_eos=True), use_tqdm=False)
        outputs += llm.generate({"prompt_token_ids": [3, 4]},
                                SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[17]),
                                use_tqdm=False)
        metrics = llm.get_metrics()
        text = llm._thread.run_sync(lambda: llm._metrics.render()).decode()
    samples = [s for o in outputs for s in o.outputs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(s.token_ids) for s in samples)
    (prompt_counter,) = by_name(metrics, "vllm:prompt_tokens", CounterValue)
    (generation_counter,) = by_name(metrics, "vllm:generation_tokens", CounterValue)
    assert (prompt_counter.value, generation_counter.value) == (prompt_tokens, generated)
    reasons = {m.labels["finished_reason"]: m.value
               for m in by_name(metrics, "vllm:request_success", CounterValue)}
    assert reasons == {r: sum(s.finish_reason == r for s in samples) for r in {s.finish_reason for s in samples}}
    (ttft,) = by_name(metrics, "vllm:time_to_first_token_seconds", HistogramValue)
    (e2e,) = by_name(metrics, "vllm:e2e_request_latency_seconds", HistogramValue)
    (itl,) = by_name(metrics, "vllm:inter_token_latency_seconds", HistogramValue)
    (per_request,) = by_name(metrics, "vllm:request_generation_tokens", HistogramValue)
    assert ttft.count == e2e.count == per_request.count == len(outputs)
    assert per_request.sum == generated
    assert itl.count == sum(len(s.token_ids) - 1 for s in samples)  # a step a token here
    assert e2e.buckets["+Inf"] == e2e.count and 0 < ttft.sum <= e2e.sum
    (running,) = by_name(metrics, "vllm:num_requests_running", GaugeValue)
    assert running.value == 0
    (accepted,) = by_name(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos", VectorValue)
    assert set(accepted.values) == {0}  # no speculation
    # Every series read as prometheus_client's parser reads the text exposition.
    parsed = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            parsed[(s.name.replace("engine:", "vllm:"), tuple(sorted(s.labels.items())))] = s.value
    for m in metrics:
        labels = tuple(sorted(m.labels.items()))
        if m.name == "vllm:lora_requests_info":  # its value is the time of the scrape
            assert (m.name, labels) in {(k[0], k[1]) for k in parsed}
        elif isinstance(m, (CounterValue, GaugeValue)):
            suffix = "_total" if isinstance(m, CounterValue) else ""
            assert parsed[(m.name + suffix, labels)] == m.value
        elif isinstance(m, HistogramValue):
            assert parsed[(m.name + "_count", labels)] == m.count
            assert parsed[(m.name + "_sum", labels)] == pytest.approx(m.sum)
            for le, count in m.buckets.items():
                assert parsed[(m.name + "_bucket", tuple(sorted((*m.labels.items(), ("le", le)))))] == count
        else:
            for position, value in enumerate(m.values):
                key = (m.name + "_total", tuple(sorted((*m.labels.items(), ("position", str(position))))))
                assert parsed[key] == value
