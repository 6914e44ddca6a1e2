"""The OpenAI API's shapes of what a request asks its output to be (`response_format`, `tools`,
`tool_choice`) and of the tool calls an answer carries. `protocol` puts them in its requests and
answers; `constrained` turns them into what the engine runs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

Name = Annotated[StrictStr, Field(min_length=1)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Name  # the schema's name (OpenAI requires one; it changes nothing here)
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # the JSON schema the output is valid against
    strict: StrictBool | None = None  # accepted: the output always matches its schema here


# json_schema with type json_schema, and only then (as the validator below says it)
SCHEMA_WITH_ITS_TYPE = [
    {
        "properties": {"type": {"const": "json_schema"}, "json_schema": {"not": {"type": "null"}}},
        "required": ["json_schema"],
    },
    {"properties": {"type": {"enum": ["text", "json_object"]}, "json_schema": {"type": "null"}}},
]


class ResponseFormat(BaseModel):
    """text: free text; json_object: any JSON object; json_schema: JSON valid against `json_schema.schema`."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"oneOf": SCHEMA_WITH_ITS_TYPE})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type json_schema, and only then

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("give json_schema with type 'json_schema', and only then")
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Name  # what the model calls it by
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments; None: no arguments
    strict: StrictBool | None = None  # accepted: forced calls always match their schema here


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Name


class NamedToolChoice(BaseModel):
    """Call this function: the output is its arguments."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionName


# ---------------------------------------------------------------------- answers


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON text


class ToolCallOut(BaseModel):
    id: str  # call_...
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in the call's first chunk
    arguments: str | None = None  # "" in the first chunk, then pieces that join to the arguments


class ToolCallDelta(BaseModel):
    index: int  # which call of the choice
    id: str | None = None  # in the call's first chunk
    type: Literal["function"] | None = None  # in the call's first chunk
    function: FunctionCallDelta
