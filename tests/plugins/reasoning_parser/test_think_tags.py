"""The built-in reasoning parsers against hand-written splits, and the kit's check, which must catch a
parser whose stream disagrees with its whole split."""

from __future__ import annotations

import pytest

from infer.api.reasoning import ReasoningSplit, ReasoningStream, split
from infer.plugins.reasoning_parser.think_tags import DeepSeekR1Reasoning, Qwen3Reasoning
from infer.testing.reasoning import check_stream_equals_whole


@pytest.mark.parametrize(
    "text,qwen3,deepseek",
    [
        ("<think>\nplan\n</think>\n\nThe answer.", ("\nplan\n", "The answer."), ("\nplan\n", "The answer.")),
        ("The answer.", (None, "The answer."), ("The answer.", None)),  # deepseek-r1: never closed, all reasoning
        ("plan</think>answer", (None, "plan</think>answer"), ("plan", "answer")),  # its template opened <think>
        ("<think>unfinished", ("unfinished", None), ("unfinished", None)),
        ("<think></think>", (None, None), (None, None)),
        ("", (None, None), (None, None)),
    ],
)
def test_whole_splits(text, qwen3, deepseek):
    assert split(Qwen3Reasoning(), text) == qwen3
    assert split(DeepSeekR1Reasoning(), text) == deepseek


def test_a_tag_cut_across_pieces_is_held_back_until_it_settles():
    stream = ReasoningStream(Qwen3Reasoning())
    assert stream.feed("<thi") == ReasoningSplit("", "")
    assert stream.feed("nk>a</th") == ReasoningSplit("a", "")
    assert stream.feed("ink>\n\nb") == ReasoningSplit("", "b")
    assert stream.feed("", final=True) == ReasoningSplit("", "")


class Eager:
    """Wrong on purpose: settles the reasoning without holding back a half-written closing tag."""

    def __init__(self, tokenizer=None) -> None:
        pass

    def scan(self, text: str, final: bool) -> ReasoningSplit:
        if not text.startswith("<think>"):
            return ReasoningSplit("", text)
        body = text[len("<think>") :]
        end = body.find("</think>")
        return ReasoningSplit(body if end < 0 else body[:end], "" if end < 0 else body[end + 8 :])


def test_the_kit_check_catches_a_parser_that_streams_differently():
    with pytest.raises((AssertionError, ValueError)):
        check_stream_equals_whole(Eager)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("factory", [Qwen3Reasoning, DeepSeekR1Reasoning])
def test_the_built_in_parsers_pass_the_kit_check(factory):
    check_stream_equals_whole(factory)
