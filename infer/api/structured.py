"""Structured output: what a request's text must match. Field names follow vLLM's `StructuredOutputsParams`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from infer.api.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputs:
    """Exactly one of the constraints; the output is generated so that it matches.

    json: a JSON schema (a dict, or its JSON text): the output is a JSON document valid against it.
    json_object: True: the output is any JSON object.
    regex: the output matches this regular expression, whole.
    choice: the output is one of these strings.
    grammar: the output derives from this EBNF grammar (GBNF, as xgrammar and llama.cpp read it;
      the start rule is `root`).
    backend: the logits processor to serve it (None: the built-in `xgrammar`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputs | None":
        """A StructuredOutputs from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in fields(cls)})
            if unknown:
                raise RequestError(
                    f"invalid structured: unknown field(s) {', '.join(unknown)}: use one of {', '.join(KINDS)}"
                )
            return cls(**value)
        raise RequestError(
            f"invalid structured={value!r}: use StructuredOutputs(...) or a dict such as {{'json': schema}}"
        )

    def _kinds(self) -> tuple[tuple[str, Any], ...]:
        """(kind, value) of each constraint, in `KINDS` order."""
        return (
            ("json", self.json),
            ("json_object", self.json_object),
            ("regex", self.regex),
            ("choice", self.choice),
            ("grammar", self.grammar),
        )

    @property
    def kind(self) -> str:
        return next(k for k, value in self._kinds() if value not in (None, False))

    def schema(self) -> str | None:
        """The JSON schema's text (json), else None."""
        if self.json is None:
            return None
        return self.json if isinstance(self.json, str) else json.dumps(self.json)

    def validate(self) -> None:
        given = [k for k, value in self._kinds() if value not in (None, False)]
        if len(given) != 1:
            what = f"{len(given)} ({', '.join(given)})" if given else "none"
            raise RequestError(f"invalid structured: give exactly one of {', '.join(KINDS)}, not {what}")
        if self.json is not None:
            _check_schema(self.json)
        if not isinstance(self.json_object, bool):
            raise RequestError(f"invalid structured.json_object={self.json_object!r}: use True or False")
        for name, value in (("regex", self.regex), ("grammar", self.grammar), ("backend", self.backend)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise RequestError(f"invalid structured.{name}={value!r}: use a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise RequestError(f"invalid structured.choice={self.choice!r}: use a non-empty list of strings")


def _check_schema(schema: Any) -> None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise RequestError(f"invalid structured.json: not JSON ({exc}): give a JSON schema") from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"invalid structured.json={schema!r}: a JSON schema is an object (a dict)")
    ref = _outside_ref(schema)
    if ref is not None:
        raise RequestError(
            f"invalid structured.json: $ref {ref!r} points outside the schema, and nothing is fetched: "
            "inline it under $defs and refer to it as '#/$defs/NAME'"
        )


def _outside_ref(schema: Any) -> str | None:
    """The first `$ref` not into the schema itself (not '#...'); values (const, enum, default, examples) skipped."""
    stack = [schema]
    while stack:  # not recursive: a deep schema cannot overflow the stack
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(v for k, v in node.items() if k not in ("const", "enum", "default", "examples"))
    return None
