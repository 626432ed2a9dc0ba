"""``engine.LLM``: offline batch inference for scripts and notebooks, shaped like vLLM's
``LLM`` so that a script ports by changing its import::

    from engine import LLM, SamplingParams

    llm = LLM(model="path/to/model", dtype="float32")
    outputs = llm.generate(["Hello, my name is", "The capital of France is"],
                           SamplingParams(temperature=0.8, max_tokens=32))
    for output in outputs:
        print(output.prompt, output.outputs[0].text)

It is a synchronous facade over the same engine as the embedded trio API: the engine
runs on a trio loop in a thread the LLM owns (:mod:`engine.api.engine_thread`); each call
hands it one batch (:mod:`engine.api.batch`), checked whole before any of it runs, all of
it submitted at once for the scheduler to batch, its outputs returned in the order given
(:mod:`engine.api.outputs`: vLLM's shapes). Calls may come from several threads at once,
and from under a running asyncio loop (Jupyter). Ctrl-C during a call aborts its requests
and raises ``KeyboardInterrupt``; ``close()`` (or leaving ``with LLM(...) as llm:``)
stops the engine and its thread, as does the interpreter's exit.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.actors.system import EngineStatistics
from engine.api import batch
from engine.api.engine import Engine
from engine.api.engine_thread import EngineThread
from engine.api.metrics import Metrics, ReadMetric, snapshot
from engine.api.outputs import (
    BeamSearchOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    GenerationRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
    beam_search_output,
)
from engine.chat.request import TemplateOptions
from engine.chat.tools import parse_tools
from engine.config import profiler_from_environment
from engine.errors import InvalidParamError
from engine.params import BeamSearchParams, PoolingParams, SamplingParams

logger = logging.getLogger("engine")

# vLLM's LLM arguments that are not engine options and change nothing here, with why;
# any other unknown option is refused (ConfigError) by open_engine.
VLLM_IGNORED_OPTIONS = {
    "trust_remote_code": "the engine runs no code from a model's folder",
    "disable_log_stats": "the engine logs no periodic statistics",
    "swap_space": "preempted requests are recomputed, as in vLLM V1 (which ignored it, "
                  "then removed it)",
}


def engine_options(model: str | Path | None, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as :func:`engine.open_engine` takes them: vLLM's arguments that change
    nothing here dropped (:data:`VLLM_IGNORED_OPTIONS`), ``tokenizer`` dropped when it
    names the model itself (vLLM's default), and ``VLLM_TORCH_PROFILER_DIR`` read into
    ``profiler_config`` where none is given (as vLLM's ``LLM`` reads it)."""
    out = {k: v for k, v in options.items() if k not in VLLM_IGNORED_OPTIONS}
    profiler = profiler_from_environment(out.get("profiler_config"))
    if profiler is not None:
        out["profiler_config"] = profiler
    tokenizer = out.get("tokenizer")
    if tokenizer is not None and model is not None and str(tokenizer) == str(model):
        del out["tokenizer"]
    return out


class LLM:
    """A model loaded for offline inference; see the module docstring.

    ``model`` is a Hugging Face folder or a ``.gguf`` file (None: the default SmolLM2);
    ``options`` are :class:`engine.EngineConfig` fields, as :func:`engine.open_engine`
    takes them (``dtype="float32"``, ``max_num_seqs=64``, ``max_model_len=2048``,
    ``runner="pooling"``, ...), plus the vLLM arguments that change nothing here
    (:data:`VLLM_IGNORED_OPTIONS`). Loading happens in the constructor.
    """

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        self._thread = EngineThread(model, engine_options(model, options))
        self._engine: Engine = self._thread.engine
        # Closed when collected, or at the interpreter's exit at the latest (before its
        # daemon threads stop), so a script that never calls close() leaves nothing behind.
        self._finalizer = weakref.finalize(self, self._thread.close)
        # Every batch of this LLM shares one window on the engine's waiting queue.
        self._window = self._thread.run_sync(
            lambda: batch.Window(self._engine.config.max_queued_requests))
        self._request_ids = itertools.count()
        self._asleep = False  # sleep() and wake_up() say; generate refuses while it sleeps
        self._tokenizer_lock = threading.Lock()
        self._hf_tokenizer: Any = None
        self.model_name: str = self._engine.model_name
        # vLLM's get_metrics(): the series a server's /metrics gives, under vLLM's names,
        # with this LLM's generate and chat requests timed into them.
        self._metrics = self._thread.run_sync(lambda: Metrics(self._engine, self.model_name, "vllm"))

    # -- generation ----------------------------------------------------------------------

    def generate(
        self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *, use_tqdm: Any = True, lora_request: Any = None, priority: Sequence[int] | None = None,
    ) -> list[GenerationRequestOutput]:
        """Generate for one prompt or a list: strings, token-id lists, or vLLM's prompt
        dicts (``{"prompt": ..., "multi_modal_data": {"image": ...}}``,
        ``{"prompt_token_ids": [...]}``). ``sampling_params`` is one
        :class:`SamplingParams` for all, one per prompt, or None (the model's defaults,
        as the embedded API's). ``priority`` is one integer per prompt (the scheduler's
        ``priority`` policy reads it). Returns one output per prompt, in order.

        Raises :class:`engine.errors.BatchPromptError` (naming the prompt's index) for a
        prompt the engine refuses, before any prompt runs."""
        prompts_ = batch.generation_prompts(prompts)
        return self._generate(prompts_, sampling_params, priority, use_tqdm, lora_request)

    def chat(
        self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Any = True, lora_request: Any = None, chat_template: str | None = None,
        chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
        continue_final_message: bool = False, tools: list[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[GenerationRequestOutput]:
        """Generate a reply to one conversation (a list of OpenAI message dicts) or to each
        of a list of them, through the chat template (``chat_template``: jinja source to
        use instead of the model's). ``tools`` (OpenAI function tools) go to the template,
        as in vLLM: the reply is the model's raw text, tool calls and all (a template that
        never reads tools gets the engine's fallback tool prompt). ``lora_request`` as
        :meth:`generate` takes it (one for all conversations or one each);
        ``mm_processor_kwargs`` (Qwen-VL's ``min_pixels`` / ``max_pixels``) shape the
        conversations' images, over the engine's. Outputs as :meth:`generate`'s, whose
        ``prompt`` is the rendered template."""
        if chat_template_content_format != "auto":
            raise InvalidParamError("chat_template_content_format: only 'auto' is supported "
                                    "(the engine reads both string and part contents)",
                                    param="chat_template_content_format")
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, Mapping):
            raise InvalidParamError("mm_processor_kwargs must be a dict",
                                    param="mm_processor_kwargs")
        if chat_template is not None and not (isinstance(chat_template, str) and chat_template):
            raise InvalidParamError("chat_template must be a template's source text",
                                    param="chat_template")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise InvalidParamError("chat_template_kwargs must be a dict",
                                    param="chat_template_kwargs")
        parsed = parse_tools(list(tools) if tools is not None else None)
        options = TemplateOptions(
            tools=tuple(t.to_openai() for t in parsed) or None, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message)
        return self._generate(
            batch.chat_prompts(messages, options, dict(mm_processor_kwargs or {}) or None),
            sampling_params, None, use_tqdm, lora_request)

    def _generate(self, prompts: list[batch.BatchPrompt], sampling_params: Any,
                  priority: Sequence[int] | None, use_tqdm: Any,
                  lora_request: Any = None) -> list[GenerationRequestOutput]:
        params = _per_prompt(sampling_params, len(prompts))
        adapters = _lora_requests(lora_request, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidParamError(f"priority holds {len(priorities)} values for "
                                    f"{len(prompts)} prompts", param="priority")
        ids = self._ids(len(prompts))
        window, metrics = self._window, self._metrics  # (the job must not hold self)

        async def work(engine: Engine, emit: batch.Progress) -> list[GenerationRequestOutput]:
            names = await _served(engine, adapters)
            prepared = await batch.prepare_all(engine, prompts, params, priorities, ids, names)
            return await batch.generate(engine, prompts, prepared, params, window=window,
                                        progress=lambda p, o: emit((p, o)), metrics=metrics)

        return self._run(work, len(prompts), use_tqdm)

    def beam_search(
        self, prompts: Any, params: BeamSearchParams, *, use_tqdm: Any = False,
        lora_request: Any = None, concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: a beam search of ``params.beam_width`` beams for each
        prompt (strings, token-id lists or vLLM's prompt dicts), every beam returned, best
        score first. The prompts run side by side (``concurrency_limit`` is vLLM's bound on
        that; here the engine's queue window bounds it). ``lora_request`` as
        :meth:`generate` takes it: every beam runs the adapter."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidParamError("params must be an engine.BeamSearchParams", param="params")
        prompts_ = batch.generation_prompts(prompts)
        results = self._generate(prompts_, params.sampling_params(), None, use_tqdm, lora_request)
        return [beam_search_output(r) for r in results]

    # -- pooling -------------------------------------------------------------------------

    def embed(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: Any = True, pooling_params: Any = None,
              lora_request: Any = None) -> list[EmbeddingRequestOutput]:
        """Embed one input or a list (strings, token ids, prompt dicts) with an embedding
        model; ``truncate_prompt_tokens`` keeps the last k tokens (-1: the model's limit);
        ``pooling_params``: an :class:`engine.PoolingParams` (``dimensions``,
        ``normalize``, ``truncate_prompt_tokens``) or a list of one per prompt."""
        inputs = batch.pooling_inputs(prompts)
        params = _pooling_params(pooling_params, truncate_prompt_tokens, len(inputs))
        adapters = _lora_requests(lora_request, len(inputs))
        ids, window = self._ids(len(inputs)), self._window

        async def work(engine: Engine, emit: batch.Progress) -> list[EmbeddingRequestOutput]:
            return await batch.embed(engine, inputs, params=params,
                                     request_ids=ids, window=window,
                                     progress=lambda p, o: emit((p, o)),
                                     loras=await _served(engine, adapters))

        return self._run(work, len(inputs), use_tqdm)

    def classify(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: Any = True, pooling_params: Any = None,
                 lora_request: Any = None) -> list[ClassificationRequestOutput]:
        """Class probabilities of each input with a classification model (softmax of its
        logits; the sigmoid of a one-label model's logit); ``pooling_params`` with
        ``use_activation=False`` gives the logits (one, or a list of one per prompt)."""
        _no_lora(lora_request)
        inputs = batch.pooling_inputs(prompts)
        params = _pooling_params(pooling_params, truncate_prompt_tokens, len(inputs))
        ids, window = self._ids(len(inputs)), self._window

        async def work(engine: Engine, emit: batch.Progress) -> list[ClassificationRequestOutput]:
            return await batch.classify(engine, inputs, params=params,
                                        request_ids=ids, window=window,
                                        progress=lambda p, o: emit((p, o)))

        return self._run(work, len(inputs), use_tqdm)

    def encode(self, prompts: Any, pooling_params: Any = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: Any = True,
               lora_request: Any = None, pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call, each input's result as ``outputs.data``, a float32
        tensor: ``pooling_task`` ``"embed"`` (what :meth:`embed` gives), ``"classify"``
        (what :meth:`classify` gives), ``"token_embed"`` (every prompt token's hidden
        state, ``[tokens, width]``, each row normalised as the model's embeddings are, or
        as ``pooling_params.normalize`` asks) or, with a token classifier,
        ``"token_classify"`` (every token's class probabilities, ``[tokens, labels]``, or
        its logits with ``use_activation=False``). Without a task the model's per-token
        task runs, as vLLM's does (with a warning, as vLLM's)."""
        model_task = self._engine_pooler_task()
        if pooling_task is None and model_task in ("embed", "token_classify"):
            pooling_task = "token_embed" if model_task == "embed" else "token_classify"
            logger.warning("LLM.encode without pooling_task runs %r (an output for every "
                           "token); give pooling_task to choose", pooling_task)
        runs = {"embed": ("embed", "token_embed"), "classify": ("classify",),
                "token_classify": ("token_classify",)}.get(model_task or "", ())
        if pooling_task not in runs:
            raise InvalidParamError(
                f"pooling_task {pooling_task!r}: this model runs "
                f"{', '.join(repr(t) for t in runs) or 'no pooling task (it generates)'}",
                param="pooling_task")
        if pooling_task.startswith("token_"):
            return self._encode_tokens(prompts, pooling_params, truncate_prompt_tokens,
                                       use_tqdm, lora_request, pooling_task)
        call = self.embed if pooling_task == "embed" else self.classify
        results = call(prompts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                       pooling_params=pooling_params, lora_request=lora_request)
        return [PoolingRequestOutput(
            r.request_id, PoolingOutput(torch.tensor(
                r.outputs.embedding if pooling_task == "embed" else r.outputs.probs,  # type: ignore[union-attr]
                dtype=torch.float32)),
            r.prompt_token_ids, r.finished) for r in results]

    def _engine_pooler_task(self) -> str | None:
        pooler = self._engine.pooler
        return None if pooler is None else str(pooler.task)

    def _encode_tokens(self, prompts: Any, pooling_params: Any, truncate: int | None,
                       use_tqdm: Any, lora_request: Any, task: str) -> list[PoolingRequestOutput]:
        if task == "token_classify":
            _no_lora(lora_request)
        inputs = batch.pooling_inputs(prompts)
        params = _pooling_params(pooling_params, truncate, len(inputs))
        adapters = _lora_requests(lora_request, len(inputs))
        ids, window = self._ids(len(inputs)), self._window

        async def work(engine: Engine, emit: batch.Progress) -> list[tuple[Any, list[int]]]:
            loras = await _served(engine, adapters)
            if task == "token_embed":
                return await batch.embed_tokens(engine, inputs, params=params, request_ids=ids,
                                                window=window, progress=lambda p, o: emit((p, o)),
                                                loras=loras)
            return await batch.classify_tokens(engine, inputs, params=params, request_ids=ids,
                                               window=window, progress=lambda p, o: emit((p, o)))

        results = self._run(work, len(inputs), use_tqdm)
        return [PoolingRequestOutput(rid, PoolingOutput(torch.from_numpy(p.matrix().copy())),
                                     prompt_ids)
                for rid, (p, prompt_ids) in zip(ids, results, strict=True)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: Any = True,
              pooling_params: Any = None, lora_request: Any = None) -> list[ScoringRequestOutput]:
        """Score ``data_1`` against each text of ``data_2`` (or the two lists pairwise): a
        cross-encoder's score, or the cosine similarity of an embedding model's vectors
        (``lora_request``: one adapter for every pair, or one per pair, as for ``embed``;
        a pair's two texts are embedded with its adapter)."""
        _no_pooling_params(pooling_params)
        firsts, seconds = batch.score_pairs(data_1, data_2)
        adapters = _lora_requests(lora_request, len(firsts))
        ids, window = self._ids(len(firsts)), self._window

        async def work(engine: Engine, emit: batch.Progress) -> list[ScoringRequestOutput]:
            return await batch.score(engine, firsts, seconds, truncate=truncate_prompt_tokens,
                                     request_ids=ids, window=window,
                                     progress=lambda p, o: emit((p, o)),
                                     loras=await _served(engine, adapters))

        return self._run(work, len(firsts), use_tqdm)

    # -- the rest ------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (``transformers.AutoTokenizer`` from the
        model's folder; a GGUF's converted folder), as vLLM's ``get_tokenizer``: the one
        to call ``apply_chat_template`` on. The engine tokenizes with the same files."""
        with self._tokenizer_lock:
            if self._hf_tokenizer is None:
                from transformers import AutoTokenizer  # heavy: only when asked for

                self._hf_tokenizer = AutoTokenizer.from_pretrained(
                    str(self._engine.tokenizer.folder))
            return self._hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses for a prompt given no sampling params, as vLLM's: the
        model's generation_config.json sampling fields and ``max_new_tokens`` (with
        ``override_generation_config`` over them), else the engine's own defaults."""
        return self._engine.default_sampling_params()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block (vLLM's): later prompts compute their prefixes
        afresh. False, with nothing dropped, while a request holds KV blocks (between
        ``generate`` calls none does), unless ``reset_running_requests`` preempts them
        first (they recompute when they run again)."""

        async def work(engine: Engine, emit: Any) -> bool:
            return await engine.reset_prefix_cache(reset_running_requests)

        return self._thread.call(work)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep (vLLM's ``LLM.sleep``): level 1 gives back the KV
        cache's memory, level 2 the weights' too (needs ``enable_sleep_mode=True``). Until
        :meth:`wake_up`, ``generate`` calls wait."""

        async def work(engine: Engine, emit: Any) -> bool:
            await engine.sleep(level, mode)
            return await engine.is_sleeping()

        self._asleep = self._thread.call(work)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what sleeps (vLLM's ``LLM.wake_up``): ``tags`` "weights", "kv_cache"
        (None: both; the weights are read again from the checkpoint after a level 2
        sleep)."""

        async def work(engine: Engine, emit: Any) -> bool:
            await engine.wake_up(tags)
            return await engine.is_sleeping()

        self._asleep = self._thread.call(work)

    def collective_rpc(self, method: str, timeout: float | None = None, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's ``LLM.collective_rpc`` for ``"reload_weights"`` only: every rank reads
        the model's checkpoint again and rebuilds its model (a trainer wrote new weights);
        one ``None`` a rank. Any other method is refused (``InvalidParamError``)."""

        async def work(engine: Engine, emit: Any) -> tuple[list[Any], bool]:
            results = await engine.collective_rpc(method, timeout, args, kwargs)
            return results, await engine.is_sleeping()

        results, self._asleep = self._thread.call(work)
        return results

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (vLLM's ``llm_engine.is_sleeping()``)."""

        async def work(engine: Engine, emit: Any) -> bool:
            return await engine.is_sleeping()

        return self._thread.call(work)

    def get_metrics(self) -> list[ReadMetric]:
        """The engine's Prometheus series now, as vLLM's ``LLM.get_metrics()`` gives them
        (``vllm:`` names; ``CounterValue``, ``GaugeValue``, ``HistogramValue``,
        ``VectorValue`` with vLLM's fields): the gauges and counters of the engine, and the
        request histograms (time to first token, inter-token and end-to-end latency,
        tokens per request, ...) of this LLM's ``generate`` and ``chat`` calls."""
        metrics = self._metrics
        return self._thread.run_sync(lambda: snapshot(metrics))

    def start_profile(self) -> None:
        """Start tracing the engine's steps (vLLM's): the LLM needs ``profiler_config``
        (or ``VLLM_TORCH_PROFILER_DIR`` in the environment); :meth:`stop_profile` writes
        the trace."""

        async def work(engine: Engine, emit: Any) -> None:
            await engine.start_profile()

        self._thread.call(work)

    def stop_profile(self) -> list[str]:
        """Stop tracing and write the trace (vLLM's); the files written."""

        async def work(engine: Engine, emit: Any) -> list[str]:
            return await engine.stop_profile()

        return self._thread.call(work)

    def statistics(self) -> EngineStatistics:
        """The engine's counters now (requests running and waiting, KV blocks free)."""
        return self._thread.run_sync(self._engine.statistics)

    def close(self) -> None:
        """Stop the engine and its thread; a call running in another thread fails with
        :class:`engine.EngineDeadError`. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _ids(self, count: int) -> list[str]:
        # Request ids numbered per LLM, as vLLM's ("0", "1", ...).
        return [str(next(self._request_ids)) for _ in range(count)]

    def _run(self, work: Any, total: int, use_tqdm: Any) -> Any:
        if total == 0:
            return []
        if self._asleep:
            # Its requests would wait for a wake-up this thread cannot give while it waits.
            raise InvalidParamError("the engine sleeps: call wake_up() before generating",
                                    param="sleep")
        progress = _ProgressBar(total, use_tqdm)
        try:
            return self._thread.call(work, progress.update)
        finally:
            progress.close()


def _per_prompt(sampling_params: Any, count: int) -> list[SamplingParams | None]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != count:
            raise InvalidParamError(f"sampling_params holds {len(sampling_params)} values for "
                                    f"{count} prompts", param="sampling_params")
        if all(isinstance(p, SamplingParams) for p in sampling_params):
            return list(sampling_params)
    raise InvalidParamError("sampling_params must be an engine.SamplingParams, a list of them "
                            "(one per prompt) or None", param="sampling_params")


def _lora_requests(lora_request: Any, count: int) -> list[tuple[str, str] | None]:
    """vLLM's ``lora_request``: None, one for every prompt, or one per prompt (None: the
    base model); each anything with ``lora_name`` and ``lora_path`` (vLLM's LoRARequest)."""
    requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
    if len(requests) != count:
        raise InvalidParamError(f"lora_request holds {len(requests)} values for {count} prompts",
                                param="lora_request")
    out: list[tuple[str, str] | None] = []
    for r in requests:
        if r is None:
            out.append(None)
            continue
        name, path = getattr(r, "lora_name", None), getattr(r, "lora_path", None) or getattr(r, "lora_local_path", None)
        if not isinstance(name, str) or not isinstance(path, str):
            raise InvalidParamError("lora_request must be a LoRARequest (lora_name, lora_int_id, lora_path)",
                                    param="lora_request")
        out.append((name, path))
    return out


async def _served(engine: Engine, adapters: Sequence[tuple[str, str] | None]) -> list[str | None]:
    """vLLM's LoRARequests name an adapter and its folder: one not served yet is loaded
    (checked) under its name first. Each prompt's adapter name (None: the base model)."""
    for name, path in dict.fromkeys(a for a in adapters if a is not None):
        if name not in engine.loras:
            await engine.loras.load(name, path)
    return [None if a is None else a[0] for a in adapters]


def _no_lora(lora_request: Any, what: str = "classifiers") -> None:
    # Adapters run on decoders only (--enable-lora is refused for a BERT encoder, the only
    # classifier here).
    if lora_request is not None:
        raise InvalidParamError(f"lora_request: LoRA adapters are not supported for {what}", param="lora_request")


def _no_pooling_params(pooling_params: Any) -> None:
    if pooling_params is not None:
        raise InvalidParamError("pooling_params are not supported by score: a score is the "
                                "model's own (truncate_prompt_tokens is an argument)",
                                param="pooling_params")


def _pooling_params(pooling_params: Any, truncate: int | None, count: int) -> list[PoolingParams]:
    """One :class:`PoolingParams` per prompt, from vLLM's ``pooling_params`` argument (one
    for all, or a list) with the ``truncate_prompt_tokens`` argument where they leave it
    unset; the two set to different values is a refusal, not a guess."""
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        params = [pooling_params or PoolingParams()] * count
    elif (isinstance(pooling_params, (list, tuple)) and len(pooling_params) == count
          and all(isinstance(p, PoolingParams) for p in pooling_params)):
        params = list(pooling_params)
    else:
        raise InvalidParamError(f"pooling_params must be an engine.PoolingParams or a list of "
                                f"{count} (one per prompt)", param="pooling_params")
    if truncate is None:
        return params
    out = []
    for p in params:
        if p.truncate_prompt_tokens not in (None, truncate):
            raise InvalidParamError(
                f"truncate_prompt_tokens={truncate} and pooling_params.truncate_prompt_tokens="
                f"{p.truncate_prompt_tokens} disagree", param="truncate_prompt_tokens")
        out.append(dataclasses.replace(p, truncate_prompt_tokens=truncate))
    return out


class _ProgressBar:
    """A tqdm bar on the caller's thread: prompts done, input and output tokens per second
    since the batch started. ``use_tqdm`` is True (tqdm.auto: a widget in Jupyter), False,
    or a tqdm-like class (called as tqdm is), as in vLLM."""

    def __init__(self, total: int, use_tqdm: Any) -> None:
        self._bar: Any = None
        self._start = time.perf_counter()
        self._input = self._output = 0
        if use_tqdm is False or use_tqdm is None:
            return
        if callable(use_tqdm):
            make = use_tqdm
        else:
            from tqdm.auto import tqdm as make  # imports IPython's hooks where present

        self._bar = make(total=total, desc="Processed prompts", dynamic_ncols=True,
                         postfix=self._rates(0.0))

    def _rates(self, seconds: float) -> str:
        if seconds <= 0:
            return "input: 0 tok/s, output: 0 tok/s"
        return (f"input: {self._input / seconds:.1f} tok/s, "
                f"output: {self._output / seconds:.1f} tok/s")

    def update(self, event: tuple[int, int]) -> None:
        prompt_tokens, output_tokens = event
        self._input += prompt_tokens
        self._output += output_tokens
        if self._bar is not None:
            self._bar.postfix = self._rates(time.perf_counter() - self._start)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
