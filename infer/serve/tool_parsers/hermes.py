"""`hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after any content.

Hermes 2 Pro's format, and Qwen 2.5's and Qwen 3's. The content is the text before the first call
(its trailing whitespace dropped); text after the last call is not content. A call block that is
no call object (broken JSON, no name) makes the whole text content, as if there were no calls.
"""

from __future__ import annotations

from infer.serve.tool_parsers.base import PartialCall, Scan, ToolParser
from infer.serve.tool_parsers.json_calls import read_call, skip_space

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(OPEN)
        if first < 0:
            return Scan(text if final else settled(text, OPEN), [])
        calls: list[PartialCall] = []
        at = first
        while at >= 0:
            body = skip_space(text, at + len(OPEN))
            if body == len(text) and not final:
                break  # the call has not started
            if not text.startswith("{", body):
                return _broken(text, final)
            found = read_call(text, body)
            if found.broken or (final and found.end is None):
                return _broken(text, final)
            if found.call is not None:
                calls.append(found.call)
            if found.end is None:
                break
            after = skip_space(text, found.end)
            if text.startswith(CLOSE, after):
                after += len(CLOSE)
            elif not CLOSE.startswith(text[after:]):  # neither the closing tag nor the text's end
                return _broken(text, final)
            at = text.find(OPEN, after)
        return Scan(text[:first].rstrip(), calls)


def settled(text: str, tag: str) -> str:
    """The content no later text can change: without trailing whitespace (it would go if a call
    followed) nor a trailing start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            text = text[:-size]
            break
    return text.rstrip()


def _broken(text: str, final: bool) -> Scan:
    return Scan(text if final else text.rstrip(), [])
