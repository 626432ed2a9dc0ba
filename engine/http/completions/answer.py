"""The OpenAI completions and chat answers: engine outputs in, response bodies and stream
chunks out.

Pure (no I/O, no trio). :class:`Completion` holds one request's choices as engine outputs
arrive (echo, logprob alignment, usage) and says them as one response body or as SSE
chunks; the functions above it build the pieces (logprobs, choices, chunks, usage) that
other routes (``/inference/v1/generate``) reuse.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from engine.chat.output import ChatDelta, ChatOutputParser
from engine.chat.request import calls_constrained
from engine.http.completions.legacy import legacy_delta, legacy_finish, legacy_message
from engine.http.completions.protocol import CompletionRequest


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AnswerOptions:
    """The server's flags that shape answers, named as vLLM's ``serve`` flags."""

    # usage.prompt_tokens_details ({"cached_tokens": N}, the prefix cache's hit) on every
    # answer (--enable-prompt-tokens-details); vLLM leaves it out by default.
    prompt_tokens_details: bool = False
    # Every stream carries usage, as if it asked stream_options.include_usage and
    # continuous_usage_stats: on every chunk and in a final usage chunk
    # (--enable-force-include-usage; vLLM's flag does both).
    force_include_usage: bool = False
    # Logprob tokens as "token_id:N" for requests that do not say
    # (--return-tokens-as-token-ids; the request's return_tokens_as_token_ids wins).
    tokens_as_token_ids: bool = False


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
               prediction: tuple[int, int] | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        # OpenAI's field for the prompt-cache hit; here, the prefix cache's.
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if prediction is not None:
        # OpenAI's Predicted Outputs counts: proposal tokens the output kept, and those
        # it did not (which OpenAI bills as completion tokens; here they cost compute only).
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": prediction[0], "rejected_prediction_tokens": prediction[1]}
    return usage


TokenText = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    """A logprob token written as its id (return_tokens_as_token_ids), as vLLM writes it:
    every token can be named, even one that is not whole UTF-8 on its own."""
    return f"token_id:{token_id}"


@dataclasses.dataclass(frozen=True, slots=True)
class Unscored:
    """A token with no logprob: an echoed prompt's first, which nothing precedes."""

    token_id: int
    logprob: None = None
    top: None = None


def prompt_logprob_entries(
    prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[Any]
) -> list[Any]:
    """An echoed prompt's tokens as :func:`completion_logprobs` entries (first unscored)."""
    return [Unscored(prompt_token_ids[0]), *prompt_logprobs[1:]]


def top_entries(lp: Any, limit: int | None) -> list[tuple[int, float]]:
    """One token's alternatives as vLLM lists them: the chosen token first, then the most
    likely others, best first (the chosen one not twice); at most ``limit`` (None: all).
    So the chosen token is always there, and ``logprobs: 0`` still names it."""
    entries = [(lp.token_id, lp.logprob), *((t, v) for t, v in lp.top if t != lp.token_id)]
    return entries if limit is None else entries[:limit]


def completion_logprobs(
    logprobs: Sequence[Any], token_text: TokenText, text_offset: int, top: int | None = None,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for a run of tokens.

    Each ``top_logprobs`` dict holds the chosen token and ``top`` alternatives (-1 or
    None: all the entries have), so ``top + 1`` keys at most, as OpenAI documents and vLLM
    sends. An entry whose ``logprob`` is None (an echoed prompt's first token) gets nulls.
    ``text_offset`` counts the tokens' texts on from ``text_offset`` (an echoed prompt's
    tokens, then the output's: one running count, as vLLM's).
    """
    limit = None if top is None or top < 0 else top + 1
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        tops.append(None if lp.logprob is None else
                    {token_text(t): v for t, v in top_entries(lp, limit)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: Sequence[Any], token_text: TokenText, top: int = 0
                  ) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    ``top_logprobs`` lists ``top`` entries (-1: all), the chosen token first (vLLM's)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    limit = None if top < 0 else top
    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in top_entries(lp, limit)]
        content.append(item)
    return {"content": content}


def prompt_logprobs_list(scores: Sequence[Any], top: int, token_text: TokenText
                         ) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first (nothing scores
    it), else ``{token id: {logprob, rank, decoded_token}}`` for the token and its ``top``
    most likely alternatives (-1: all the entries have); ``rank`` 1 is the most likely."""
    limit = None if top < 0 else top
    out: list[dict[str, Any] | None] = []
    for lp in scores:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": token_text(lp.token_id)}}
        alternatives = lp.top if limit is None else lp.top[:limit]
        for rank, (t, v) in enumerate(alternatives, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": token_text(t)})
        out.append(entry)
    return out


def completion_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: Any,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: Any,
    logprobs: dict[str, Any] | None, message: dict[str, Any] | None = None,
    role: str = "assistant",
) -> dict[str, Any]:
    """A chat choice; ``message`` (from a chat output parser: reasoning, tool calls)
    replaces the plain ``{"role": "assistant", "content": text}``."""
    return {
        "index": index,
        "message": message or {"role": role, "content": text, "reasoning": None},
        "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason,
    }


def response_body(
    chat: bool, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
    usage: dict[str, Any],
) -> dict[str, Any]:
    # OpenAI's service_tier and system_fingerprint, null: there is one tier, and no
    # fingerprint of the backend's configuration (vLLM sends both keys, null).
    return {
        "id": request_id, "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": model, "choices": choices, "service_tier": None,
        "system_fingerprint": None, "usage": usage,
    }


def chunk_body(
    chat: bool, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
    include_usage: bool, usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created, "model": model, "choices": choices,
    }
    if include_usage:
        # OpenAI sends "usage": null on every chunk but the last when usage is requested.
        body["usage"] = usage
    return body


def chunk_choice(
    chat: bool, index: int, text: str | None, finish_reason: str | None, stop_reason: Any,
    logprobs: dict[str, Any] | None, role: bool | str = False,
    delta_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a stream chunk; ``delta_fields`` (reasoning, tool_calls, content
    from a chat output parser) replace the plain text delta."""
    if not chat:
        return completion_choice(index, text or "", finish_reason, stop_reason, logprobs)
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role if isinstance(role, str) else "assistant"
    if delta_fields is not None:
        delta.update(delta_fields)
    elif text is not None:
        delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


# One request's choices as engine outputs arrive


@dataclasses.dataclass(slots=True)
class _Choice:
    """What one choice (one sample of one prompt) has produced so far."""

    index: int
    # Reads reasoning and tool calls out of the text, when the request asks for them.
    parser: ChatOutputParser | None = None
    text: str = ""
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    # The prompt's scores (prompt_logprobs, or echo + logprobs): None for the first token,
    # then one TokenLogprob per token; from the choice's first output.
    prompt_scores: Sequence[Any] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    tokens: int = 0
    cached: int = 0  # prompt tokens the prefix cache served this sample
    prediction: tuple[int, int] | None = None  # Predicted Outputs: (accepted, rejected)
    # Streamed: logprobs and ids of tokens that are not yet text (half a UTF-8 character),
    # held for the chunk that completes the text.
    held: list[Any] = dataclasses.field(default_factory=list)
    held_ids: list[int] = dataclasses.field(default_factory=list)
    offset: int = 0  # the next logprob token's text_offset
    echoed: bool = False  # streamed: the echo chunk went out
    ids_sent: bool = False  # streamed: prompt_token_ids went out (return_token_ids)


class Completion:
    """The choices of one OpenAI request as engine outputs arrive, and the bodies that say
    them: echo, logprob alignment, usage. Pure: the HTTP app feeds it outputs and writes
    the dicts it returns (one response body, or SSE chunks).

    ``prompt_token_ids`` holds each prompt's ids (one engine request per prompt, ``n``
    choices each); ``token_text`` is one token's text and ``decode`` a token-id prompt's
    (its special tokens kept, so an echo shows what the model read); ``base_id`` is the
    client's request id, if it sent one; ``options`` the server's answer flags. A chat
    choice whose request asks for tools or reasoning reads them out of its text with a
    :class:`ChatOutputParser`.
    """

    def __init__(
        self, req: CompletionRequest, model: str, prompt_token_ids: Sequence[Sequence[int]],
        token_text: TokenText, decode: Callable[[list[int]], str], base_id: str | None = None,
        options: AnswerOptions | None = None,
    ) -> None:
        self.req = req
        options = options or AnswerOptions()
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        self.id = prefix + base_id if base_id else new_id(req.chat)
        self.created = now()
        self.model = model
        self._prompt_ids = prompt_token_ids
        self._decoded_token = token_text
        as_ids = req.tokens_as_ids if req.tokens_as_ids is not None else options.tokens_as_token_ids
        self._token_text = token_id_text if as_ids else token_text
        self._decode = decode
        self._details = options.prompt_tokens_details
        self._n = req.params.n
        # A stream ends with usage when asked; continuous_usage_stats puts usage on every
        # chunk too (only with the final one). --enable-force-include-usage does both for
        # every stream, as vLLM's flag does.
        forced = options.force_include_usage
        self.include_usage = req.stream and (req.include_usage or forced)
        self._continuous = self.include_usage and (req.continuous_usage or forced)
        fields = req.chat_fields
        output = fields.output if fields is not None and fields.output.parses else None
        self._forced = fields is not None and fields.forced
        constrained = fields is not None and calls_constrained(fields, req.params)
        self.choices = [_Choice(i, ChatOutputParser(output, constrained=constrained)
                                if output is not None else None)
                        for i in range(len(prompt_token_ids) * self._n)]
        # With logprobs, a streamed echo waits for the prompt's logprobs, which come with
        # the choice's first output; without, it goes out at once.
        self._echo_later = req.echo and req.top_logprobs is not None

    def echo_text(self, choice: _Choice) -> str:
        prompt = self.req.prompts[choice.index // self._n]
        if self.req.chat:
            # Chat echo (vLLM's): the last message's content, when it is the assistant's
            # (a prefill the model continues); text parts joined with newlines, as vLLM.
            last = prompt[-1]
            content = last.get("content") if last.get("role") == "assistant" else None
            if isinstance(content, list):
                return "\n".join(p["text"] for p in content if p.get("type") == "text")
            return content if isinstance(content, str) else ""
        if isinstance(prompt, str) and self.req.params.truncate_prompt_tokens is None:
            return prompt
        # Token ids, or a prompt truncate_prompt_tokens may have cut: what the model read.
        return self._decode(list(self._prompt_of(choice)))

    def unfinished(self) -> list[int]:
        return [c.index for c in self.choices if c.finish_reason is None]

    def _prompt_of(self, choice: _Choice) -> Sequence[int]:
        return self._prompt_ids[choice.index // self._n]

    def _embedded(self, choice: _Choice) -> bool:
        """Whether the choice's prompt was given as embeddings (it has no ids to show)."""
        return choice.index // self._n < self.req.prompt_embeds

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self._prompt_ids)
        # One prompt's cached tokens: its samples share the prompt, so the most any of them
        # found (samples after the first find what the first cached).
        n = self._n
        cached = sum(max(c.cached for c in self.choices[i * n:(i + 1) * n])
                     for i in range(len(self._prompt_ids)))
        predicted = [c.prediction for c in self.choices if c.prediction is not None]
        prediction = (sum(a for a, _ in predicted), sum(r for _, r in predicted)) if predicted else None
        return usage_dict(prompt, sum(c.tokens for c in self.choices),
                          cached if self._details else None, prediction)

    def record(self, prompt_index: int, out: Any) -> _Choice:
        """Add one engine output of prompt ``prompt_index`` to its choice."""
        choice = self.choices[prompt_index * self._n + out.index]
        if choice.prompt_scores is None and out.prompt_logprobs is not None:
            choice.prompt_scores = out.prompt_logprobs
        choice.text += out.text
        choice.tokens += len(out.token_ids)
        choice.token_ids.extend(out.token_ids)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.stop_reason = out.stop_reason
            if out.usage is not None:
                choice.cached = out.usage.cached_tokens
                choice.prediction = out.usage.prediction_tokens
        return choice

    def _echo_entries(self, choice: _Choice, scores: Sequence[Any] | None) -> list[Any]:
        """The echoed prompt's logprob entries (first unscored), from its scores."""
        if scores is None:
            return []
        return prompt_logprob_entries(self._prompt_of(choice), scores)

    def _completion_logprobs(self, entries: Sequence[Any], choice: _Choice) -> dict[str, Any]:
        """:func:`completion_logprobs` of a choice's next tokens, offsets running on."""
        body = completion_logprobs(entries, self._token_text, choice.offset, self.req.top_logprobs)
        if body["tokens"]:
            choice.offset = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def logprob_entries(self, logprobs: Sequence[Any] | None) -> list[dict[str, Any]]:
        """Output tokens' logprobs as chat entries (``{token, logprob, bytes,
        top_logprobs}``, the request's ``top_logprobs`` alternatives each); [] when the
        request asked for none."""
        if not logprobs or self.req.top_logprobs is None:
            return []
        return chat_logprobs(logprobs, self._token_text, self.req.top_logprobs)["content"]

    def _prompt_logprobs(self, choice: _Choice) -> list[dict[str, Any] | None] | None:
        if self.req.prompt_logprobs is None or choice.prompt_scores is None:
            return None
        return prompt_logprobs_list(choice.prompt_scores, self.req.prompt_logprobs,
                                    self._decoded_token)

    # -- collected ----------------------------------------------------------------------

    def begin_collected(self) -> None:
        if self.req.echo:
            for choice in self.choices:
                choice.text = self.echo_text(choice)

    def response(self) -> dict[str, Any]:
        """The whole (non-streamed) response body."""
        ids = self.req.return_token_ids
        if self.req.chat:
            choices = [{**self._chat_choice(c), "token_ids": c.token_ids if ids else None}
                       for c in self.choices]
        else:
            # vLLM's extra keys are there, null, when not asked for.
            choices = [{**completion_choice(index, c.text, c.finish_reason, c.stop_reason,
                                            self._all_logprobs(c)),
                        "prompt_logprobs": self._prompt_logprobs(c),
                        "prompt_token_ids": (list(self._prompt_of(c)) if ids and not
                                             self._embedded(c) else None),
                        "token_ids": c.token_ids if ids else None}
                       for c, index in self._returned()]
        body = response_body(self.req.chat, self.id, self.created, self.model, choices,
                             self.usage())
        if self.req.chat:
            # One prompt: its scores and ids belong to the response (vLLM's keys).
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
            body["prompt_token_ids"] = list(self._prompt_ids[0]) if ids else None
        return body

    def _returned(self) -> list[tuple[_Choice, int]]:
        """The choices the answer returns, with their indices: all of them; or, with
        best_of above n, each prompt's ``n`` of highest cumulative logprob (the sum of its
        sampled tokens' logprobs; the earlier sample first on a tie), best first, as
        OpenAI and vLLM rank them. Usage still counts every sample drawn."""
        keep = self.req.returned_n
        if keep is None:
            return [(c, c.index) for c in self.choices]
        out = []
        for p in range(len(self._prompt_ids)):
            drawn = self.choices[p * self._n:(p + 1) * self._n]
            ranked = sorted(drawn, key=lambda c: (-sum(lp.logprob for lp in c.logprobs), c.index))
            out.extend((c, p * keep + rank) for rank, c in enumerate(ranked[:keep]))
        return out

    def _chat_choice(self, choice: _Choice) -> dict[str, Any]:
        logprobs = self._all_logprobs(choice)
        parser = choice.parser
        role = self.req.chat_fields.role if self.req.chat_fields is not None else "assistant"
        if parser is None:
            return chat_choice(choice.index, choice.text, choice.finish_reason,
                               choice.stop_reason, logprobs, role=role)
        echo = self.echo_text(choice) if self.req.echo else ""
        parser.feed(choice.text[len(echo):])
        parser.finish()
        message = parser.message(cut_short=choice.finish_reason == "length").to_openai(role)
        if self._forced:
            # A forced call's answer has empty content and a list of calls (empty when
            # max_tokens cut the only call short), as vLLM sends it.
            message["content"] = message["content"] or ""
            message.setdefault("tool_calls", [])
        if echo:
            message["content"] = echo + (message["content"] or "")
        message.setdefault("reasoning", None)  # vLLM's key, null without reasoning
        finish = parser.finish_reason(choice.finish_reason)
        if self.req.legacy_functions:
            message, finish = legacy_message(message, finish)
        return chat_choice(choice.index, choice.text, finish, choice.stop_reason, logprobs,
                           message=message)

    def _all_logprobs(self, choice: _Choice) -> dict[str, Any] | None:
        if self.req.top_logprobs is None:
            return None
        if self.req.chat:
            return chat_logprobs(choice.logprobs, self._token_text, self.req.top_logprobs)
        choice.offset = 0
        if not self.req.echo:
            return self._completion_logprobs(choice.logprobs, choice)
        # The prompt's tokens first, then the completion's, one running text_offset.
        scored = self._completion_logprobs(self._echo_entries(choice, choice.prompt_scores),
                                           choice)
        generated = self._completion_logprobs(choice.logprobs, choice)
        return {key: scored[key] + generated[key] for key in generated}

    # -- streamed -----------------------------------------------------------------------

    def opening_chunks(self) -> list[dict[str, Any]]:
        """What a stream starts with: each chat choice's role, or each echo (no logprobs)."""
        if self.req.chat:
            top = ({"prompt_token_ids": list(self._prompt_ids[0])}
                   if self.req.return_token_ids else {})
            role = self.req.chat_fields.role if self.req.chat_fields is not None else True
            return [self._chunk(chunk_choice(
                True, c.index, self.echo_text(c) if self.req.echo else "", None, None, None,
                role=role), c, top) for c in self.choices]
        if self.req.echo and not self._echo_later:
            return [self._echo_chunk(c, None) for c in self.choices]
        return []

    def stream_output(self, prompt_index: int, out: Any) -> list[dict[str, Any]]:
        """Record one engine output; the chunks to send for it (none while its tokens are
        not yet text)."""
        choice = self.choices[prompt_index * self._n + out.index]
        chunks = []
        if self._echo_later and not choice.echoed:
            entries = self._echo_entries(choice, out.prompt_logprobs)
            choice.offset = 0
            chunks.append(self._echo_chunk(choice, self._completion_logprobs(entries, choice)))
        choice.held.extend(out.logprobs or ())
        choice.held_ids.extend(out.token_ids)
        if not out.text and not out.finished:
            self.record(prompt_index, out)
            return chunks
        logprobs = None
        if self.req.top_logprobs is not None and out.logprobs is not None:
            logprobs = (chat_logprobs(choice.held, self._token_text, self.req.top_logprobs)
                        if self.req.chat else self._completion_logprobs(choice.held, choice))
        choice.held = []
        self.record(prompt_index, out)
        finish = out.finish_reason if out.finished else None
        stop_reason = out.stop_reason if out.finished else None
        if choice.parser is None:
            chunks.append(self._chunk(chunk_choice(
                self.req.chat, choice.index, out.text, finish, stop_reason, logprobs), choice))
            return chunks
        delta = choice.parser.feed(out.text)
        if out.finished:
            end = choice.parser.finish(cut_short=out.finish_reason == "length")
            delta = ChatDelta(delta.reasoning + end.reasoning, delta.content + end.content,
                              delta.tool_calls + end.tool_calls)
            finish = choice.parser.finish_reason(finish)
            if self.req.legacy_functions:
                finish = legacy_finish(finish)
        if (not delta and not out.finished and logprobs is None
                and not self.req.return_token_ids):
            return chunks  # held back (a possible call marker): nothing to send yet
        parts = delta.to_openai_chunks()
        if self.req.legacy_functions:
            parts = [legacy_delta(fields) for fields in parts]
        for k, fields in enumerate(parts):
            last = k == len(parts) - 1
            chunks.append(self._chunk(chunk_choice(
                True, choice.index, None, finish if last else None,
                stop_reason if last else None, logprobs if k == 0 else None,
                delta_fields=fields), choice))
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        return chunk_body(self.req.chat, self.id, self.created, self.model, [], True, self.usage())

    def _echo_chunk(self, choice: _Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        choice.text = self.echo_text(choice)
        choice.echoed = True
        return self._chunk(chunk_choice(False, choice.index, choice.text, None, None, logprobs),
                           choice)

    def _chunk(self, body_choice: dict[str, Any], choice: _Choice,
               top: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chunk of one choice; with return_token_ids its held ids go with it (and, the
        first time, a completion choice's prompt ids); ``top``: chunk-level fields."""
        if self.req.return_token_ids:
            if not self.req.chat and not choice.ids_sent:
                # A prompt given as embeddings has no ids (vLLM's null).
                body_choice["prompt_token_ids"] = (None if self._embedded(choice)
                                                   else list(self._prompt_of(choice)))
                choice.ids_sent = True
            body_choice["token_ids"], choice.held_ids = choice.held_ids, []
        body = chunk_body(self.req.chat, self.id, self.created, self.model, [body_choice],
                          self.include_usage)
        if top:
            body.update(top)
        if self._continuous:
            body["usage"] = usage_dict(len(self._prompt_of(choice)), choice.tokens)
        return body
