"""`allowed-tokens`: only the request's allowed_token_ids are generated."""

from __future__ import annotations

from typing import Sequence

import torch

from infer.api import LogitsRow, ProcessorContext, RegisterFn
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.api.transfer import to_device
from infer.plugins.logits_processor.token_masks import check_ids


class AllowedTokens:
    # the conformance kit's request (infer.testing.constraints): SamplingParams fields this admits
    kit_params = {"allowed_token_ids": [0, 35, 70, 71, 72, 100, 117]}

    def __init__(self, ctx: ProcessorContext) -> None:
        self.vocab_size = ctx.vocab_size

    def admit(self, request: Request) -> list[int] | None:
        allowed = request.params.allowed_token_ids
        if allowed is None:
            return None
        check_ids("allowed_token_ids", allowed, self.vocab_size)
        return sorted(set(allowed))

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        banned = torch.ones(len(rows), logits.shape[1], dtype=torch.bool)
        for i, row in enumerate(rows):
            banned[i, row.state] = False
        index = to_device([row.index for row in rows], torch.int64, logits.device)
        banned = banned.pin_memory().to(logits.device, non_blocking=True) if logits.is_cuda else banned
        logits[index] = logits[index].masked_fill_(banned, float("-inf"))


@hookimpl
def infer_register_logits_processors(register: RegisterFn) -> None:
    register("allowed-tokens", AllowedTokens)
