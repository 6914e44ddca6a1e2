"""The reasoning-parser kit's checks: for texts made of the pieces reasoning models write (the think
tags, parts of them, words, blank lines) and every way of cutting them into stream pieces, the
streamed split joined equals the whole text's split (`infer.api.reasoning.ReasoningStream`), and a
scan only extends an earlier one."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from infer.api.reasoning import ReasoningStream, split

PIECES = ["<think>", "</think>", "<", "</", "<th", "think>", ">", "\n", "\n\n", " ", "a", "b c", "é", "x</thin", "k>"]
texts = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)


@st.composite
def chunked(draw: Any) -> tuple[str, list[str]]:
    """A text and one cutting of it into pieces (at any character, empty pieces included)."""
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


def check_stream_equals_whole(factory: Any) -> None:
    parser = factory(None)

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(case=chunked())
    def check(case: tuple[str, list[str]]) -> None:
        text, pieces = case
        stream = ReasoningStream(parser)  # raises if a scan takes back what an earlier one settled
        reasoning, content = "", ""
        for i, piece in enumerate(pieces):
            added = stream.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + added.reasoning, content + added.content
        whole = split(parser, text)
        assert (reasoning or None, content or None) == whole, (text, pieces)

    check()


def check_plain_text_passes(factory: Any) -> None:
    """A text with no tag at all comes back whole, as the reasoning or as the content."""
    parser = factory(None)
    reasoning, content = split(parser, "Just an answer.\n")
    assert (reasoning or "") + (content or "") == "Just an answer.\n"
