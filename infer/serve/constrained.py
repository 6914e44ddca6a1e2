"""What a request's output is constrained to, and how its tool calls are read: `output_rules`.

One field at most constrains the output: `response_format` (json_object, json_schema), vLLM's
`structured_outputs` or one of its `guided_*` fields, or a chat's `tool_choice` when it forces
calls (a named function: the output is its arguments, valid against its parameters' schema;
"required": a JSON array of calls, each one tool's name and parameters). tool_choice "auto" (the
default with tools) leaves the output free and reads the calls the server's --tool-call-parser
finds in it; "none" reads none. The chat's tools reach the chat template whatever the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.api.errors import RequestError, one_line
from infer.api.structured import StructuredOutputs
from infer.serve.errors import APIError
from infer.serve.output_protocol import NamedToolChoice, Tool
from infer.serve.protocol import ChatRequest, SamplingFields
from infer.serve.tool_parsers import PARSERS, ToolParser
from infer.serve.tool_parsers.forced import NamedCall, RequiredCalls

NO_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters` takes none


@dataclass(slots=True)
class OutputRules:
    """One request's constraint and tools."""

    structured: StructuredOutputs | None  # what the output must match; None: it is free
    asked_by: str | None  # the request field that constrains it (errors about the constraint name it)
    tools: list[dict[str, Any]] | None  # the chat's tools, as the chat template reads them
    parser: ToolParser | None  # reads each choice's tool calls out of its text; None: no calls are read


def output_rules(req: SamplingFields, tool_call_parser: str | None = None) -> OutputRules:
    """The request's rules; a 400 naming the field for a constraint that is invalid or one too many.
    tool_call_parser: the server's --tool-call-parser (a name in PARSERS), None if it has none."""
    asked = _asked(req)
    tools, parser = None, None
    if isinstance(req, ChatRequest) and (req.tools or req.tool_choice not in (None, "none")):
        tools, parser, forced = _tool_use(req, tool_call_parser)
        if forced is not None:
            if asked:
                raise APIError(
                    400,
                    f"tool_choice {_choice_text(req)} constrains the output to its calls, so {asked[0][0]} cannot "
                    f"also constrain it: drop {asked[0][0]}, or use tool_choice 'auto'",
                    param=asked[0][0],
                )
            asked = [("tool_choice", forced)]
    if len(asked) > 1:
        first, second = asked[0][0], asked[1][0]
        raise APIError(400, f"{first} and {second} both constrain the output: give one of them", param=second)
    if not asked:
        return OutputRules(None, None, tools, parser)
    param, fields = asked[0]
    try:
        structured = StructuredOutputs.coerce(fields)
    except RequestError as exc:
        raise APIError(400, f"{param}: {one_line(exc)}", param=param) from None
    return OutputRules(structured, param, tools, parser)


def _asked(req: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """(field, StructuredOutputs' fields) for each field that constrains the output."""
    asked: list[tuple[str, dict[str, Any]]] = []
    form = req.response_format
    if form is not None and form.json_schema is not None:
        asked.append(("response_format", {"json": form.json_schema.schema_}))
    elif form is not None and form.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", req.structured_outputs))
    asked += [(name, {kind: value}) for name, kind, value in req.guided()]
    return asked


def _tool_use(
    req: ChatRequest, tool_call_parser: str | None
) -> tuple[list[dict[str, Any]], ToolParser | None, dict[str, Any] | None]:
    """(the tools for the template, the parser of the calls, the constraint a forced call puts on the output)."""
    choice = req.tool_choice
    if not req.tools:
        raise APIError(
            400, f"tool_choice {_choice_text(req)} needs tools: give tools, or drop tool_choice", param="tool_choice"
        )
    names = [t.function.name for t in req.tools]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise APIError(400, f"two tools are named {twice[0]!r}: give each function its own name", param="tools")
    template_tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "none":
        return template_tools, None, None
    if isinstance(choice, NamedToolChoice):
        function = next((t.function for t in req.tools if t.function.name == choice.function.name), None)
        if function is None:
            raise APIError(
                400,
                f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)}): name one of them",
                param="tool_choice",
            )
        return template_tools, NamedCall(function.name), {"json": function.parameters or NO_PARAMETERS}
    if choice == "required":
        return template_tools, RequiredCalls(), {"json": calls_schema(req.tools, req.parallel_tool_calls is False)}
    if tool_call_parser is None:
        raise APIError(
            400,
            "tool_choice 'auto' (the default with tools) reads calls out of the text, and this server has no "
            f"parser for them: start it with --tool-call-parser ({', '.join(PARSERS)}), or send tool_choice "
            "'none', 'required' or a named function",
            param="tool_choice",
        )
    return template_tools, PARSERS[tool_call_parser](), None


def calls_schema(tools: list[Tool], one: bool = False) -> dict[str, Any]:
    """A JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`, each one tool's name and
    arguments; at least one call (`one`: exactly one)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": t.function.name},
                "parameters": t.function.parameters or NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if one:
        schema["maxItems"] = 1
    return schema


def _choice_text(req: ChatRequest) -> str:
    choice = req.tool_choice
    return f"{{'function': {choice.function.name!r}}}" if isinstance(choice, NamedToolChoice) else repr(choice)
