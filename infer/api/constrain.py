"""The engine's side of the logits processors: admitting a request, constraining a step's rows."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infer.api import AheadProcessor, AheadRow, LogitsProcessor, LogitsRow, ServingProcessor
from infer.api.errors import RequestError
from infer.api.request import Request


def admit(processors: Sequence[LogitsProcessor], request: Request) -> tuple[tuple[Any, Any], ...]:
    """The processors that serve `request`, each with its state (a RequestError if one cannot)."""
    found = tuple((p, state) for p in processors if (state := p.admit(request)) is not None)
    spec = request.params.structured
    if spec is not None and not any(isinstance(p, ServingProcessor) and "structured" in p.serves for p, _ in found):
        backend = spec.backend or "xgrammar"
        raise RequestError(
            f"structured output backend {backend!r} is not available: leave backend unset for xgrammar "
            "(pip install xgrammar), or install the plugin that provides it (`infer plugins` lists them)"
        )
    if found and not request.params.tokens_are_final:
        names = ", ".join(type(p).__name__ for p, _ in found)
        raise RequestError(
            f"beam search takes no logits processors or constraints ({names}): drop use_beam_search, or the constraint"
        )
    return found


@torch.inference_mode()  # the logits are inference tensors (a CUDA graph's output, ...)
def constrain(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None = None) -> None:
    """Apply each admitted processor, in place, to its rows: row i is `requests[i]`'s next token
    after `drafts[i]` (speculative positions; None: no drafts). Rows of requests without
    constraints are left alone. Runs in inference mode: the logits come from a forward run in it,
    and an in-place write to such a tensor outside it is an error."""
    batches: dict[int, tuple[LogitsProcessor, list[LogitsRow]]] = {}
    for i, r in enumerate(requests):
        for processor, state in r.constraints:
            row = LogitsRow(i, r, state, drafts[i] if drafts is not None else ())
            batches.setdefault(id(processor), (processor, []))[1].append(row)
    with torch.inference_mode():
        for processor, rows in batches.values():
            processor.apply(logits, rows)


def constrain_ahead(requests: Sequence[Request], tokens: Sequence[Sequence[int]]) -> None:
    """`requests[i]` got `tokens[i]` this step (on the host now, not yet appended): hand them to each
    admitted `AheadProcessor`, which starts the next step's host work for them (the masks) at once."""
    batches: dict[int, tuple[AheadProcessor, list[AheadRow]]] = {}
    takes: dict[int, bool] = {}  # a protocol's isinstance is slow: once per processor
    for r, new in zip(requests, tokens):
        for processor, state in r.constraints if new else ():
            key = id(processor)
            if key not in takes:
                takes[key] = isinstance(processor, AheadProcessor)
            if takes[key]:
                batches.setdefault(key, (processor, []))[1].append(AheadRow(r, state, new))
    for processor, rows in batches.values():
        processor.ahead(rows)


def is_constrained(requests: Sequence[Request]) -> bool:
    return any(r.constraints for r in requests)
