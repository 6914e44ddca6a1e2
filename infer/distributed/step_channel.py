"""Rank 0's step messages to the other tensor-parallel ranks, and the loop those ranks run.

A message is a model forward (`StepInputs` and which model), a step's KV block copies, or stop.
It travels as int64 CPU tensors broadcast over the gloo control group: a fixed-size first
broadcast holds the header and, when it fits (decode steps of a few sequences), the payload;
a larger payload follows in a second broadcast. A pipelined decode step's input ids are not on
rank 0's host yet: the forward's header says so, and rank 0's executor sends them from its device
by one broadcast over the model's group, which `serve` takes before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from infer.api import BlockOps
from infer.api.runner import StepInputs
from infer.distributed.state import ParallelState

FORWARD, BLOCK_OPS, STOP, ADAPTER = 1, 2, 3, 4
# int64: kind, model id, num_layers (0: all), flags (bit 0: use_graphs; bit 1: ids from rank 0's device;
# bit 2: the sequences' adapter slots follow the block tables; bit 3: hidden rows end the payload),
# three counts, payload length
HEADER_LEN = 8
MESSAGE_LEN = 256  # the first broadcast: the header, then the payload when it fits (small decode steps)


@dataclass(slots=True)
class AdapterLoad:
    """An adapter into a device slot of the target's runner, before the forward that runs it."""

    slot: int
    key: int
    name: str
    path: str


@dataclass(slots=True)
class Forward:
    model_id: int  # index into EngineParts.runners (0: the target, then drafts)
    step: StepInputs
    ids_from_rank0: bool = False  # the step's ids follow from rank 0's device (a pipelined decode step)


class StepChannel:
    """Rank 0's messages to the other ranks: a header and a flat int64 payload, in one broadcast of
    MESSAGE_LEN values when the payload fits, else a second broadcast carries it."""

    def __init__(self, parallel: ParallelState) -> None:
        self.parallel = parallel

    def send_forward(self, model_id: int, step: StepInputs) -> None:
        for slot, key, name, path in step.adapter_loads:  # each rank reads its part of the adapter first
            names = [*name.encode(), *path.encode()]
            self._send([ADAPTER, slot, key, 0, len(name.encode()), len(path.encode()), 0], names)
        tables = step.block_tables
        payload = [
            *step.input_ids,
            *step.query_lens,
            *step.seq_lens,
            *step.logits_rows,
            *map(len, tables),
            *chain.from_iterable(tables),
            *step.adapter_slots,
            *step.hidden_rows,  # the rest: the last pipeline stage sends these rows back (embeddings)
        ]
        counts = [len(step.query_lens), len(step.input_ids), len(step.logits_rows)]
        flags = int(step.use_graphs) | int(step.input_ids_t is not None) << 1  # bit 1: ids follow on the device
        flags |= int(bool(step.adapter_slots)) << 2 | int(bool(step.hidden_rows)) << 3
        self._send([FORWARD, model_id, step.num_layers or 0, flags, *counts], payload)

    def send_block_ops(self, ops: BlockOps) -> None:
        groups = (ops.swap_out, ops.swap_in, ops.copies)
        self._send([BLOCK_OPS, 0, 0, 0, *map(len, groups)], [b for pairs in groups for pair in pairs for b in pair])

    def send_stop(self) -> None:
        self._send([STOP, 0, 0, 0, 0, 0, 0], [])

    def _send(self, header: list[int], payload: list[int]) -> None:
        message = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
        inline = len(payload) <= MESSAGE_LEN - HEADER_LEN
        message[:HEADER_LEN] = torch.tensor([*header, len(payload)])
        if inline and payload:
            message[HEADER_LEN : HEADER_LEN + len(payload)] = torch.tensor(payload)
        self.parallel.broadcast(message)
        if not inline:
            self.parallel.broadcast(torch.tensor(payload, dtype=torch.int64))

    def receive(self) -> Forward | BlockOps | AdapterLoad | None:
        """The next message on ranks 1..N-1 (blocks until rank 0 sends one); None: stop."""
        message = self.parallel.broadcast(torch.empty(MESSAGE_LEN, dtype=torch.int64)).tolist()
        kind, model_id, num_layers, flags, a, b, c, n = message[:HEADER_LEN]
        if n <= MESSAGE_LEN - HEADER_LEN:
            values = message[HEADER_LEN : HEADER_LEN + n]
        else:
            values = self.parallel.broadcast(torch.empty(n, dtype=torch.int64)).tolist()
        if kind == STOP:
            return None
        if kind == BLOCK_OPS:
            pairs = list(zip(values[0::2], values[1::2]))
            return BlockOps(swap_out=pairs[:a], swap_in=pairs[a : a + b], copies=pairs[a + b :])
        if kind == ADAPTER:
            name = bytes(values[:a]).decode()
            return AdapterLoad(model_id, num_layers, name, bytes(values[a : a + b]).decode())
        cursor = iter(values)

        def take(count: int) -> list[int]:
            return [next(cursor) for _ in range(count)]

        num_seqs, num_tokens, num_rows = a, b, c
        input_ids, query_lens, seq_lens, rows = take(num_tokens), take(num_seqs), take(num_seqs), take(num_rows)
        tables = [take(length) for length in take(num_seqs)]
        step = StepInputs(input_ids, query_lens, seq_lens, tables, rows, num_layers or None, bool(flags & 1))
        if flags & 4:
            step.adapter_slots = take(num_seqs)
        if flags & 8:
            step.hidden_rows = list(cursor)
        return Forward(model_id, step, ids_from_rank0=bool(flags & 2))


@torch.inference_mode()
def serve(channel: StepChannel, runners: tuple[Any, ...], block_mover: Any) -> None:
    """Ranks 1..N-1: run rank 0's messages in order until it says stop. Logits are dropped here."""
    while (message := channel.receive()) is not None:
        if isinstance(message, BlockOps):
            block_mover.apply(message)
            continue
        if isinstance(message, AdapterLoad):  # into the target's slots (rank 0 sends it before the forward)
            runners[0].adapters.load(message.slot, message.key, message.name, message.path)
            continue
        runner, step = runners[message.model_id], message.step
        if message.ids_from_rank0:  # rank 0 sends the ids it sampled, from its device (`MirroredExecutor`)
            step.input_ids_t = torch.empty(len(step.input_ids), dtype=torch.int64, device=runner.device)
            channel.parallel.broadcast_tensor(step.input_ids_t)
        runner.run(step)
