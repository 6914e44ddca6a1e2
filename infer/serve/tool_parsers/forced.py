"""The calls a chat's `tool_choice` forces on the output (the output is constrained to match):

- a named function: the whole text is that function's arguments;
- "required": a JSON array of one or more `{"name": ..., "parameters": {...}}`.
"""

from __future__ import annotations

from infer.serve.tool_parsers.base import PartialCall, Scan, ToolParser
from infer.serve.tool_parsers.json_calls import skip_space
from infer.serve.tool_parsers.llama3_json import read_calls


class NamedCall(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [PartialCall(self.name, text, final)])


class RequiredCalls(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        at = skip_space(text, 0)
        if at == len(text) and not final:
            return Scan("", [])
        if not text.startswith("[", at):
            return Scan(text, [])  # not an array (the output was cut short, or not constrained): content
        at = skip_space(text, at + 1)
        if at == len(text) and not final:
            return Scan("", [])
        if not text.startswith("{", at):
            return Scan(text, [])
        return read_calls(text, at, ",", "]", final)
