"""CUDA graphs for decode steps and small prefills: one graph per row-count bucket, padded, replayed.

A decode step of a 7B model launches some 500 kernels; launched from Python that costs more than
the GPU needs to run them at small batch. Capturing the whole forward (embedding to logits) once
per bucket turns a step into a handful of host-to-device copies and one replay.

A row is one query token at the end of its sequence's cached context: a decode step has one row
per sequence, a speculative verify step one per position it checks (the rows of a sequence share
its block table and each sees the K/V the rows before it wrote in the same forward, which the
backend promises by `writes_kv_first`). So one set of graphs serves both, sized by the most rows
a step may have (`max_rows`: requests times one plus the decoder's lookahead). When there is a
lookahead, each bucket is warmed up under `infer.kernels.warmup.warming_up()`, so kernels tuned per row count
(the several-row GEMV) tune for the verify steps' row counts there, before capture.

A step with prompt tokens becomes rows the same way (`max_tokens`): token j of a sequence computed from
position `start` is a row whose context ends at start + j + 1, so a prompt of a few hundred tokens runs
as one replay instead of its several hundred eager launches (on a 30-layer model ~20 ms of host work
for ~1 ms of kernels). Buckets past `max_rows` compute logits only for the rows a step asks for
(a static index, `max_rows` long: a step samples at most one row per request and verify row).

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

from infer.api import AttentionBackend, AttentionBatch, KVCache
from infer.api.decode_paths import bucket_sizes
from infer.kernels.warmup import warming_up


def _int32_at(n64: int) -> int:
    """Where the int32 part of the input buffer starts: after the n64 int64 values, 256-byte aligned as
    an allocation of its own would be."""
    return -(-8 * n64 // 256) * 256


class _Staging:
    """A pinned copy of the runner's input buffer, with numpy views of its parts, and the event recorded
    after its copy to the device. cu_seqlens is 0, 1, 2, ... for every bucket: written once, here."""

    def __init__(self, size: int, n64: int, b: int, w: int, pinned: bool) -> None:
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=pinned)
        raw = self.host.numpy()
        self.i64 = raw[: 8 * n64].view(np.int64)  # ids | positions | slots | logits rows
        i32 = raw[_int32_at(n64) :].view(np.int32)
        self.seq_lens = i32[:b]
        i32[b : 2 * b + 1] = np.arange(b + 1, dtype=np.int32)
        self.tables = i32[2 * b + 1 :].reshape(b, w)
        self.copied = torch.cuda.Event() if pinned else None


class CudaGraphRunner:
    def __init__(
        self,
        model: Any,
        attention: AttentionBackend,
        kv_caches: list[KVCache],
        block_size: int,
        max_rows: int,  # rows a decode-only step may have: every one gets logits
        max_model_len: int,
        null_block: int,  # a KV block no request owns: padded rows write there
        device: torch.device,
        num_layers: int | None = None,
        tune_rows: bool = False,  # the warm-up may tune kernels for each bucket's row count (`infer.kernels.warmup`)
        max_tokens: int = 0,  # tokens a step with prompt tokens may have to replay (0: decode steps only)
        adapters: Any = None,  # the run's adapters (`infer.core.adapters`), whose kind's kernels run in the graphs
    ) -> None:
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.adapters = adapters
        self.tune_rows = tune_rows
        self.block_size, self.null_block, self.device = block_size, null_block, device
        self.num_layers = num_layers
        self.max_rows, self.max_tokens = max_rows, max_tokens
        # every decode step fits a bucket of at most max_rows rows (all with logits); larger ones are for
        # steps with prompt tokens
        self.buckets = bucket_sizes(max_rows) + [n for n in bucket_sizes(max_tokens) if n > max_rows]
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size) + 1
        b, w = self.max_batch, self.max_blocks
        # one buffer, so a step's inputs go over in one copy: int64 input_ids | positions | slot_mapping |
        # logits rows, then int32 seq_lens | cu_seqlens | block_tables
        self.n64 = 3 * b + max_rows
        size = _int32_at(self.n64) + 4 * (b + (b + 1) + b * w)
        self.inputs = torch.zeros(size, dtype=torch.uint8, device=device)
        self.i64 = self.inputs[: 8 * self.n64].view(torch.int64)
        self.i32 = self.inputs[_int32_at(self.n64) :].view(torch.int32)
        on_gpu = device.type == "cuda"
        self.staging = [_Staging(size, self.n64, b, w, on_gpu) for _ in range(2)]
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
        logits_rows = self.i64[3 * b : 3 * b + self.max_rows]
        seq_lens = self.i32[:n]
        cu = self.i32[b : b + n + 1]
        tables = self.i32[2 * b + 1 : 2 * b + 1 + b * w].view(b, w)[:n]
        return ids, pos, slots, seq_lens, cu, tables, logits_rows

    def _batch(self, n: int, seq_lens: list[int], tables: list[list[int]]) -> AttentionBatch:
        _, pos, slots, seq_lens_t, cu, tables_t, _ = self._views(n)
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

    def _stage(self) -> _Staging:
        self.turn ^= 1
        stage = self.staging[self.turn]
        if stage.copied is not None:
            stage.copied.synchronize()  # this buffer's copy of two steps ago has run
        return stage

    def _fill(
        self,
        n: int,
        token_ids: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        ids: torch.Tensor | None = None,
    ) -> None:
        """A decode step's inputs: one row a sequence."""
        b, w, bs = self.max_batch, self.max_blocks, self.block_size
        num_real = len(seq_lens)
        if ids is not None:
            token_ids = [0] * num_real  # the device tensor overwrites these
        assert len(token_ids) == num_real
        pad = n - num_real
        seq_lens = seq_lens + [1] * pad
        positions = [s - 1 for s in seq_lens]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)] + [self.null_block * bs] * pad
        stage = self._stage()
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
        self._copy(stage, n, num_real, ids)

    def _fill_rows(
        self,
        n: int,
        token_ids: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        logits_rows: list[int],
        ids: torch.Tensor | None = None,
    ) -> list[int]:
        """A step with prompt tokens as rows: sequence i's query_lens[i] tokens end at seq_lens[i], so
        its j-th is a row whose context ends at seq_lens[i] - query_lens[i] + j + 1. Returns the rows'
        context lengths."""
        b, w, bs, null = self.max_batch, self.max_blocks, self.block_size, self.null_block
        q, ends = np.asarray(query_lens), np.asarray(seq_lens)
        num_real = int(q.sum())
        first = np.repeat(np.cumsum(q) - q, q)  # each row's sequence's first row
        lens = np.repeat(ends - q, q) + np.arange(num_real) - first + 1
        stage = self._stage()
        width = min(max((len(t) for t in tables), default=1), w)
        row = 0
        for t, count in zip(tables, query_lens):
            stage.tables[row : row + count, : len(t[:width])] = t[:width]
            stage.tables[row : row + count, len(t) : width] = null
            row += count
        stage.tables[num_real:n, :width] = null
        positions = lens - 1
        slots = stage.tables[np.arange(num_real), positions // bs].astype(np.int64) * bs + positions % bs
        if ids is None:
            assert len(token_ids) == num_real
            stage.i64[:num_real] = token_ids
        stage.i64[num_real:n] = 0
        stage.i64[b : b + num_real] = positions
        stage.i64[b + num_real : b + n] = 0
        stage.i64[2 * b : 2 * b + num_real] = slots
        stage.i64[2 * b + num_real : 2 * b + n] = null * bs
        stage.i64[3 * b : 3 * b + len(logits_rows)] = logits_rows
        stage.i64[3 * b + len(logits_rows) : 3 * b + self.max_rows] = 0  # the graph reads them all: rows that exist
        stage.seq_lens[:num_real] = lens
        stage.seq_lens[num_real:n] = 1
        self._copy(stage, n, num_real, ids)
        return lens.tolist()

    def _copy(self, stage: _Staging, n: int, num_real: int, ids: torch.Tensor | None) -> None:
        used = _int32_at(self.n64) + 4 * (2 * self.max_batch + 1 + n * self.max_blocks)  # table rows in use only
        self.inputs[:used].copy_(stage.host[:used], non_blocking=True)
        if stage.copied is not None:
            stage.copied.record()
        if ids is not None:
            self.i64[:num_real].copy_(ids)

    def _forward(self, n: int) -> torch.Tensor:
        ids, pos, *_, logits_rows = self._views(n)
        hidden = self.model.forward(ids, pos, self.kv_caches, self.num_layers)
        if n > self.max_rows:  # a bucket only prompt tokens fill: the rows the step samples from
            hidden = hidden.index_select(0, logits_rows)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for n in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            self._fill(n, [], [], [])
            batch = self._batch(n, [1] * n, [[self.null_block]] * n)
            self.attention.plan(batch)
            if self.adapters is not None:  # the base model's rows: the kind's kernels read their slots
                self.adapters.plan_rows(n)
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
        """Whether a decode step of num_seqs rows replays."""
        return bool(self.graphs) and 0 < num_seqs <= self.max_rows

    def takes(self, num_tokens: int, num_logits: int) -> bool:
        """Whether a step with prompt tokens replays: num_tokens rows, logits for num_logits of them."""
        return bool(self.graphs) and 0 < num_tokens <= self.max_tokens and num_logits <= self.max_rows

    def rows(self, num_rows: int) -> int:
        """The bucket a step of `num_rows` rows replays (its graph's rows, padding included)."""
        return self.buckets[bisect.bisect_left(self.buckets, num_rows)]

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
        self,
        token_ids: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        ids: torch.Tensor | None = None,
        query_lens: list[int] | None = None,
        logits_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """A decode step (one token a sequence: logits [len(seq_lens), vocab]), or with `query_lens`
        a step of query_lens[i] tokens for sequence i (logits [len(logits_rows), vocab], the rows of
        the step's tokens listed there). `ids`: the token ids as a device tensor instead of `token_ids`."""
        num_real = len(seq_lens) if query_lens is None else sum(query_lens)
        n = self.rows(num_real)
        if query_lens is None:
            self._fill(n, token_ids, seq_lens, tables, ids)
            row_lens, row_tables = seq_lens, tables
        else:
            assert logits_rows is not None
            row_lens = self._fill_rows(n, token_ids, query_lens, seq_lens, tables, logits_rows, ids)
            row_tables = [t for t, count in zip(tables, query_lens) for _ in range(count)]
        padded = row_tables + [[self.null_block]] * (n - num_real)
        self.attention.plan(self._batch(n, row_lens + [1] * (n - num_real), padded))
        self.replays[n] += 1
        logits = self._replay(n)
        if query_lens is None or len(logits_rows or ()) == num_real:  # every row's, in order
            return logits[:num_real]
        assert logits_rows is not None
        if n > self.max_rows:  # the graph took the rows listed
            return logits[: len(logits_rows)]
        return logits.index_select(0, self._views(n)[-1][: len(logits_rows)])

    def _replay(self, n: int) -> torch.Tensor:
        graph, logits = self.graphs[n]
        graph.replay()
        return logits
