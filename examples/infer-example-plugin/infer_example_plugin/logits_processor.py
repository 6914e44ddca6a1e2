"""`example-choice`: structured output that is one of a list of strings, by token prefixes.

A request asks for it by naming it as its structured-output backend:
`SamplingParams(structured={"choice": ["yes", "no"], "backend": "example-choice"})`. Each choice is
tokenized once (as the tokenizer spells it alone); at every step only the tokens that continue some
choice's tokens are allowed, plus EOS once the output is a whole choice (and only EOS once nothing
continues one). Simpler than a grammar engine: a choice spelt with other tokens than the
tokenizer's own spelling of it is never generated. Stateless: a row depends only on the request's
output and draft tokens, so speculative drafts and output it has not seen need nothing more.
`pytest --infer-kit logits_processor=example-choice` checks it.
"""

from __future__ import annotations

from typing import Sequence

import torch

import infer
from infer.api import LogitsRow, ProcessorContext
from infer.api.errors import RequestError
from infer.api.request import Request

INFER_PLUGIN_API = ">=2,<3"
NAME = "example-choice"


class ChoiceProcessor:
    serves = ("structured",)  # it answers for SamplingParams.structured (those naming it as backend)
    kit_params = {"structured": {"choice": ["hello", "yes", "no"], "backend": NAME}}  # for the kit

    def __init__(self, ctx: ProcessorContext) -> None:
        self.ctx = ctx

    def admit(self, request: Request) -> list[tuple[int, ...]] | None:
        spec = request.params.structured
        if spec is None or spec.backend != NAME:
            return None
        if spec.choice is None:
            raise RequestError(f"invalid structured: backend {NAME} serves choice only, not {spec.kind}: drop backend")
        if self.ctx.tokenizer is None:
            raise RequestError(f"structured backend {NAME} needs the model's tokenizer, and this model has none")
        choices = [tuple(self.ctx.tokenizer.encode(choice, add_special_tokens=False)) for choice in spec.choice]
        for choice, ids in zip(spec.choice, choices):
            if any(i >= self.ctx.vocab_size for i in ids):
                raise RequestError(f"invalid structured.choice {choice!r}: it has tokens the model cannot generate")
        return choices

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        for row in rows:
            out = (*row.request.output_token_ids, *row.draft)
            allowed = {ids[len(out)] for ids in row.state if len(ids) > len(out) and ids[: len(out)] == out}
            if out in row.state or not allowed:  # a whole choice is out (or the output left them all): EOS
                allowed |= self.ctx.eos_token_ids
            if not allowed:  # a model without EOS: nothing to end with, the row stays as it is
                continue
            keep = torch.tensor(sorted(allowed), dtype=torch.long, device=logits.device)
            kept = logits[row.index, keep]
            logits[row.index] = float("-inf")
            logits[row.index, keep] = kept


@infer.hookimpl
def infer_register_logits_processors(register) -> None:
    register(NAME, ChoiceProcessor)
