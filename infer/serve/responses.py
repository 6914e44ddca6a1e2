"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) over the chat machinery.

A request becomes a chat request (`ResponsesRequest.to_chat`, `responses_request`): `instructions` the system message, then
the conversation of `previous_response_id` (from a bounded in-memory store: the newest `STORE_SIZE`
responses), then `input`, text or items: messages (input_text / output_text parts), `function_call`
items as an assistant's tool calls, `function_call_output` items as tool messages (`reasoning` items
are dropped: the model's template does not take them back). Function tools, `tool_choice`,
`max_output_tokens`, `temperature`, `top_p`, `text.format` (json_object, json_schema) and
`reasoning.effort` (the template's reasoning_effort) are carried over.

The answer is the chat's, as Responses output items: a `reasoning` item (with `--reasoning-parser`), a
`message` with one output_text part, and a `function_call` item per call; status "incomplete" when
max_output_tokens cut it. Streamed as the API's semantic events: response.created, in_progress,
output_item.added / done, content_part.added / done, output_text.delta / done,
function_call_arguments.delta / done, reasoning_text.delta / done, then response.completed with the
whole response, each with its sequence_number. A response is stored unless `store` is false.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from infer.api.request import RequestOutput
from infer.core.stream import CompletionDelta
from infer.serve.errors import APIError
from infer.serve.formats import ChatFormat, chat_pieces
from infer.serve.generation import Generation, OpenAIEvents, sse_event
from infer.serve.responses_request import RESPONSES_NAMES, ResponsesRequest

__all__ = ["RESPONSES_NAMES", "ResponseObject", "ResponseStore", "ResponsesFormat", "ResponsesRequest", "renamed"]

STORE_SIZE = 1000  # responses kept for previous_response_id and GET, newest first out last


def renamed(error: APIError, names: dict[str, str]) -> APIError:
    """A chat error about a field, naming the field as this API spells it."""
    new = names.get(error.param or "")
    if new is None:
        return error
    message = re.sub(rf"\b{re.escape(error.param or '')}\b", new, error.message)
    return APIError(error.status, message, error.type, new, error.code, error.headers)


class ResponseStore:
    """The newest responses, for previous_response_id and GET /v1/responses/{id}: each with the chat
    messages of its whole conversation (its input and its output). `held_by`: the store that keeps them
    instead, in another process (a `multiprocessing` manager's proxy of a ResponseStore, shared by the API
    server processes of `--api-server-count`)."""

    def __init__(self, size: int = STORE_SIZE, held_by: Any = None) -> None:
        self.size = size
        self.held_by = held_by
        self.responses: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def find(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """The response and its conversation; None when not stored (or no longer)."""
        if self.held_by is not None:
            return self.held_by.find(response_id)
        return self.responses.get(response_id)

    def history(self, response_id: str | None) -> list[dict[str, Any]]:
        if response_id is None:
            return []
        found = self.find(response_id)
        if found is None:
            raise APIError(
                404, f"no stored response {response_id!r}: it expired (the newest {self.size} are kept) or was not stored",
                param="previous_response_id",
            )  # fmt: skip
        return list(found[1])

    def get(self, response_id: str) -> dict[str, Any]:
        found = self.find(response_id)
        if found is None:
            raise APIError(404, f"no stored response {response_id!r}", "not_found_error")
        return found[0]

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.held_by is not None:
            self.held_by.put(response, conversation)
            return
        self.responses[response["id"]] = (response, conversation)
        while len(self.responses) > self.size:
            self.responses.popitem(last=False)


class ResponsesFormat(OpenAIEvents):
    """The chat's answer as a Responses response (one choice: the API has no `n`)."""

    end: str | None = None  # response.completed ends the stream

    def __init__(
        self, chat: ChatFormat, req: ResponsesRequest, conversation: list[dict[str, Any]], store: ResponseStore
    ) -> None:
        self.chat, self.req, self.conversation, self.store = chat, req, conversation, store
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output items so far (streamed)
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # a chunk's call index -> its item
        self.finish: str | None = None

    def event(self, chunk: dict[str, Any]) -> str:
        return f"event: {chunk['type']}\n{sse_event(chunk)}"

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _object(self, gen: Generation, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        r = self.req
        usage = None
        if status != "in_progress":
            usage = {
                "input_tokens": gen.prompt_tokens,
                "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": gen.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            }
        tool_choice = (
            r.tool_choice if isinstance(r.tool_choice, str) or r.tool_choice is None else r.tool_choice.model_dump()
        )
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": gen.served.name, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "previous_response_id": r.previous_response_id,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []], "tool_choice": tool_choice or "auto",
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "temperature": r.temperature if r.temperature is not None else 1.0, "top_p": r.top_p if r.top_p is not None else 1.0,
            "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {}, "store": r.store is not False,
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
        }  # fmt: skip

    def _keep(self, response: dict[str, Any]) -> dict[str, Any]:
        """Store the response with its conversation (its output as chat messages) unless store is false."""
        if self.req.store is not False:
            output: list[dict[str, Any]] = []
            for item in response["output"]:
                if item["type"] == "message":
                    output.append({"role": "assistant", "content": item["content"][0]["text"]})
                elif item["type"] == "function_call":
                    call = {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                    if output and "tool_calls" in output[-1]:
                        output[-1]["tool_calls"].append(call)
                    else:
                        output.append({"role": "assistant", "content": "", "tool_calls": [call]})
            self.store.put(response, self.conversation + output)
        return response

    # ---------------------------------------------------------------- the JSON answer

    def response(self, gen: Generation, finals: list[RequestOutput]) -> Any:
        message = self.chat.response(gen, finals).choices[0]
        output: list[dict[str, Any]] = []
        if message.message.reasoning_content:
            output.append(_reasoning_item(message.message.reasoning_content))
        if message.message.content:
            output.append(_message_item(message.message.content))
        for call in message.message.tool_calls or ():
            output.append(_call_item(call.id, call.function.name, call.function.arguments))
        status = "incomplete" if message.finish_reason == "length" else "completed"
        return ResponseObject(**self._keep(self._object(gen, status, output)))

    # ---------------------------------------------------------------- the stream

    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        started = self._object(gen, "in_progress", [])
        return [self._ev("response.created", response=started), self._ev("response.in_progress", response=started)]

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._done()
        self.open = item
        self.items.append(item)
        index = len(self.items) - 1
        shown = {**item, "status": "in_progress"}
        if item["type"] == "message":
            shown["content"] = []
            return [*events, self._ev("response.output_item.added", output_index=index, item=shown),
                    self._ev("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})]  # fmt: skip
        if item["type"] == "function_call":
            shown["arguments"] = ""
        if item["type"] == "reasoning":
            shown["content"] = []
        return [*events, self._ev("response.output_item.added", output_index=index, item=shown)]

    def _done(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [
                self._ev("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text),
                self._ev("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=item["content"][0]),
            ]  # fmt: skip
        elif item["type"] == "function_call":
            events.append(
                self._ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self._ev(
                    "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text
                )
            )
        return [*events, self._ev("response.output_item.done", output_index=index, item=item)]

    def chunks(self, gen: Generation, index: int, delta: CompletionDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for piece in chat_pieces(self.chat.chunks(gen, index, delta)):
            if piece.kind in ("reasoning", "text"):
                kind, make, event = (
                    ("reasoning", _reasoning_item, "response.reasoning_text.delta")
                    if piece.kind == "reasoning"
                    else ("message", _message_item, "response.output_text.delta")
                )
                if self.open is None or self.open["type"] != kind:
                    events += self._start(make(""))
                assert self.open is not None
                self.open["content"][0]["text"] += piece.text
                extra = {"logprobs": []} if kind == "message" else {}
                events.append(self._ev(event, item_id=self.open["id"], output_index=len(self.items) - 1,
                                       content_index=0, delta=piece.text, **extra))  # fmt: skip
            elif piece.kind == "call":
                opened = _call_item(piece.call_id, piece.name, "")
                events += self._start(opened)
                self.calls[piece.index] = opened
            elif piece.kind == "arguments" and (item := self.calls.get(piece.index)) is not None:
                item["arguments"] += piece.text
                events.append(self._ev("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.items.index(item), delta=piece.text))  # fmt: skip
            elif piece.kind == "finish":
                self.finish = piece.text
        return events

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        events = self._done()
        status = "incomplete" if self.finish == "length" else "completed"
        final = self._keep(self._object(gen, status, self.items))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._ev(kind, response=final)]


class ResponseObject(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"] = "response"
    status: str
    output: list[dict[str, Any]]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": _item_id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def _reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}  # fmt: skip
