"""What a tool-call parser reads out of a chat's text, whole or as it grows.

A parser says one thing: `scan(text, final)`, the content and the calls in `text` as far as they are
settled (a call's name once it is whole, its arguments as far as they are written). A whole text
is parsed by one final scan; a stream scans its growing text after each piece and sends what the
scan adds to what it sent before. So the streamed pieces, joined, are the whole text's parse (for
every text whose calls are well formed: a call found broken after its first piece went out cannot
be taken back, and its text follows as content).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(slots=True)
class PartialCall:
    """One call as far as the text goes."""

    name: str  # the function's name (a call is reported only once its name is whole)
    arguments: str  # its arguments' JSON text so far (whole when `complete`)
    complete: bool  # the call's text has ended


@dataclass(slots=True)
class Scan:
    """What a text holds, as far as it is settled."""

    content: str  # the text that is not a call (final: all of it; else what no later text can change)
    calls: list[PartialCall]  # in order; only the last may be incomplete


@dataclass(slots=True)
class ToolCall:
    """One call, as the chat API reports it."""

    id: str  # "call_" and 24 hex digits
    name: str  # the function's name
    arguments: str  # the arguments, a JSON text


@dataclass(slots=True)
class ParsedToolCalls:
    """A whole text: its content (None when it is empty) and its calls."""

    content: str | None  # the text before the calls, or all of it when there are none
    calls: list[ToolCall]


@dataclass(slots=True)
class CallDelta:
    """A piece of one call in a stream: its opening (id and name set, no arguments) or more arguments."""

    index: int  # which call of the choice
    arguments: str  # more of its arguments' text ("" in the opening)
    id: str | None = None  # set in the opening only
    name: str | None = None  # set in the opening only


@dataclass(slots=True)
class StreamPiece:
    """What one more piece of text adds: content first, then call pieces."""

    content: str
    calls: list[CallDelta]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """A format of tool calls in text. Subclasses define `scan`; `parse` and `stream` follow from it."""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedToolCalls:
        found = self.scan(text, final=True)
        calls = [ToolCall(new_call_id(), c.name, c.arguments) for c in found.calls]
        return ParsedToolCalls(found.content or None, calls)

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


@dataclass(slots=True)
class _Sent:
    name: str
    arguments: str  # the arguments' text sent so far


@dataclass(slots=True)
class ToolCallStream:
    """One choice's text as it grows: `feed` each new piece, `feed(piece, final=True)` the last."""

    parser: ToolParser
    text: str = ""  # all the text so far
    content: str = ""  # the content sent so far
    calls: list[_Sent] = field(default_factory=list)  # the calls opened so far
    ids: list[str] = field(default_factory=list)  # their ids, in order

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, piece: str, final: bool = False) -> StreamPiece:
        self.text += piece
        found = self.parser.scan(self.text, final)
        content = ""
        if found.content.startswith(self.content):  # else it is not what was sent: nothing more is
            content = found.content[len(self.content) :]
            self.content = found.content
        deltas: list[CallDelta] = []
        for i, call in enumerate(found.calls):
            if i == len(self.calls):
                self.calls.append(_Sent(call.name, ""))
                self.ids.append(new_call_id())
                deltas.append(CallDelta(i, "", self.ids[i], call.name))
            sent = self.calls[i]
            if sent.name != call.name or not call.arguments.startswith(sent.arguments):
                break  # not what was sent: nothing more can follow it
            if len(call.arguments) > len(sent.arguments):
                deltas.append(CallDelta(i, call.arguments[len(sent.arguments) :]))
                sent.arguments = call.arguments
        return StreamPiece(content, deltas)
