"""One call written as a JSON object, `{"name": ..., "arguments": {...}}`, read as far as it is written.

Its arguments are the model's own text of the value, sliced out of the output (so a stream sends
them as they are generated, and the pieces join to exactly the whole text's arguments); they stream
when the name comes first and the arguments are an object, as every tool-call format writes them.
Otherwise the call is reported once its object is whole, its arguments re-encoded. Whether a
partial text can still become JSON is `partial-json-parser`'s answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from infer.serve.tool_parsers.base import PartialCall

ARGUMENT_KEYS = ("arguments", "parameters")  # OpenAI's and Hermes' name, Llama 3's
# the opening of a call whose name comes first: the name (a JSON string), then the arguments' key
NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
DECODER = json.JSONDecoder()


@dataclass(slots=True)
class CallObject:
    """The call object at a position of a text, as far as the text goes."""

    call: PartialCall | None  # None: no name yet (or broken)
    end: int | None  # where the object ends, when it is whole
    broken: bool = False  # the text there is no call object, and more text cannot make it one


def read_call(text: str, pos: int) -> CallObject:
    """The call object starting at text[pos] ("{")."""
    try:
        obj, end = DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return _partial(text, pos)
    except RecursionError:  # nested past the parser's depth: no call
        return CallObject(None, None, broken=True)
    call = _call(obj, text, pos)
    return CallObject(call, end, broken=call is None)


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _partial(text: str, pos: int) -> CallObject:
    if not _may_become_json(text[pos:]):
        return CallObject(None, None, broken=True)
    opening = NAME_FIRST.match(text, pos)
    if opening is None:
        return CallObject(None, None)  # no name yet: wait for it
    start = opening.end()
    if start < len(text) and text[start] != "{":
        return CallObject(None, None)  # arguments that are not an object: wait for the object's end
    return CallObject(PartialCall(json.loads(opening.group(1)), text[start : _value_end(text, start)], False), None)


def _value_end(text: str, start: int) -> int:
    """Where the value at `start` ends: its end if it is whole, else the text's."""
    try:
        return DECODER.raw_decode(text, start)[1]
    except json.JSONDecodeError:
        return len(text)


def _call(obj: object, text: str, pos: int) -> PartialCall | None:
    """A whole object as a call: a string name and object (or JSON text) arguments; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in ARGUMENT_KEYS if k in obj), None)
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):  # some models write the arguments as a JSON text
        return PartialCall(obj["name"], args, True) if _is_json(args) else None
    if not isinstance(args, dict):
        return None
    opening = NAME_FIRST.match(text, pos)
    if opening is not None and text.startswith("{", opening.end()):  # as it streamed: the model's own text
        return PartialCall(obj["name"], text[opening.end() : _value_end(text, opening.end())], True)
    return PartialCall(obj["name"], json.dumps(args, ensure_ascii=False), True)


def _may_become_json(text: str) -> bool:
    from partial_json_parser import MalformedJSON, PartialJSON, fix

    try:
        fix(text)
    except PartialJSON:
        return True
    except (MalformedJSON, RecursionError):
        return False
    return True


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
