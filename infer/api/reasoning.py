"""The reasoning parser: a chat's output text split into the model's reasoning and its answer.

Models that think before they answer (Qwen3, DeepSeek-R1, ...) write their reasoning between tags in
the same text as the answer. A parser says one thing, `scan(text, final)`: the reasoning and the
content of `text` as far as they are settled, so that a longer text's scan only extends a shorter
one's (each field of `scan(a + b)` starts with the same field of `scan(a)`); with `final`, the text
is whole and nothing is held back. The server splits a whole answer with one final scan and a stream
by scanning its growing text and sending what each scan adds (`ReasoningStream`), so the streamed
pieces, joined, equal the whole answer's split for every chunking of the same text: the kit checks it
(`pytest --infer-kit reasoning_parser=NAME`). The content then goes to the tool-call parser.

A factory is `factory(tokenizer)` (the model's, or None), called once per served model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    reasoning: str  # the reasoning so far ("" none)
    content: str  # the answer so far ("" none)


class ReasoningParser(Protocol):
    def scan(self, text: str, final: bool) -> ReasoningSplit:
        """What `text` holds as far as it is settled; prefix-stable as the text grows (see the module)."""
        ...


def split(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole text's (reasoning, content), each None when empty."""
    whole = parser.scan(text, final=True)
    return whole.reasoning or None, whole.content or None


class ReasoningStream:
    """A growing text's reasoning and content, as pieces: `feed` each piece of the text (`final` with
    the last) and get what it added to each."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ReasoningSplit("", "")

    def feed(self, piece: str, final: bool = False) -> ReasoningSplit:
        self.text += piece
        now = self.parser.scan(self.text, final)
        if not (now.reasoning.startswith(self.sent.reasoning) and now.content.startswith(self.sent.content)):
            raise ValueError(
                f"reasoning parser {type(self.parser).__name__}: its scan of a longer text does not extend the "
                "shorter one's (a scan must only add to what it settled)"
            )
        added = ReasoningSplit(now.reasoning[len(self.sent.reasoning) :], now.content[len(self.sent.content) :])
        self.sent = now
        return added
