"""The sampler: one step's logits to tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from infer.core.request import Request


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # row i -> sampled token
    logprobs: list[dict[int, float]] | None = None  # row i -> {token: logprob}, when asked for


class Sampler(Protocol):
    """Turns one step's logits into tokens. Called once per step with the rows to sample.

    Row i belongs to `requests[i]`; `positions[i]` is the index of the output token being sampled
    (so seeded sampling does not depend on which other requests share the batch).
    """

    def sample(
        self,
        logits: torch.Tensor,  # [B, vocab] float32
        requests: list["Request"],
        positions: list[int] | None = None,
    ) -> SamplerOutput: ...

    # Optional, lets the runner pipeline decode steps (launch step N+1 before step N's tokens reach
    # the host): sample_tokens(logits, requests, positions) -> [B] int64 tensor on the device, the
    # tokens `sample` would return, queued without a host sync; or None for a batch it cannot serve.
    # Optional, needed by speculative decoding to verify draft tokens:
    # probs(logits [B, V], requests, positions) -> [B, V]: the distribution `sample` draws row i
    #   from (penalties, temperature, min-p, top-k, top-p applied; one-hot at the argmax when greedy)
    # logprobs(logits [B, V], requests, token_ids) -> list[dict]: what `sample` reports for row i
    #   had it chosen token_ids[i] ({} where the request did not ask)
