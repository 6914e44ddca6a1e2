"""The sampler: one step's logits to tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from infer.api.request import Request


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # row i -> sampled token
    logprobs: list[dict[int, float]] | None = None  # row i -> {token: logprob}, when asked for


class Sampler(Protocol):
    """Turns one step's logits into tokens. Called once per step with the rows to sample.

    Row i belongs to `requests[i]`; `positions[i]` is the index of the output token being sampled
    (so seeded sampling does not depend on which other requests share the batch).
    Optional abilities: `TokenSampler.sample_tokens`, for decode pipelining: the tokens `sample` would
    return as a [B] int64 device tensor queued without a host sync (None for a batch it cannot serve).
    `VerifyingSampler`, for speculative decoding: `probs` [B, V] is the distribution `sample` draws row i
    from (penalties, temperature, min-p, top-k, top-p applied; one-hot at the argmax when greedy);
    `logprobs`, what `sample` reports for row i had it chosen `token_ids[i]` ({} where not asked).
    """

    def sample(
        self,
        logits: torch.Tensor,  # [B, vocab] float32
        requests: list["Request"],
        positions: list[int] | None = None,
    ) -> SamplerOutput: ...


@runtime_checkable
class TokenSampler(Protocol):
    def sample_tokens(
        self, logits: Tensor, requests: list[Request], positions: list[int] | None = None
    ) -> Tensor | None: ...


@runtime_checkable
class SupportedParams(Protocol):
    """A sampler class that names the `SamplingParams` fields it honours (`supported_params = frozenset({
    "temperature", "seed"})`, names from `infer.testing.sampling.KNOWN_PARAMS`): the conformance kit
    (`pytest --infer-kit sampler=NAME`) tests those only. Without it, all of them are tested."""

    supported_params: frozenset[str]


@runtime_checkable
class VerifyingSampler(Protocol):
    def probs(self, logits: Tensor, requests: list[Request], positions: list[int] | None = None) -> Tensor: ...

    def logprobs(self, logits: Tensor, requests: list[Request], token_ids: list[int]) -> list[dict[int, float]]: ...
