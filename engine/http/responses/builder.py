"""The answer to a ``/v1/responses`` request: output items and OpenAI's typed stream events.

Pure (no I/O, no trio). :class:`ResponseBuilder` turns the chat output parser's deltas
(reasoning, text, calls) into output items and OpenAI's typed stream events, in OpenAI's
order; the non-streamed answer is the same builder's final response, so both agree by
construction. :func:`input_items_page` pages a stored response's input items.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from engine.chat.output import ChatDelta, ChatOutputParser
from engine.http.errors import APIError
from engine.http.responses.protocol import ResponsesRequest, new_id


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int,
          reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


class ResponseBuilder:
    """One response's output items and stream events, from its chat output parser.

    ``start()`` gives ``response.created`` and ``response.in_progress``; ``feed(text)`` the
    events a piece of model text adds; ``finish(reason, usage)`` closes the open item and
    gives ``response.completed`` (or ``response.incomplete`` when the output hit
    ``max_output_tokens``); ``fail(error)`` gives ``response.failed``. Items open and close
    in order (reasoning, message, function calls, as the model wrote them), each as::

        output_item.added, [content_part.added], *.delta..., *.done, [content_part.done],
        output_item.done

    Every event carries ``sequence_number`` (0, 1, ...). :meth:`response` is the response
    object at any point; after ``finish`` it is the complete, non-streamed answer.
    """

    def __init__(self, req: ResponsesRequest, model: str, parser: ChatOutputParser) -> None:
        self.req = req
        self.model = model
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.status = "in_progress"
        self.output: list[dict[str, Any]] = []
        self._parser = parser
        self._open: int | None = None  # index in output of the item being written
        self._calls: dict[int, int] = {}  # a call's parser index -> its output index
        self._seq = 0
        self._pending_space = ""  # whitespace that opens no message by itself
        self._thinking = True  # no answer text or call yet
        self._thinking_tokens = 0
        self._usage: dict[str, Any] | None = None
        self._error: dict[str, Any] | None = None
        self._incomplete: dict[str, Any] | None = None
        self._completed_at: int | None = None
        # Output tokens' logprobs not yet given to a text delta (include logprobs): they go
        # with the next text the message shows.
        self._pending_logprobs: list[dict[str, Any]] = []

    # -- the response object

    def response(self) -> dict[str, Any]:
        echo = self.req.echo
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "background": False, "completed_at": self._completed_at,
            "error": self._error, "incomplete_details": self._incomplete,
            "instructions": echo["instructions"], "max_output_tokens": echo["max_output_tokens"],
            "max_tool_calls": None, "metadata": echo["metadata"], "model": self.model,
            "output": copy.deepcopy(self.output),
            "parallel_tool_calls": echo["parallel_tool_calls"],
            "previous_response_id": echo["previous_response_id"],
            "reasoning": echo["reasoning"], "service_tier": "default",
            "store": self.req.store, "temperature": echo["temperature"], "text": echo["text"],
            "tool_choice": echo["tool_choice"], "tools": echo["tools"], "top_p": echo["top_p"],
            "top_logprobs": echo["top_logprobs"],
            "truncation": echo["truncation"], "usage": self._usage, "user": echo["user"],
        }

    def turn_message(self) -> dict[str, Any]:
        """The reply as a chat assistant message (what the store keeps for the next turn)."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        reasoning = "".join(i["content"][0]["text"] for i in self.output
                            if i["type"] == "reasoning")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant",
                                   "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = reasoning
        return message

    # -- events

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, text: str, tokens: int = 0,
             logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The events one engine output's ``text`` (of ``tokens`` tokens, with their
        ``logprobs`` entries when the request includes them) adds."""
        self._pending_logprobs += logprobs or ()
        events = self._delta(self._parser.feed(text))
        if self._thinking:
            self._thinking_tokens += tokens
        return events

    def finish(self, engine_reason: str | None, prompt_tokens: int, output_tokens: int,
               cached_tokens: int) -> list[dict[str, Any]]:
        events = self._delta(self._parser.finish(cut_short=engine_reason == "length"))
        incomplete = self._parser.finish_reason(engine_reason) == "length"
        if self._pending_space and not self.output:  # an answer of whitespace alone
            events += self._ensure("message")
            events += self._text(self._pending_space)
        if self._pending_logprobs and self._kind() == "message":
            # Tokens that showed no text (the end of text): still the message's tokens.
            self._item()["content"][0]["logprobs"] += self._pending_logprobs
            self._pending_logprobs = []
        events += self._close("incomplete" if incomplete else "completed")
        thought = any(i["type"] == "reasoning" for i in self.output)
        self._usage = usage(prompt_tokens, output_tokens, cached_tokens,
                            self._thinking_tokens if thought else 0)
        self._completed_at = int(time.time())
        if incomplete:
            self.status = "incomplete"
            self._incomplete = {"reason": "max_output_tokens"}
            return [*events, self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return [*events, self._event("response.completed", response=self.response())]

    def fail(self, error: APIError) -> list[dict[str, Any]]:
        events = self._close("incomplete")
        self.status = "failed"
        self._error = {"code": "server_error", "message": error.message}
        return [*events, self._event("response.failed", response=self.response())]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _delta(self, delta: ChatDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._ensure("reasoning")
            item = self._item()
            item["content"][0]["text"] += delta.reasoning
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                      output_index=self._open, content_index=0,
                                      delta=delta.reasoning))
        if delta.content or delta.tool_calls:
            self._thinking = False
        if delta.content:
            text = self._pending_space + delta.content
            if self._kind() != "message" and not text.strip():
                self._pending_space = text
            else:
                self._pending_space = ""
                events += self._ensure("message")
                events += self._text(text)
        for call in delta.tool_calls:
            if call.id is not None or call.index not in self._calls:
                events += self._close("completed")
                self._pending_space = ""
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call.id or new_id("call"), "name": call.name or "",
                        "arguments": ""}
                self.output.append(item)
                self._open = self._calls[call.index] = len(self.output) - 1
                events.append(self._event("response.output_item.added",
                                          output_index=self._open, item=copy.deepcopy(item)))
            if call.arguments:
                index = self._calls[call.index]
                item = self.output[index]
                item["arguments"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=item["id"], output_index=index,
                                          delta=call.arguments))
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        item = self._item()
        item["content"][0]["text"] += text
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        item["content"][0]["logprobs"] += logprobs
        return [self._event("response.output_text.delta", item_id=item["id"],
                            output_index=self._open, content_index=0, delta=text,
                            logprobs=logprobs)]

    def _item(self) -> dict[str, Any]:
        assert self._open is not None  # callers open an item first
        return self.output[self._open]

    def _kind(self) -> str | None:
        return None if self._open is None else self.output[self._open]["type"]

    def _ensure(self, kind: str) -> list[dict[str, Any]]:
        """Open an item of ``kind`` unless that is the one being written."""
        if self._kind() == kind:
            return []
        events = self._close("completed")
        if kind == "message":
            item: dict[str, Any] = {"id": new_id("msg"), "type": "message", "role": "assistant",
                                    "status": "in_progress", "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self._open = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=self._open,
                                  item=copy.deepcopy(item)))
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"],
                                  output_index=self._open, content_index=0,
                                  part=copy.deepcopy(part)))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.output[index]
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events.append(self._event(done, item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      part=copy.deepcopy(part)))
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=copy.deepcopy(item)))
        return events


def input_items_page(items: list[dict[str, Any]], *, limit: int, order: str,
                     after: str | None) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of the items, OpenAI's list shape."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [i["id"] for i in ordered]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response",
                           param="after", code="invalid_value")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > limit}
