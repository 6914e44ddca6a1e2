"""A one-token decode step's tensor-parallel sums, pushed by the GEMVs that make them.

Under tensor parallelism each decoder layer sums two row-parallel outputs (o_proj's, down_proj's)
over the ranks, and at batch 1 that sum is latency, not bandwidth (8 KiB for Llama-2-7B). Rather
than an all-reduce kernel of its own after the GEMV, the row-parallel GEMV (`triton_gemv`, a
plugin's matmul that takes `push=`) stores each output row straight into every rank's exchange slot
as it is computed, and the kernel after it (`triton_layers.lamport_reduce`) only waits for the
parts, sums them in rank order (the same bits on every rank), adds the residual and normalises;
under PDL it starts while the GEMV still runs and reads the parts as they arrive. Arrival needs no
flags (the Lamport protocol, as in TensorRT-LLM's one-shot kernels): a slot holds -0.0 until
written, a pushed -0.0 is stored as +0.0, and the reader polls until no -0.0 is left, then resets
the slot to -0.0.

A one-token step's vocab-parallel embedding goes the same way: each rank pushes its row (or zeros)
into a third slot, and the first layer's norm sums and normalises it (`embed_target`); one slot
serves every step, as all of a step's sums come between two of its uses.

Two slots, used in turn, suffice for the layers' sums: a rank writes a slot again only after every
rank has pushed the part after it, and a rank pushes only after its reader of the slot before has
finished (and reset it). A step makes two sums per layer, an even number, so each step starts on
slot 0 and a captured CUDA graph replays the same slots. Only one-row steps push; others take the
all-reduce. Requires fp16 or bf16 activations (`DTYPES`), slots mapped over CUDA IPC (FlashInfer's
`cuda_ipc`), and every push reduced before the next target is handed out.

What it saves over FlashInfer's fused all-reduce, measured: docs/performance.md, "Lamport exchange".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

DTYPES = (torch.float16, torch.bfloat16)  # -0.0 is 0x8000 in both
RESET = -32768  # -0.0's bits as int16
EMBED_SLOT = 2


class PushTarget(NamedTuple):
    """Where a GEMV pushes its partial sum: `peers` int64 [world] addresses of the slot's rows on
    each rank, `offset` elements on to this rank's part, `local` [1, N] this rank's part in its own
    slot (the GEMV's returned output)."""

    peers: torch.Tensor
    offset: int
    local: torch.Tensor


class _Raw:
    """A device buffer by address, for torch.as_tensor (the CUDA array interface)."""

    def __init__(self, ptr: int, numel: int) -> None:
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": "<i2", "data": (ptr, False), "version": 3}


class LamportExchange:
    """Three slots of [world, hidden] per rank, mapped by every rank: two for the layers' sums, in
    turn, and one for the embedding. `target()` hands the next GEMV its slot, `embed_target()` the
    embedding its; `reduce(x, ...)` sums the slot `x` is this rank's part of. `create` maps them
    over CUDA IPC; the constructor takes this rank's slots ([3, world, hidden], reset) and the
    address of each rank's copy."""

    def __init__(self, slots: torch.Tensor, addresses: list[int], rank: int, close: Any = None) -> None:
        self.slots, self.rank, self._close = slots, rank, close
        _, self.world_size, self.hidden_size = slots.shape
        self.dtype = slots.dtype
        assert self.dtype in DTYPES, self.dtype
        slot_bytes = self.world_size * self.hidden_size * slots.element_size()
        self.peers = torch.tensor(  # [slot, rank]: the address of rank's copy of the slot
            [[a + s * slot_bytes for a in addresses] for s in range(3)], dtype=torch.int64, device=slots.device
        )
        self._next = 0
        self._pending: tuple[int, int] | None = None  # (slot, data_ptr of the part handed out)
        self.pushes = 0  # targets handed out (launches: a captured graph's replays push again uncounted)

    @classmethod
    def create(cls, parallel: Any, hidden_size: int, dtype: torch.dtype) -> "LamportExchange":
        """Every rank's slots in CUDA IPC memory, mapped by all (collective over the control group)."""
        import torch.distributed as dist
        from flashinfer.comm import cuda_ipc

        group = parallel.control_group
        device = parallel.device
        numel = 3 * parallel.world_size * hidden_size
        pointers = cuda_ipc.create_shared_buffer(numel * 2, group=group)
        raw = torch.as_tensor(_Raw(pointers[parallel.rank], numel), device=device)
        raw.fill_(RESET)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's slots reset before anyone pushes
        return cls(
            raw.view(dtype).view(3, parallel.world_size, hidden_size),
            pointers,
            parallel.rank,
            close=lambda: cuda_ipc.free_shared_buffer(pointers, group=group),
        )

    def fits(self, x: torch.Tensor) -> bool:
        """Whether a GEMV with input rows like `x` pushes (the same answer on every rank)."""
        return x.dim() == 2 and x.shape[0] == 1 and x.dtype == self.dtype

    def target(self) -> PushTarget:
        """A layer's sum: the two slots in turn."""
        slot = self._next
        self._next ^= 1
        return self._target(slot)

    def embed_target(self) -> PushTarget:
        """A step's embedding: its own slot."""
        return self._target(EMBED_SLOT)

    def _target(self, slot: int) -> PushTarget:
        if self._pending is not None:
            raise RuntimeError("a pushed partial sum was never reduced: every push needs its reduce first")
        self.pushes += 1
        local = self.slots[slot, self.rank].view(1, self.hidden_size)
        self._pending = (slot, local.data_ptr())
        return PushTarget(self.peers[slot], self.rank * self.hidden_size, local)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` is the part the last `target()` handed out (its sum waits in the exchange)."""
        return self._pending is not None and x.data_ptr() == self._pending[1]

    def reduce(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> Any:
        """The ranks' sum of the part `x` (see `triton_layers.lamport_reduce` for the arguments)."""
        from infer.kernels.layers import lamport_reduce

        assert self.takes(x), "not the pending part"
        slot, _ = self._pending
        self._pending = None
        return lamport_reduce(self.slots[slot], residual, weight, eps)

    def close(self) -> None:
        """Frees the IPC memory of `create`: collective over the control group, at teardown."""
        close, self._close = self._close, None
        if close is not None:
            close()
