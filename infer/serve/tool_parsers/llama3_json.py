"""`llama3_json`: Llama 3.1's JSON calls, `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`.

The text is calls only when it starts with one (after whitespace and the tag); any other text is
content, as is a text whose calls turn out broken (not JSON, no name, other text between them).
"""

from __future__ import annotations

from infer.serve.tool_parsers.base import PartialCall, Scan, ToolParser
from infer.serve.tool_parsers.json_calls import read_call, skip_space

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        at = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, at):
            at = skip_space(text, at + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[at:]):
            return Scan("", [])  # nothing, or the tag's start: not known yet
        if at == len(text) and not final:
            return Scan("", [])
        if not text.startswith("{", at):
            return Scan(text, [])  # plain text
        return read_calls(text, at, SEPARATOR, None, final)


def read_calls(text: str, at: int, separator: str, end: str | None, final: bool) -> Scan:
    """Call objects from text[at] ("{"), `separator` between them and `end` after the last (None:
    the text's end); a text that is not that is content."""
    calls: list[PartialCall] = []
    while True:
        found = read_call(text, at)
        if found.broken or (final and found.end is None):
            return Scan(text, [])
        if found.call is not None:
            calls.append(found.call)
        if found.end is None:
            return Scan("", calls)
        at = skip_space(text, found.end)
        if at == len(text):
            return Scan("", calls) if end is None or not final else Scan(text, [])
        if end is not None and text.startswith(end, at):
            return Scan("", calls) if skip_space(text, at + len(end)) == len(text) else Scan(text, [])
        if not text.startswith(separator, at):
            return Scan(text, [])
        at = skip_space(text, at + len(separator))
        if at == len(text):
            return Scan("", calls) if not final or end is None else Scan(text, [])
        if not text.startswith("{", at):
            return Scan(text, [])
