"""`min-tokens`: EOS and the request's stop tokens are banned until min_tokens tokens are out."""

from __future__ import annotations

from typing import Sequence

import torch

from infer.api import LogitsRow, ProcessorContext, RegisterFn
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.plugins.logits_processor.token_masks import ban


class MinTokens:
    # the conformance kit's request (infer.testing.constraints): SamplingParams fields this admits
    kit_params = {"min_tokens": 6}

    def __init__(self, ctx: ProcessorContext) -> None:
        self.vocab_size = ctx.vocab_size

    def admit(self, request: Request) -> list[int] | None:
        params = request.params
        if params.min_tokens == 0:
            return None
        stops = {*params.stop_token_ids, *([] if params.ignore_eos else request.eos_token_ids)}
        return sorted(t for t in stops if t < self.vocab_size) or None

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        index: list[int] = []
        tokens: list[int] = []
        for row in rows:
            if len(row.request.output_token_ids) + len(row.draft) < row.request.params.min_tokens:
                index += [row.index] * len(row.state)
                tokens += row.state
        ban(logits, index, tokens)


@hookimpl
def infer_register_logits_processors(register: RegisterFn) -> None:
    register("min-tokens", MinTokens)
