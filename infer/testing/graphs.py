"""CUDA-graph paths checked on the CPU: `StandInGraphs` is the real `CudaGraphRunner` (its static
buffers, padding to a bucket, null-block rows, the rows a step with prompt tokens becomes), except that
a replay runs the captured forward eagerly over the static buffers."""

from __future__ import annotations

from typing import Any

import torch

from infer.runtime.cuda_graphs import CudaGraphRunner


class StandInGraphs(CudaGraphRunner):
    """Captures nothing: a replay runs the forward eagerly over the static buffers."""

    def capture(self) -> None:
        # every bucket marked captured, with no graph: only `_replay` (overridden here) reads one
        self.graphs = {n: (None, None) for n in self.buckets}  # type: ignore[misc]

    def _replay(self, n: int) -> torch.Tensor:
        return self._forward(n)

    def release(self) -> None:
        self.graphs.clear()


def attach_stand_in_graphs(runner: Any, max_model_len: int, max_tokens: int = 0) -> StandInGraphs:
    """Stand-in graphs on `runner` (a `ModelRunner`), sized as the builder sizes real ones (the
    attention spec's rows); `max_tokens`: steps with prompt tokens replay up to that many tokens."""
    graphs = StandInGraphs(
        runner.model,
        runner.attention,
        runner.kv_caches,
        runner.block_size,
        runner.attention.spec.max_num_seqs,
        max_model_len,
        null_block=runner.kv_caches[0][0].shape[0] - 1,
        device=runner.device,
        num_layers=runner.num_layers,
        max_tokens=max_tokens,
    )
    graphs.capture()
    runner.set_decode_paths(graphs)
    return graphs
