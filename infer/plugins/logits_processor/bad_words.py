"""`bad-words`: words never generated. A word is banned as the tokenizer spells it alone and after a
space; a word of one token is banned everywhere, one of several has its last token banned
wherever the output so far ends with the tokens before it (vLLM's rule)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infer.api import LogitsRow, ProcessorContext, RegisterFn
from infer.api.errors import RequestError
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.plugins.logits_processor.token_masks import ban


class BadWords:
    # the conformance kit's request (infer.testing.constraints): SamplingParams fields this admits
    kit_params = {"bad_words": ["hello", "world"]}  # one token; several

    def __init__(self, ctx: ProcessorContext) -> None:
        self.tokenizer: Any = ctx.tokenizer
        self.vocab_size = ctx.vocab_size

    def admit(self, request: Request) -> list[list[int]] | None:
        words = request.params.bad_words
        if not words:
            return None
        if self.tokenizer is None:
            raise RequestError("bad_words needs the model's tokenizer, and this model has none: use logit_bias")
        found: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in found and all(t < self.vocab_size for t in ids):
                    found.append(ids)
        return found or None

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        index: list[int] = []
        tokens: list[int] = []
        for row in rows:
            out = [*row.request.output_token_ids, *row.draft]
            for ids in row.state:
                prefix = ids[:-1]
                if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix):
                    index.append(row.index)
                    tokens.append(ids[-1])
        ban(logits, index, tokens)


@hookimpl
def infer_register_logits_processors(register: RegisterFn) -> None:
    register("bad-words", BadWords)
