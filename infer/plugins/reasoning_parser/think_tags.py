"""`qwen3` and `deepseek-r1`: the reasoning between `<think>` and `</think>`, the answer after.

`qwen3`: a text that starts with `<think>` reasons until `</think>`; any other text is all answer
(Qwen3 with `enable_thinking: false` writes no reasoning, its template closing an empty block in the
prompt). `deepseek-r1`: the text reasons from its start (its template opens `<think>` in the prompt;
a `<think>` the model writes itself is dropped) until `</think>`; a text that never closes it is all
reasoning. The answer's leading whitespace after `</think>` is dropped (the models put a blank line
there). While the text could still turn into a tag, that part is held back, so a scan only extends an
earlier one (`infer.api.reasoning`).
"""

from __future__ import annotations

from typing import Any

from infer.api.hookspecs import hookimpl
from infer.api.reasoning import ReasoningSplit

OPEN, CLOSE = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until they settle)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkTags:
    opens_in_prompt = False  # deepseek-r1: the reasoning starts at the text's start

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def scan(self, text: str, final: bool) -> ReasoningSplit:
        if not final and len(text) < len(OPEN) and OPEN.startswith(text):
            return ReasoningSplit("", "")  # may still become the opening tag
        if text.startswith(OPEN):
            body = text[len(OPEN) :]
        elif self.opens_in_prompt:
            body = text
        else:
            return ReasoningSplit("", text)  # no reasoning: all answer
        end = body.find(CLOSE)
        if end < 0:
            if final:
                return ReasoningSplit(body, "")  # never closed: all reasoning
            return ReasoningSplit(body[: len(body) - _held(body, CLOSE)], "")
        return ReasoningSplit(body[:end], body[end + len(CLOSE) :].lstrip())


class Qwen3Reasoning(ThinkTags):
    pass


class DeepSeekR1Reasoning(ThinkTags):
    opens_in_prompt = True


@hookimpl
def infer_register_reasoning_parsers(register) -> None:
    register("qwen3", Qwen3Reasoning)
    register("deepseek-r1", DeepSeekR1Reasoning)
