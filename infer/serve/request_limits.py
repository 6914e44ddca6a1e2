"""`check_request`: a request past one of the server's `ServeLimits` is a 400 naming the field and the
`infer serve` option that raises the limit, before any work is done for it; `openapi_limits`: the
app's OpenAPI schema states the limits JSON Schema can express (a JSON schema's size and depth and
the choices' total length it cannot).
"""

from __future__ import annotations

import json
from typing import Any

from infer.serve.errors import APIError
from infer.serve.limits import ServeLimits
from infer.serve.protocol import ChatRequest, SamplingFields

__all__ = ["check_request", "json_depth", "openapi_limits", "structured_outputs_schema"]


def check_request(req: SamplingFields, limits: ServeLimits) -> None:
    """A 400 naming the field and the option to raise, for a request past one of `limits`."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    _at_most(len(stop), limits.max_stop, "stop", "stop strings", "--max-stop")
    _at_most(len(req.logit_bias or ()), limits.max_logit_bias, "logit_bias", "logit_bias entries", "--max-logit-bias")
    for param, kind, value in _constraints(req):
        if kind == "json":
            _check_schema(value, limits, param)
        elif kind == "regex" and isinstance(value, str):
            _at_most(len(value), limits.max_regex_length, param, "regex characters", "--max-regex-length")
        elif kind == "grammar" and isinstance(value, str):
            _at_most(len(value), limits.max_grammar_length, param, "grammar characters", "--max-grammar-length")
        elif kind == "choice" and isinstance(value, list):
            _at_most(len(value), limits.max_choices, param, "choices", "--max-choices")
            length = sum(len(c) for c in value if isinstance(c, str))
            _at_most(length, limits.max_choices_length, param, "characters of choices", "--max-choices-length")


def json_depth(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _constraints(req: SamplingFields) -> list[tuple[str, str, Any]]:
    """(request field, StructuredOutputs kind, value) for each constraint the request carries."""
    found: list[tuple[str, str, Any]] = []
    if req.response_format is not None and req.response_format.json_schema is not None:
        found.append(("response_format", "json", req.response_format.json_schema.schema_))
    if isinstance(req.structured_outputs, dict):
        found += [("structured_outputs", kind, value) for kind, value in req.structured_outputs.items()]
    found += req.guided()  # guided_json, guided_regex, guided_choice, guided_grammar
    if isinstance(req, ChatRequest):
        found += [("tools", "json", t.function.parameters) for t in req.tools or () if t.function.parameters]
    return found


def _check_schema(schema: Any, limits: ServeLimits, param: str) -> None:
    if isinstance(schema, str):  # its JSON text: measured as given, parsed (and its depth checked) below
        _at_most(len(schema), limits.max_schema_bytes, param, "characters of JSON schema", "--max-schema-bytes")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return  # not JSON: StructuredOutputs says so
    depth = json_depth(schema)
    _at_most(depth, limits.max_schema_depth, param, "levels of nesting in its JSON schema", "--max-schema-depth")
    size = len(json.dumps(schema))
    _at_most(size, limits.max_schema_bytes, param, "bytes of JSON schema", "--max-schema-bytes")


def _at_most(given: int, limit: int, param: str, what: str, option: str) -> None:
    if given > limit:
        raise APIError(
            400,
            f"{param} has {given} {what}; this server takes at most {limit}: send fewer, or start the server "
            f"with a higher {option}",
            param=param,
            code="limit_exceeded",
        )


def openapi_limits(schema: dict[str, Any], limits: ServeLimits) -> dict[str, Any]:
    """`schema` (the app's OpenAPI document) stating the limits JSON Schema can express; changed in place."""
    components = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatRequest"):
        fields = components[name]["properties"]
        _branch(fields["stop"], "array")["maxItems"] = limits.max_stop
        bias = _branch(fields["logit_bias"], "object")
        bias.update(maxProperties=limits.max_logit_bias, additionalProperties=False)  # keys: token ids only
        _branch(fields["guided_choice"], "array")["maxItems"] = limits.max_choices
        _branch(fields["guided_regex"], "string")["maxLength"] = limits.max_regex_length
        _branch(fields["guided_grammar"], "string")["maxLength"] = limits.max_grammar_length
        _branch(fields["guided_json"], "string")["maxLength"] = limits.max_schema_bytes
        fields["structured_outputs"]["anyOf"] = [structured_outputs_schema(limits), {"type": "null"}]
    return schema


def structured_outputs_schema(limits: ServeLimits) -> dict[str, Any]:
    """The JSON Schema of a request's `structured_outputs`: StructuredOutputs' fields, exactly one kind given."""
    kinds: dict[str, Any] = {
        "json": {"anyOf": [{"type": "object"}, {"type": "string", "maxLength": limits.max_schema_bytes}]},
        "json_object": {"type": "boolean"},
        "regex": {"type": "string", "minLength": 1, "maxLength": limits.max_regex_length},
        "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": limits.max_choices},
        "grammar": {"type": "string", "minLength": 1, "maxLength": limits.max_grammar_length},
    }
    given = [
        {
            "required": [kind],
            "properties": {kind: {"const": True} if kind == "json_object" else {"not": {"type": "null"}}},
        }
        for kind in kinds
    ]
    properties = {kind: {"anyOf": [schema, {"type": "null"}]} for kind, schema in kinds.items()}
    properties["backend"] = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]}
    return {"type": "object", "properties": properties, "additionalProperties": False, "oneOf": given}


def _branch(field: dict[str, Any], json_type: str) -> dict[str, Any]:
    """The member of a field's anyOf that is of `json_type`."""
    return next(member for member in field["anyOf"] if member.get("type") == json_type)
