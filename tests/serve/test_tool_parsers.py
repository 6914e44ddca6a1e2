"""Tool-call parsers on strings: content before a call, two calls, broken JSON left as content, and a
text streamed one character at a time equal to its whole-text parse."""

from __future__ import annotations

import json

import pytest

from infer.serve.tool_parsers import HermesParser, Llama3JsonParser, ToolParser
from infer.serve.tool_parsers.forced import NamedCall, RequiredCalls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET", "nested": {"a": [1, 2.5, "x\\"y"]}}}'


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def _streamed(parser: ToolParser, text: str, size: int = 1) -> tuple[str, list[tuple[str, str]], list[str]]:
    """The text fed `size` characters at a time: (content, [(name, arguments)], ids) joined from the pieces."""
    stream = parser.stream()
    content, names, args, ids = "", {}, {}, {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for n, piece in enumerate(pieces):
        out = stream.feed(piece, final=n == len(pieces) - 1)
        content += out.content
        for d in out.calls:
            if d.id is not None:
                assert d.index not in ids and d.arguments == "" and d.name
                ids[d.index], names[d.index], args[d.index] = d.id, d.name, ""
            else:
                assert d.index in ids, "arguments before the call's opening"
                args[d.index] += d.arguments
    order = sorted(ids)
    assert order == list(range(len(order)))
    return content, [(names[i], args[i]) for i in order], [ids[i] for i in order]


HERMES_TEXTS = [
    "Just an answer, no tools.",
    f"<tool_call>\n{WEATHER}\n</tool_call>",
    f"Let me check that.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
    f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    f"<tool_call>{WEATHER}",  # the closing tag cut off after a whole call
    "The tag <tool but not a call.",
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>{"arguments": {}, "id": 3}</tool_call>',  # JSON, but no name
]
LATE_BREAKS = [  # broken only after the call's name and arguments began
    (HermesParser(), f"<tool_call>{WEATHER} trailing</tool_call>"),
    (Llama3JsonParser(), WEATHER + " and more"),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": '),  # cut off
]


def test_hermes_content_before_a_call_and_two_calls():
    parser = HermesParser()
    none = parser.parse(HERMES_TEXTS[0])
    assert none.content == HERMES_TEXTS[0] and none.calls == []
    one = parser.parse(HERMES_TEXTS[2])
    assert one.content == "Let me check that."
    assert _calls(one) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert one.calls[0].id.startswith("call_") and len(one.calls[0].id) == 29
    two = parser.parse(HERMES_TEXTS[3])
    assert two.content is None
    assert [name for name, _ in _calls(two)] == ["get_weather", "get_time"]
    assert json.loads(two.calls[1].arguments)["nested"] == {"a": [1, 2.5, 'x"y']}
    assert len({c.id for c in two.calls}) == 2
    assert _calls(parser.parse(HERMES_TEXTS[4])) == [("get_weather", {"city": "Paris", "unit": "celsius"})]


@pytest.mark.parametrize("parser,text", [(HermesParser(), t) for t in HERMES_TEXTS[5:]] + LATE_BREAKS)
def test_broken_calls_are_content(parser, text):
    parsed = parser.parse(text)
    assert parsed.calls == [] and parsed.content == text


LLAMA_TEXTS = [
    WEATHER.replace('"arguments"', '"parameters"'),
    "<|python_tag|>" + WEATHER.replace('"arguments"', '"parameters"'),
    WEATHER.replace('"arguments"', '"parameters"') + "; " + TIME.replace('"arguments"', '"parameters"'),
    "Paris is sunny today.",
    '{"answer": 42}',  # JSON, not a call
]


def test_llama3_json_calls_and_content():
    parser = Llama3JsonParser()
    for text in LLAMA_TEXTS[:2]:
        parsed = parser.parse(text)
        assert parsed.content is None and _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert [name for name, _ in _calls(parser.parse(LLAMA_TEXTS[2]))] == ["get_weather", "get_time"]
    for text in LLAMA_TEXTS[3:]:
        parsed = parser.parse(text)
        assert parsed.calls == [] and parsed.content == text


def test_forced_calls():
    args = '{"city": "Paris"}'
    named = NamedCall("get_weather").parse(args)
    assert named.content is None and [(c.name, c.arguments) for c in named.calls] == [("get_weather", args)]
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    required = RequiredCalls().parse(text)
    assert required.content is None and _calls(required) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    cut = text[:30]
    assert RequiredCalls().parse(cut).calls == [] and RequiredCalls().parse(cut).content == cut


CASES = (
    [(HermesParser(), t) for t in HERMES_TEXTS]
    + [(Llama3JsonParser(), t) for t in LLAMA_TEXTS]
    + [(NamedCall("f"), '{"a": [1, {"b": "c"}]}')]
    + [(RequiredCalls(), '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {"y": "]"}}]')]
)


@pytest.mark.parametrize("parser,text", CASES)
@pytest.mark.parametrize("size", [1, 3, 10_000])
def test_streamed_pieces_join_to_the_whole_text_parse(parser, text, size):
    whole = parser.parse(text)
    content, calls, ids = _streamed(parser, text, size)
    assert (content or None) == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.calls]
    assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("parser,text", LATE_BREAKS)
def test_a_call_broken_after_it_began_streaming_is_followed_by_its_text_as_content(parser, text):
    content, calls, _ = _streamed(parser, text)
    assert calls and calls[0][0] == "get_weather"  # sent before the text broke: a stream cannot take it back
    assert content == parser.parse(text).content == text


def test_arguments_stream_as_they_are_written():
    stream = HermesParser().stream()
    opening = stream.feed('Sure. <tool_call>{"name": "get_weather", "argu')
    assert opening.content == "Sure." and opening.calls == []
    named = stream.feed('ments": {"ci')
    assert [(d.name, d.arguments) for d in named.calls] == [("get_weather", ""), (None, '{"ci')]
    more = stream.feed('ty": "Par')
    assert [(d.index, d.arguments) for d in more.calls] == [(0, 'ty": "Par')]
    end = stream.feed('is"}}</tool_call>', final=True)
    assert [d.arguments for d in end.calls] == ['is"}'] and end.content == ""
