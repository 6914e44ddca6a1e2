"""Pipeline stages' links (`--pp N`): point-to-point sends over the group of every process (gloo on the
CPU, NCCL on GPUs). Process p is tensor-parallel rank p % tp of stage p // tp, and each rank sends its
activations to the rank of the same index in the next stage (every rank of a stage holds the whole
activations once its layer's sums are done); the last stage's rank 0 sends the rows (logits, kept
hidden rows) to process 0. Every stage runs each forward's micro-batches in the same order, so a
send meets its receive by order alone, with no tag. Sends are queued (`isend`) and waited for once the
forward is done (`finish`): a stage hands micro-batch m on and starts m + 1 at once.
"""

from __future__ import annotations

from typing import Any

import torch

from infer.api import StageActivations


class P2PLink:
    """`infer.api.PipelineLink` between rank `index` and the ranks beside it; the last stage's rows go to rank 0."""

    def __init__(self, index: int, num_stages: int, tp_rank: int, tp_size: int, group: Any) -> None:
        self.stage_index = index
        self.num_stages = num_stages
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.group = group
        self.sends_rows = index == num_stages - 1 and tp_rank == 0  # the last stage's rank 0
        self.takes_rows = index == 0 and tp_rank == 0  # process 0, which samples
        self._pending: list[tuple[Any, torch.Tensor]] = []  # sends in flight, with their tensors kept alive

    def send_activations(self, carried: StageActivations) -> None:
        self._send(torch.stack((carried.hidden, carried.residual)), self._process(self.stage_index + 1))

    def recv_activations(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> StageActivations:
        both = self._recv((2, num_tokens, hidden_size), dtype, self._process(self.stage_index - 1))
        return StageActivations(both[0], both[1])

    def send_rows(self, rows: torch.Tensor) -> None:
        if self.sends_rows:  # the other ranks of the last stage hold the same rows
            self._send(rows, 0)

    def recv_rows(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor | None:
        if not self.takes_rows:  # the first stage's other ranks sample nothing
            return None
        return self._recv(shape, dtype, self._process(self.num_stages - 1, 0))

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def _process(self, stage: int, tp_rank: int | None = None) -> int:
        return stage * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        tensor = tensor.contiguous()
        self._pending.append((dist.isend(tensor, dst, group=self.group), tensor))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        import torch.distributed as dist

        device = torch.device("cpu") if not self._on_gpu() else torch.device("cuda", torch.cuda.current_device())
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src, group=self.group)
        return out

    def _on_gpu(self) -> bool:
        import torch.distributed as dist

        return dist.get_backend(self.group) == "nccl"
