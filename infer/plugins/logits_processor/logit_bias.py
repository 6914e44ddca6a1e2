"""`logit-bias`: OpenAI's logit_bias, a number added to chosen tokens' logits (-100 bans, 100 forces)."""

from __future__ import annotations

from typing import Sequence

import torch

from infer.api import LogitsRow, ProcessorContext, RegisterFn
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.api.transfer import to_device
from infer.plugins.logits_processor.token_masks import check_ids


class LogitBias:
    # the conformance kit's request (infer.testing.constraints): SamplingParams fields this admits
    kit_params = {"logit_bias": {70: 5.0, 72: -100.0, 102: 3.0}}

    def __init__(self, ctx: ProcessorContext) -> None:
        self.vocab_size = ctx.vocab_size

    def admit(self, request: Request) -> tuple[list[int], list[float]] | None:
        bias = request.params.logit_bias
        if not bias:
            return None
        check_ids("logit_bias", list(bias), self.vocab_size)
        return list(bias), [float(b) for b in bias.values()]

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        index: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for row in rows:
            ids, biases = row.state
            index += [row.index] * len(ids)
            tokens += ids
            values += biases
        at = to_device(index + tokens, torch.int64, logits.device).view(2, -1)
        logits.index_put_((at[0], at[1]), to_device(values, logits.dtype, logits.device), accumulate=True)


@hookimpl
def infer_register_logits_processors(register: RegisterFn) -> None:
    register("logit-bias", LogitBias)
