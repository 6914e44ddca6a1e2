"""`tokenizer-vocab`: with `--tokenizer` naming a tokenizer smaller than the model's vocabulary (a
model's shape run with another model's tokenizer), the ids past the tokenizer are masked for every
request: they are no text."""

from __future__ import annotations

from typing import Sequence

import torch

from infer.api import LogitsRow, ProcessorContext, RegisterFn
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.api.transfer import row_index


class TokenizerVocab:
    def __init__(self, ctx: ProcessorContext) -> None:
        chosen = ctx.config is not None and ctx.config.tokenizer is not None
        size = len(ctx.tokenizer) if chosen and ctx.tokenizer is not None else ctx.vocab_size
        self.size = size if size < ctx.vocab_size else None  # None: nothing to mask

    def admit(self, request: Request) -> bool | None:
        return True if self.size is not None else None

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        # it admits every request: the index is a plain slice, with nothing to copy, in the usual step
        logits[row_index([row.index for row in rows], logits.shape[0], logits.device), self.size :] = float("-inf")


@hookimpl
def infer_register_logits_processors(register: RegisterFn) -> None:
    register("tokenizer-vocab", TokenizerVocab)
