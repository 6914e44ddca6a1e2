"""CUDA graphs for decode-only steps: one graph per row-count bucket, padded, replayed each step.

A decode step of a 7B model launches some 500 kernels; launched from Python that costs more than
the GPU needs to run them at small batch. Capturing the whole forward (embedding to logits) once
per bucket turns a step into a handful of host-to-device copies and one replay.

A row is one query token at the end of its sequence's cached context: a decode step has one row
per sequence, a speculative verify step one per position it checks (the rows of a sequence share
its block table and each sees the K/V the rows before it wrote in the same forward, which the
backend promises by `writes_kv_first`). So one set of graphs serves both, sized by the most rows
a step may have (`max_rows`: requests times one plus the decoder's lookahead). When there is a
lookahead, each bucket is warmed up under `infer.warmup.warming_up()`, so kernels tuned per row count
(the several-row GEMV) tune for the verify steps' row counts there, before capture.

Inputs live in one static buffer; every step copies its values in (one H2D copy from a pinned
staging buffer, the block-table rows in use only). The staging buffers come in pairs used in turn,
and one is refilled only once its last copy has run (an event per buffer): the host may queue steps
ahead of the GPU, as decode pipelining and a draft model's proposal steps do.
A step's token ids may instead come from a device tensor (the tokens the step before sampled, not
yet on the host). Padded rows read and write only the null block, a spare KV block that the
allocator never hands out. The attention backend must be graph-safe (`cuda_graph_safe`): its
`plan` may do host work but the kernels it launches must read the batch only through the static
tensors and use fixed grids for a given row count.
"""

from __future__ import annotations

import bisect
from collections import Counter
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from infer.core.interfaces import AttentionBackend, AttentionBatch, KVCache
from infer.warmup import warming_up


def _int32_at(b: int) -> int:
    """Where the int32 part of the input buffer starts: after the int64 part, 256-byte aligned as an
    allocation of its own would be."""
    return -(-8 * 3 * b // 256) * 256


class _Staging:
    """A pinned copy of the runner's input buffer, with numpy views of its parts, and the event recorded
    after its copy to the device. cu_seqlens is 0, 1, 2, ... for every bucket: written once, here."""

    def __init__(self, size: int, b: int, w: int, pinned: bool) -> None:
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=pinned)
        raw = self.host.numpy()
        self.i64 = raw[: 8 * 3 * b].view(np.int64)  # ids | positions | slots
        i32 = raw[_int32_at(b) :].view(np.int32)
        self.seq_lens = i32[:b]
        i32[b : 2 * b + 1] = np.arange(b + 1, dtype=np.int32)
        self.tables = i32[2 * b + 1 :].reshape(b, w)
        self.copied = torch.cuda.Event() if pinned else None


def bucket_sizes(max_rows: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16)) + list(range(288, 1024 + 1, 32))
    return [s for s in sizes if s < max_rows] + [max_rows]


class CudaGraphRunner:
    def __init__(
        self,
        model: Any,
        attention: AttentionBackend,
        kv_caches: list[KVCache],
        block_size: int,
        max_rows: int,  # rows a decode-only step may have
        max_model_len: int,
        null_block: int,  # a KV block no request owns: padded rows write there
        device: torch.device,
        num_layers: int | None = None,
        tune_rows: bool = False,  # the warm-up may tune kernels for each bucket's row count (`infer.warmup`)
    ) -> None:
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.tune_rows = tune_rows
        self.block_size, self.null_block, self.device = block_size, null_block, device
        self.num_layers = num_layers
        self.buckets = bucket_sizes(max_rows)
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size) + 1
        b, w = self.max_batch, self.max_blocks
        # one buffer, so a step's inputs go over in one copy: int64 input_ids | positions | slot_mapping,
        # then int32 seq_lens | cu_seqlens | block_tables
        size = _int32_at(b) + 4 * (b + (b + 1) + b * w)
        self.inputs = torch.zeros(size, dtype=torch.uint8, device=device)
        self.i64 = self.inputs[: 8 * 3 * b].view(torch.int64)
        self.i32 = self.inputs[_int32_at(b) :].view(torch.int32)
        on_gpu = device.type == "cuda"
        self.staging = [_Staging(size, b, w, on_gpu) for _ in range(2)]
        self.turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None
        self.replays: Counter[int] = Counter()  # bucket -> steps replayed with it
        self._view_cache: dict[int, tuple[torch.Tensor, ...]] = {}

    def _views(self, n: int) -> tuple[torch.Tensor, ...]:
        # sliced once per bucket (the static tensors never move), not at every step
        views = self._view_cache.get(n)
        if views is None:
            views = self._view_cache[n] = self._make_views(n)
        return views

    def _make_views(self, n: int) -> tuple[torch.Tensor, ...]:
        b, w = self.max_batch, self.max_blocks
        ids, pos, slots = self.i64[:n], self.i64[b : b + n], self.i64[2 * b : 2 * b + n]
        seq_lens = self.i32[:n]
        cu = self.i32[b : b + n + 1]
        tables = self.i32[2 * b + 1 : 2 * b + 1 + b * w].view(b, w)[:n]
        return ids, pos, slots, seq_lens, cu, tables

    def _batch(self, n: int, seq_lens: list[int], tables: list[list[int]]) -> AttentionBatch:
        _, pos, slots, seq_lens_t, cu, tables_t = self._views(n)
        return AttentionBatch(
            query_lens=[1] * n,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=self.block_size,
            num_decode_seqs=n,
            cu_seqlens_q=cu,
            seq_lens_t=seq_lens_t,
            block_tables_t=tables_t,
            slot_mapping=slots,
            positions=pos,
        )

    def _fill(
        self,
        n: int,
        token_ids: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        ids: torch.Tensor | None = None,
    ) -> None:
        b, w, bs = self.max_batch, self.max_blocks, self.block_size
        num_real = len(seq_lens)
        if ids is not None:
            token_ids = [0] * num_real  # the device tensor overwrites these
        assert len(token_ids) == num_real
        pad = n - num_real
        seq_lens = seq_lens + [1] * pad
        positions = [s - 1 for s in seq_lens]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)] + [self.null_block * bs] * pad
        self.turn ^= 1
        stage = self.staging[self.turn]
        if stage.copied is not None:
            stage.copied.synchronize()  # this buffer's copy of two steps ago has run
        # written through numpy views of the pinned buffer: a few microseconds, where a torch op each costs tens
        stage.i64[:n] = token_ids + [0] * pad
        stage.i64[b : b + n] = positions
        stage.i64[2 * b : 2 * b + n] = slots
        stage.seq_lens[:n] = seq_lens
        # only the columns in use this step: kernels never read a table past its seq_len (a table may hold
        # more blocks, reserved for draft tokens past max_model_len's last block)
        width = min(max((len(t) for t in tables), default=1), w)
        rows = [t[:width] + [self.null_block] * (width - len(t)) for t in tables] + [[self.null_block] * width] * pad
        stage.tables[:n, :width] = rows
        used = _int32_at(b) + 4 * (2 * b + 1 + n * w)  # the block-table rows in use, no further
        self.inputs[:used].copy_(stage.host[:used], non_blocking=True)
        if stage.copied is not None:
            stage.copied.record()
        if ids is not None:
            self.i64[:num_real].copy_(ids)

    def _forward(self, n: int) -> torch.Tensor:
        ids, pos, *_ = self._views(n)
        hidden = self.model.forward(ids, pos, self.kv_caches, self.num_layers)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for n in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            self._fill(n, [], [], [])
            batch = self._batch(n, [1] * n, [[self.null_block]] * n)
            self.attention.plan(batch)
            with torch.cuda.stream(stream), warming_up() if self.tune_rows else nullcontext():
                self._forward(n)  # warm-up outside the graph (Triton compiles, tiles are tuned here)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(n)
            self.pool = graph.pool()
            self.graphs[n] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def can_run(self, num_seqs: int) -> bool:
        return bool(self.graphs) and 0 < num_seqs <= self.max_batch

    def release(self) -> None:
        """Destroy the captured graphs and their memory pool (steps run eagerly after this). Under
        tensor parallelism this comes before the process group is taken down: a graph that captured
        an NCCL collective holds a reference on the communicator, and NCCL's teardown waits until
        every such graph is destroyed, so with the graphs still alive it waits forever."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None

    def run(
        self, token_ids: list[int], seq_lens: list[int], tables: list[list[int]], ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One token for each row; returns logits [len(seq_lens), vocab]. `ids`: the token ids as a
        device tensor instead of `token_ids`."""
        num_real = len(seq_lens)
        n = self.buckets[bisect.bisect_left(self.buckets, num_real)]
        self._fill(n, token_ids, seq_lens, tables, ids)
        padded = tables + [[self.null_block]] * (n - num_real)
        self.attention.plan(self._batch(n, seq_lens + [1] * (n - num_real), padded))
        self.replays[n] += 1
        return self._replay(n)[:num_real]

    def _replay(self, n: int) -> torch.Tensor:
        graph, logits = self.graphs[n]
        graph.replay()
        return logits
