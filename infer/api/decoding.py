"""The decoder (autoregressive, speculative, early exit) and what it is built from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from infer.api.overlap import DeviceWaits
from infer.api.runner import ForwardSeq
from infer.api.scheduling import SchedulerOutput, StepResult


class ModelRunnerLike(Protocol):
    def execute(self, out: SchedulerOutput) -> StepResult: ...


class ForwardRunner(Protocol):
    """A model runner as a decoder drives it itself (a draft model, the target's first layers): logits of
    the positions each `ForwardSeq` asks for, and the runner's sampler (`Sampler.probs`)."""

    sampler: Any

    def forward(self, seqs: list[ForwardSeq], input_ids_t: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(slots=True)
class DecoderContext:
    """What a decoder factory gets: the target's runner and a way to build more models."""

    runner: ModelRunnerLike  # the target model's runner (forward + sample)
    config: Any  # EngineConfig
    # (name_or_path, num_layers=None) -> a `ForwardRunner` over its own weights and KV cache, indexed by
    # the target's block tables (same block ids); the builder sizes every cache after the decoder is built
    build_model: Callable[..., Any] | None = None
    model_config: Any = None  # the target's ModelConfig
    share_model: Callable[[int], Any] | None = None  # num_layers -> a runner of the target's first layers (self-draft)
    # the engine's: a decoder that blocks on the device outside its runners' sampling announces it
    # there (`waits.waiting()`), so the host work deferred to that moment runs meanwhile
    waits: DeviceWaits = field(default_factory=DeviceWaits)


class Decoder(Protocol):
    """A decoding strategy: turns a scheduled step into new tokens.

    `num_lookahead_tokens` tells the scheduler how many extra KV slots to reserve per running
    request (speculative proposals). `execute` runs once per step.
    Optional abilities: `SelfDescribing.describe` (merged into the run's description and report) and
    `StatsSummary.summarize(totals)` (run-level figures from the summed `StepResult.stats`, in `Engine.stats`).
    """

    num_lookahead_tokens: int

    def execute(self, out: SchedulerOutput) -> StepResult: ...


@runtime_checkable
class SelfDescribing(Protocol):
    describe: dict[str, Any]


@runtime_checkable
class StatsSummary(Protocol):
    def summarize(self, totals: dict[str, float]) -> dict[str, float]: ...
