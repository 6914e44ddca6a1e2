"""`example-labels`: a reasoning parser for models that write "Reasoning: ..." then "Answer: ...".

A text that starts with the label `Reasoning:` reasons until a line that starts with `Answer:`, and
answers after it; any other text is all answer. Written only against `infer.api.reasoning`: `scan`
settles what no later text can change (a label still being written is held back), so the server's
streamed split equals the whole one (`pytest --infer-kit reasoning_parser=example-labels` checks it).
"""

from __future__ import annotations

from typing import Any

import infer
from infer.api.reasoning import ReasoningSplit

INFER_PLUGIN_API = ">=2.1,<3"  # 2.1 added the reasoning_parser slot
REASONING, ANSWER = "Reasoning:", "\nAnswer:"


def _held(text: str, label: str) -> int:
    """Characters at the end of `text` that could still become `label`."""
    return next((n for n in range(min(len(label) - 1, len(text)), 0, -1) if label.startswith(text[-n:])), 0)


class LabelsReasoning:
    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def scan(self, text: str, final: bool) -> ReasoningSplit:
        if not text.startswith(REASONING):
            if not final and REASONING.startswith(text):
                return ReasoningSplit("", "")  # may still become the label
            return ReasoningSplit("", text)
        body = text[len(REASONING) :]
        end = body.find(ANSWER)
        if end >= 0:
            return ReasoningSplit(body[:end], body[end + len(ANSWER) :].lstrip(" "))
        return ReasoningSplit(body if final else body[: len(body) - _held(body, ANSWER)], "")


@infer.hookimpl
def infer_register_reasoning_parsers(register) -> None:
    register("example-labels", LabelsReasoning)
