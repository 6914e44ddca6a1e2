"""What the runner needs of the decode paths it may be given (`infer.runtime` builds them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from infer.api.runner import ForwardSeq


class DecodeGraphs(Protocol):
    """Steps replayed from captured graphs: decode steps (one token per sequence), and steps with
    prompt tokens up to a size (each token a row, as a decode step's)."""

    def can_run(self, num_seqs: int) -> bool: ...  # a decode step of num_seqs sequences

    def takes(self, num_tokens: int, num_logits: int) -> bool: ...  # a step with prompt tokens

    def rows(self, num_rows: int) -> int: ...  # the rows a step of num_rows replays (its bucket, padding included)

    def run(
        self,
        token_ids: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        ids: torch.Tensor | None = None,  # the ids as a device tensor, instead of token_ids
        query_lens: list[int] | None = None,  # tokens per sequence; None: one each (a decode step)
        logits_rows: list[int] | None = None,  # with query_lens: which of the step's tokens get logits
    ) -> torch.Tensor: ...  # logits [len(seq_lens), vocab], or [len(logits_rows), vocab]

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


def bucket_sizes(max_rows: int) -> list[int]:
    """The batch sizes decode steps are captured (and padded) at, up to `max_rows`: a backend that plans
    per size (FlashInfer's CUDA-graph wrappers) plans for these."""
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16)) + list(range(288, 1024 + 1, 32))
    return [s for s in sizes if s < max_rows] + [max_rows]
