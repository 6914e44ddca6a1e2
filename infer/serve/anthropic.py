"""Anthropic's Messages API (`POST /v1/messages`) over the chat completions machinery.

A Messages request becomes a chat request (`to_chat`): `system` the first message, text blocks a
message's content, an assistant's `tool_use` blocks its tool calls, a user's `tool_result` blocks tool
messages, `tools` functions (their `input_schema` the parameters), `tool_choice` auto / any / tool /
none as auto / required / a named function / none, `stop_sequences` stop strings, `thinking` the
template's `enable_thinking`; `temperature`, `top_p`, `top_k` as older clients send them. The answer is the
chat's, written in Anthropic's shapes (`AnthropicFormat`): content blocks (thinking, with
`--reasoning-parser`; text; tool_use), `stop_reason` end_turn / max_tokens / tool_use, usage in input
and output tokens; streamed as Anthropic's named events (message_start, content_block_start / delta /
stop, message_delta, message_stop). Errors on this route have Anthropic's body,
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from infer.api.request import RequestOutput
from infer.core.stream import CompletionDelta
from infer.serve.errors import APIError
from infer.serve.formats import ChatFormat, chat_pieces
from infer.serve.generation import Generation, sse_event
from infer.serve.protocol import WHOLE, ChatRequest

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class AnthropicError(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextBlock(Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: dict[str, Any] | None = None  # accepted and ignored: prefix caching needs no marks


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Union[StrictStr, list[TextBlock], None] = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "\n".join(b.text for b in content or [])


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Union[StrictStr, Annotated[list[Block], Field(min_length=1)]]


class AnthropicTool(Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None  # with type "tool"
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Strict):
    """POST /v1/messages."""

    model: StrictStr
    max_tokens: Annotated[int, Field(ge=1), WHOLE]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[StrictStr, list[TextBlock], None] = None
    stop_sequences: list[Annotated[StrictStr, Field(min_length=1)]] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1), WHOLE] | None = None
    stream: bool | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored
    # {"type": "enabled" | "adaptive" | "disabled", ...}: the chat template's enable_thinking (Qwen3's, ...)
    thinking: dict[str, Any] | None = None
    # accepted and ignored: one service, no cache marks needed (prefix caching finds prefixes itself)
    cache_control: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: StrictStr | None = None
    output_config: dict[str, Any] | None = None
    speed: StrictStr | None = None
    user_profile_id: StrictStr | None = None
    workspace_id: StrictStr | None = None

    def to_chat(self) -> ChatRequest:
        """The same request as a chat completions request."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for m in self.messages:
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            text = "\n".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [b for b in m.content if isinstance(b, ToolUseBlock)]
            results = [b for b in m.content if isinstance(b, ToolResultBlock)]
            messages += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()} for r in results]
            if m.role == "assistant" and calls:
                tool_calls = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.input)}}
                    for c in calls
                ]
                messages.append({"role": "assistant", "content": text, "tool_calls": tool_calls})  # "" for templates
            elif text or not results:
                messages.append({"role": m.role, "content": text})
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
        }
        if self.thinking is not None and self.thinking.get("type") in ("enabled", "adaptive", "disabled"):
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking["type"] != "disabled"}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None and (self.tools or choice.type == "none"):
            if choice.type == "tool" and not choice.name:
                raise APIError(400, "tool_choice: type 'tool' needs the tool's name", param="tool_choice")
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function",
                "function": {"name": choice.name},
            }
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})


class AnthropicFormat:
    """The chat's answer in Anthropic's shapes: one choice (Messages has no `n`)."""

    end: str | None = None  # message_stop ends the stream

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self.block: tuple[str, int] | None = None  # the open content block: (kind, its index)
        self.count = 0  # blocks opened
        self.stop_reason: str | None = None

    def event(self, chunk: dict[str, Any]) -> str:
        return f"event: {chunk['type']}\n{sse_event(chunk)}"

    def error_body(self, error: APIError) -> dict[str, Any]:
        return error.anthropic_body()

    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        message = {
            "id": _message_id(gen), "type": "message", "role": "assistant", "model": gen.served.name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0},
        }  # fmt: skip
        return [{"type": "message_start", "message": message}]

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.block = (kind, self.count)
        self.count += 1
        return [*events, {"type": "content_block_start", "index": self.block[1], "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        index, self.block = self.block[1], None
        return [{"type": "content_block_stop", "index": index}]

    def chunks(self, gen: Generation, index: int, delta: CompletionDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for piece in chat_pieces(self.chat.chunks(gen, index, delta)):
            if piece.kind == "reasoning":
                if self.block is None or self.block[0] != "thinking":
                    events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append(_delta(self.block, {"type": "thinking_delta", "thinking": piece.text}))
            elif piece.kind == "text":
                if self.block is None or self.block[0] != "text":
                    events += self._open("text", {"type": "text", "text": ""})
                events.append(_delta(self.block, {"type": "text_delta", "text": piece.text}))
            elif piece.kind == "call":
                block = {"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}}
                events += self._open("tool_use", block)
            elif piece.kind == "arguments":
                events.append(_delta(self.block, {"type": "input_json_delta", "partial_json": piece.text}))
            elif piece.kind == "finish":
                self.stop_reason = STOP_REASONS.get(piece.text, "end_turn")
        return events

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        usage = {"output_tokens": gen.completion_tokens}
        delta = {"stop_reason": self.stop_reason or "end_turn", "stop_sequence": None}
        return [*self._close(), {"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]

    def response(self, gen: Generation, finals: list[RequestOutput]) -> Any:
        chat = self.chat.response(gen, finals)
        choice = chat.choices[0]
        message = choice.message
        content: list[dict[str, Any]] = []
        if message.reasoning_content:
            content.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls or ():
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = {}
            content.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": arguments})
        usage = {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens}
        if gen.cached_tokens:
            usage["cache_read_input_tokens"] = gen.cached_tokens
        return AnthropicMessage(
            id=_message_id(gen),
            model=gen.served.name,
            content=content,
            stop_reason=STOP_REASONS.get(choice.finish_reason or "stop", "end_turn"),
            usage=usage,
        )


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str
    stop_sequence: str | None = None
    usage: dict[str, int]


def _message_id(gen: Generation) -> str:
    return "msg_" + gen.id.rsplit("-", 1)[-1]


def _delta(block: tuple[str, int] | None, delta: dict[str, Any]) -> dict[str, Any]:
    assert block is not None, "a delta follows its block's start"
    return {"type": "content_block_delta", "index": block[1], "delta": delta}
