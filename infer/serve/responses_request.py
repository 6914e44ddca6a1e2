"""The Responses API's request (`POST /v1/responses`) and how it becomes a chat request: `instructions` the
system message, then the stored conversation of `previous_response_id`, then `input` (text or items:
messages, `function_call` items as an assistant's tool calls, `function_call_output` items as tool
messages; `reasoning` items are dropped, as the model's template does not take them back). Function tools,
`tool_choice`, `max_output_tokens`, `temperature`, `top_p`, `text.format` (json_object, json_schema) and
`reasoning.effort` (the template's reasoning_effort) are carried over (`responses` answers it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from infer.serve.errors import APIError
from infer.serve.protocol import WHOLE, ChatRequest


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr
    annotations: list[Any] | None = None  # accepted (an output_text sent back)


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[StrictStr, list[TextPart]]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


InputItem = Union[
    Annotated[Union[FunctionCallItem, FunctionCallOutputItem, ReasoningItem], Field(discriminator="type")],
    MessageItem,
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: bool | None = None


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: StrictStr | None = None  # accepted and ignored


class ReasoningOptions(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: StrictStr | None = None  # accepted and ignored: the reasoning comes whole


class ResponsesRequest(Strict):
    """POST /v1/responses."""

    model: StrictStr
    input: Union[Annotated[StrictStr, Field(min_length=1)], Annotated[list[InputItem], Field(min_length=1)]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = None
    store: bool | None = None  # None: true, as OpenAI's
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    metadata: dict[str, str] | None = None  # kept on the response
    user: StrictStr | None = None  # accepted and ignored
    truncation: Literal["disabled", "auto"] | None = None  # accepted: the context is refused, never cut
    include: list[StrictStr] | None = None  # accepted and ignored
    service_tier: StrictStr | None = None  # accepted and ignored
    safety_identifier: StrictStr | None = None  # accepted and ignored
    prompt_cache_key: StrictStr | None = None  # accepted and ignored

    def messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages

    def to_chat(self, history: list[dict[str, Any]]) -> ChatRequest:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.messages(),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
        }
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description or "", "parameters": t.parameters or {}},
                }
                for t in self.tools
            ]
        if self.tool_choice is not None and (self.tools or self.tool_choice == "none"):
            choice = self.tool_choice
            fields["tool_choice"] = (
                choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
            )
        form = self.text.format if self.text else None
        if form is not None and form.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif form is not None and form.type == "json_schema":
            if form.schema_ is None or not form.name:
                raise APIError(400, "text.format: json_schema needs its name and schema", param="text.format")
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": form.name, "schema": form.schema_},
            }
        if not fields["messages"]:  # reasoning items alone: the template takes none of them back
            raise APIError(
                400, "input holds no message to answer (reasoning items are dropped): add one", param="input"
            )
        try:
            return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:  # what the chat request refuses, named as this request names it
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error.get("loc", ()))
            name = RESPONSES_NAMES.get(where.split(".")[0], where) if where else "input"
            raise APIError(400, f"{name}: {error.get('msg', 'invalid')}", param=name) from None


RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
