"""What the runner needs of the decode paths it may be given (`infer.runtime` builds them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from infer.core.runner import ForwardSeq


class DecodeGraphs(Protocol):
    """Decode-only steps (one token per sequence) replayed from captured graphs."""

    def can_run(self, num_seqs: int) -> bool: ...

    def run(
        self,
        token_ids: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        ids: torch.Tensor | None = None,  # the ids as a device tensor, instead of token_ids
    ) -> torch.Tensor: ...  # logits [len(seq_lens), vocab]

    def release(self) -> None: ...  # destroy the graphs and their memory; steps run eagerly after


class DecodePipeline(Protocol):
    """Queues the next decode forward before this step's sampled tokens reach the host, and serves
    the next step from it when that step is exactly what was predicted. Counts both outcomes."""

    hits: int  # steps served by a forward queued ahead
    misses: int  # forwards queued ahead and not used

    def take(self, seqs: list[ForwardSeq]) -> torch.Tensor | None:
        """The logits of the forward queued ahead for `seqs`, or None (it is dropped either way)."""
        ...

    def sample(self, logits: torch.Tensor, seqs: list[ForwardSeq]) -> list[int] | None:
        """Sample on the device, queue the next forward, return this step's ids; None when this step
        cannot (the caller samples as usual)."""
        ...

    def discard(self) -> None: ...  # drop a forward queued ahead (its step failed)
