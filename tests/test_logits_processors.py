"""Server-side logits processors (``--logits-processors``, vLLM V1's batch-level interface):
a plugin that bans the token a request names, served by ``python -m engine serve`` and
driven with the openai client; and the batch bookkeeping the processors see, under churn."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.params import SamplingParams
from engine.runner.logits_processors import (
    BatchUpdate,
    MoveDirectionality,
    ProcessorBatch,
    load_logits_processors,
)
from engine.runner.sampler import SamplingRow

REPO = Path(__file__).resolve().parent.parent
# Loading the tiny model takes a few seconds (mostly importing torch); a hang guard.
START_TIMEOUT = 120.0

# The plugin, as an operator writes it: vLLM V1's interface, per-request arguments from
# vllm_xargs ({"ban": token id}; {"explode": true} makes it raise).
PLUGIN = '''
import torch
from engine.runner.logits_processors import LogitsProcessor, MoveDirectionality


class BanToken(LogitsProcessor):
    @classmethod
    def validate_params(cls, params):
        ban = (params.extra_args or {}).get("ban")
        if ban is not None and not isinstance(ban, int):
            raise ValueError("ban must be a token id")

    def __init__(self, config, device, is_pin_memory):
        self.rows = {}  # batch row -> its request's extra_args

    def is_argmax_invariant(self):
        return False

    def update_state(self, update):
        if update is None:
            return
        for index in update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, _outputs in update.added:
            self.rows[index] = params.extra_args or {}
        for a, b, direction in update.moved:
            moved = self.rows.pop(a, None)
            other = self.rows.pop(b, None)
            if moved is not None:
                self.rows[b] = moved
            if direction == MoveDirectionality.SWAP and other is not None:
                self.rows[a] = other

    def apply(self, logits):
        if any(args.get("explode") for args in self.rows.values()):
            raise RuntimeError("boom")
        for index, args in self.rows.items():
            if "ban" in args:
                logits[index, args["ban"]] = float("-inf")
        return logits
'''


@contextmanager
def _serve(model: Path, plugin_dir: Path, *flags: str) -> Iterator[str]:
    """``python -m engine serve`` on a free port, the plugin importable; yields its URL."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(plugin_dir)]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0",
         "--max-model-len", "256", "--kv-cache-memory", "32MiB", "--dtype", "float32",
         "--log-level", "info", *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while True:
            line = lines.get(timeout=START_TIMEOUT)
            assert line is not None, "serve exited before it was ready"
            found = re.search(r"(http://127\.0\.0\.1:\d+)", line)
            if found:
                break
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        reader.join(timeout=60)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.models.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("lp") / "m", "llama")


def test_a_plugin_that_bans_a_token_through_serve_and_the_openai_client(
        model: Path, tmp_path: Path) -> None:
    (tmp_path / "ban_plugin.py").write_text(PLUGIN)
    token = 300  # pushed to the top by logit_bias: without the ban, every sample writes it
    ask = {"model": "m", "prompt": "Hello", "max_tokens": 6, "n": 3, "temperature": 1.0,
           "logit_bias": {str(token): 100}, "extra_body": {"return_token_ids": True}}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(_serve(model, tmp_path, "--logits-processors",
                                         "ban_plugin:BanToken", "--served-model-name", "m"))
        client = stack.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="x",
                                                   max_retries=0))

        def run(ban: bool, seed: int) -> list[list[int]]:
            extra = {**ask["extra_body"], **({"vllm_xargs": {"ban": token}} if ban else {})}
            reply = client.completions.create(**{**ask, "extra_body": extra, "seed": seed})
            return [c.token_ids for c in reply.choices]

        # Banned and free requests side by side in the processor's batch.
        results: dict[tuple[bool, int], list[list[int]]] = {}
        threads = [threading.Thread(target=lambda b=b, s=s: results.__setitem__((b, s), run(b, s)))
                   for b in (True, False) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (ban, _), samples in results.items():
            for s in samples:
                assert len(s) == 6
                assert (token not in s) if ban else (s == [token] * 6), (ban, s)
        with pytest.raises(openai.BadRequestError) as info:  # its validate_params
            client.completions.create(model="m", prompt="x", max_tokens=1,
                                      extra_body={"vllm_xargs": {"ban": "x"}})
        assert info.value.body["param"] == "vllm_xargs"
        # A processor that raises fails the requests it ran on; the server goes on.
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="m", prompt="x", max_tokens=2,
                                      extra_body={"vllm_xargs": {"explode": True}})
        assert "BanToken" in str(failed.value.body) and "boom" in str(failed.value.body)
        assert run(True, 9)[0] and token not in run(True, 9)[0]


def test_a_name_that_does_not_load_and_the_speculative_pair_are_refused() -> None:
    with pytest.raises(ConfigError, match="no_such_module"):
        load_logits_processors(["no_such_module:Thing"])
    with pytest.raises(ConfigError, match="no class"):
        load_logits_processors(["engine.params:Nothing"])
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(logits_processors="a:B",
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert EngineConfig(logits_processors=["a:B", "c.d:E"]).logits_processor_names == (
        "a:B", "c.d:E")


class _Mirror:
    """Keeps what the batch updates say each row is, as a processor must, and writes the
    row's request number into its logits: a row whose value is not its own request's
    shows a bookkeeping fault."""

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}
        self.updates: list[BatchUpdate] = []

    def update_state(self, update: BatchUpdate | None) -> None:
        if update is None:
            return
        self.updates.append(update)
        for index in update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, _outputs in update.added:
            assert params.extra_args is not None
            self.rows[index] = params.extra_args["request"]
        for a, b, direction in update.moved:
            assert direction is MoveDirectionality.UNIDIRECTIONAL and b not in self.rows
            self.rows[b] = self.rows.pop(a)
        assert sorted(self.rows) == list(range(update.batch_size))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, request in self.rows.items():
            logits[index, 0] = request
        return logits


def test_the_processors_batch_follows_requests_that_come_and_go() -> None:
    mirror = _Mirror()
    batch = ProcessorBatch([mirror])
    rng = random.Random(0)
    params = {r: SamplingParams(extra_args={"request": r}) for r in range(40)}
    live: list[int] = []
    for _step in range(200):
        # Requests finish, start, and skip steps (a prefill chunk that samples nothing).
        live = [r for r in live if rng.random() > 0.2] + rng.sample(
            [r for r in range(40) if r not in live], rng.randint(0, 3))
        step = [r for r in live if rng.random() > 0.1]
        rng.shuffle(step)
        rows = [SamplingRow(params[r], (1, 2), [], (), key=f"s{r}") for r in step]
        out, failed = batch.apply(torch.zeros(len(rows), 4), rows)
        assert failed == {}
        assert out[:, 0].tolist() == [float(r) for r in step]
    assert any(u.moved for u in mirror.updates) and any(u.removed for u in mirror.updates)


def test_a_processor_that_raises_fails_its_rows_and_starts_over() -> None:
    class Flaky(_Mirror):
        fail = True

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if self.fail:
                self.fail = False
                raise ValueError("bad row")
            return super().apply(logits)

    flaky = Flaky()
    batch = ProcessorBatch([flaky])
    rows = [SamplingRow(SamplingParams(extra_args={"request": r}), (1,), [], (), key=str(r))
            for r in range(3)]
    _, failed = batch.apply(torch.zeros(3, 4), rows)
    assert set(failed) == {0, 1, 2} and "bad row" in failed[0]
    out, failed = batch.apply(torch.zeros(2, 4), rows[1:])
    assert failed == {} and out[:, 0].tolist() == [1.0, 2.0]
    # The restart removed every row the failed step had added, then added the live ones.
    assert sorted(flaky.updates[-1].removed) == [0, 1, 2]
