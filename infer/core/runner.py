"""ModelRunner: a scheduled step -> attention metadata -> model forward -> logits -> sampler.

Decode pipelining. A decode step's host work (the sampled ids' trip to the host, the scheduler,
the step's metadata) would leave the GPU idle between forwards. When every sequence of a step
only decodes and the sampler can leave its tokens on the device (`TokenSampler`), the runner
queues the next forward right after the sampling kernels, fed by the sampled ids on the device
(`_Ahead`), and only then waits for this step's ids. The next `execute` takes the rows of that
forward for the sequences it was given when each one is exactly what was predicted (same token at
the same position, the same blocks), and runs the step itself otherwise. The scheduler (a
`PipeliningScheduler`) reserves the slots such a forward writes and says how likely the next batch
is this one: a forward is queued ahead when that is CERTAIN, or LIKELY and guesses have been
hitting: after a miss (a request stopped and a waiting one took its place) it waits 1, 2, 4 ... 64
steps before guessing again. Nothing else changes: the scheduler, sampler and output see the same
steps in the same order, so the tokens are the ones the unpipelined engine makes. A forward run
ahead for a sequence that then stops writes only into the next slot of a block that sequence owns
alone, which nothing reads before it is written again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from infer.core.interfaces import (
    AttentionBackend,
    AttentionBatch,
    BatchOutlook,
    CausalLM,
    Executor,
    KVCache,
    LocalExecutor,
    PipeliningScheduler,
    Sampler,
    Scheduler,
    SchedulerOutput,
    StepResult,
    TokenSampler,
)
from infer.core.request import Request


@dataclass(slots=True)
class ForwardSeq:
    """One sequence's slice of a forward pass: tokens [start, start + len(token_ids)) of it."""

    request: Request
    token_ids: list[int]  # the tokens computed (query)
    start: int  # position of the first one
    logits_rows: int  # how many trailing positions need logits (0: none, 1: the last, k: the last k)


@dataclass(slots=True)
class _Ahead:
    """A decode forward queued before its inputs reached the host: sequence i computes position
    `positions[i]` of `requests[i]` from the token sampled on the device at the step before."""

    requests: list[Request]
    positions: list[int]
    blocks: list[list[int]]  # block table prefix in use, per sequence, when it was queued
    logits: torch.Tensor  # [len(requests), vocab] float32, filled once the forward runs
    tokens: list[int] = field(default_factory=list)  # the input tokens, once known on the host


@dataclass(slots=True)
class StepInputs:
    """One forward's flat inputs. Under tensor parallelism rank 0 broadcasts these and every rank runs them."""

    input_ids: list[int]  # [T], sequences one after another (ignored where input_ids_t is given)
    query_lens: list[int]  # seq i -> tokens computed
    seq_lens: list[int]  # seq i -> tokens in the cache after this forward
    block_tables: list[list[int]]  # seq i -> block ids
    logits_rows: list[int]  # which of the T tokens get logits, in order
    num_layers: int | None  # run only the first layers (early exit, self-draft); None: all
    use_graphs: bool  # a decode-only step replayed from a CUDA graph
    input_ids_t: torch.Tensor | None = None  # [T] int64 on the device: the ids, not yet on the host


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        kv_caches: list[KVCache],
        sampler: Sampler,
        block_size: int,
        device: torch.device,
        num_layers: int | None = None,  # run only the first layers (early exit)
        executor: Executor | None = None,  # how each forward reaches every rank (None: it runs here alone)
    ) -> None:
        self.model = model
        self.attention = attention
        self.kv_caches = kv_caches
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.num_layers = num_layers
        self.executor = executor if executor is not None else LocalExecutor()
        self.graphs: Any = None  # a CudaGraphRunner for decode-only steps (`set_decode_paths`)
        self.pipeline = False  # queue the next decode forward before this step's tokens reach the host
        self.pipeline_scheduler: PipeliningScheduler | None = None  # outlook and slots for the forward queued ahead
        self.samples_on_device = isinstance(sampler, TokenSampler)
        self._ahead: _Ahead | None = None
        self._tokens_host: torch.Tensor | None = None  # pinned landing buffer for sampled ids
        self.pipeline_hits = 0  # steps served by a forward queued ahead
        self.pipeline_misses = 0  # forwards queued ahead and not used
        self._backoff = 0  # after a miss while requests wait: steps to go without queuing ahead (doubles per miss)
        self._skip = 0

    def set_decode_paths(self, graphs: Any = None, pipeline_with: Scheduler | None = None) -> None:
        """Called once, after the KV caches exist. `graphs`: a CudaGraphRunner that replays decode-only
        steps. `pipeline_with`: the scheduler, to pipeline decode steps (see the module docstring); one
        that is not a `PipeliningScheduler` gets no forward queued ahead."""
        self.graphs = graphs
        self.pipeline = pipeline_with is not None
        self.pipeline_scheduler = pipeline_with if isinstance(pipeline_with, PipeliningScheduler) else None

    def release(self) -> None:
        """Give this runner's device memory back now: the CUDA graphs and their pool, then the storage
        of the weights, the buffers and the KV cache, whoever still holds the tensors (a caller's frame,
        a traceback, a backend's views). The runner cannot run again. A self-draft shares the target's
        model and cache: releasing both is the same as releasing one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a forward queued ahead may still read the cache
        if self.graphs is not None:
            self.graphs.release()
        self._ahead = None
        tensors = [*self.model.parameters(), *self.model.buffers(), *(t for layer in self.kv_caches for t in layer)]
        for tensor in tensors:
            tensor.untyped_storage().resize_(0)
        self.kv_caches.clear()

    @torch.inference_mode()
    def forward(self, seqs: list[ForwardSeq], input_ids_t: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model over `seqs` (decodes first); returns logits [sum(logits_rows), vocab] float32.
        `input_ids_t`: the step's ids as a device tensor (decode pipelining; seqs' token_ids unused)."""
        use_graphs = (
            self.graphs is not None
            and self.graphs.can_run(len(seqs))
            and all(len(s.token_ids) == 1 and s.logits_rows == 1 for s in seqs)
        )
        step = StepInputs([], [], [], [], [], self.num_layers, use_graphs, input_ids_t)
        for seq in seqs:
            step.input_ids.extend(seq.token_ids)
            step.query_lens.append(len(seq.token_ids))
            step.seq_lens.append(seq.start + len(seq.token_ids))
            step.block_tables.append(seq.request.block_ids)
            end = len(step.input_ids)
            step.logits_rows.extend(range(end - seq.logits_rows, end))
        return self.forward_step(step)

    def forward_step(self, step: StepInputs) -> torch.Tensor:
        """Run `step` on every rank, through the executor (under tensor parallelism rank 0's sends the
        step to the other ranks, then runs it here)."""
        return self.executor.forward(self, step)

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """The forward itself (every tensor-parallel rank runs this): logits [len(logits_rows), vocab] float32."""
        if step.use_graphs:
            return self.graphs.run(step.input_ids, step.seq_lens, step.block_tables, step.input_ids_t)
        batch = AttentionBatch.build(step.query_lens, step.seq_lens, step.block_tables, self.block_size, self.device)
        self.attention.plan(batch)
        ids = step.input_ids_t
        if ids is None:
            ids = torch.tensor(step.input_ids, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(ids, batch.positions, self.kv_caches, step.num_layers)  # [T, hidden]
        if not step.logits_rows:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(step.logits_rows, device=self.device)])

    def execute(self, out: SchedulerOutput) -> StepResult:
        seqs = []
        for s in out.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            tokens = [r.token_at(start)] if s.num_new_tokens == 1 else r.all_token_ids[start : start + s.num_new_tokens]
            seqs.append(ForwardSeq(r, tokens, start, 1 if s.samples else 0))
        ahead, self._ahead = self._ahead, None
        logits = self._take(ahead, seqs) if ahead is not None and seqs else None
        if ahead is not None:
            self._count(hit=logits is not None)
        if not seqs:
            return StepResult(sampled={})
        if logits is None:
            logits = self.forward(seqs)
        sampled_requests = [s.request for s in seqs if s.logits_rows]
        if not sampled_requests:
            return StepResult(sampled={})
        token_ids = self._sample_pipelined(logits, seqs) if self.pipeline else None
        if token_ids is not None:
            return StepResult(sampled={r.request_id: [t] for r, t in zip(sampled_requests, token_ids)})
        result = self.sampler.sample(logits, sampled_requests)
        sampled = {r.request_id: [t] for r, t in zip(sampled_requests, result.token_ids)}
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {
                r.request_id: [lp] for r, lp in zip(sampled_requests, result.logprobs) if r.params.logprobs is not None
            }
        return StepResult(sampled=sampled, logprobs=logprobs)

    # ------------------------------------------------------------------ decode pipelining

    def _sample_pipelined(self, logits: torch.Tensor, seqs: list[ForwardSeq]) -> list[int] | None:
        """Sample on the device, queue the next forward for the sequences that will go on, then wait
        for this step's ids. None when this step cannot (a prefill in it, logprobs, no support)."""
        if not self.samples_on_device:
            return None
        if not all(len(s.token_ids) == 1 and s.logits_rows == 1 for s in seqs):
            return None
        requests = [s.request for s in seqs]
        tokens = self.sampler.sample_tokens(logits, requests)
        if tokens is None:
            return None
        host, ready = tokens, None  # on the CPU there is nothing to overlap with: the ids are here already
        if tokens.device.type == "cuda":
            n = tokens.shape[0]
            if self._tokens_host is None or self._tokens_host.shape[0] < n:
                self._tokens_host = torch.empty(max(n, 256), dtype=torch.int64).pin_memory()
            host = self._tokens_host[:n]
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        if self._should_queue_ahead():
            self._launch_ahead(seqs, tokens)
        if ready is not None:
            ready.synchronize()  # this step's ids only: the forward queued ahead runs meanwhile
        token_ids = host.tolist()
        if self._ahead is not None:
            by_request = {s.request.request_id: t for s, t in zip(seqs, token_ids)}
            self._ahead.tokens = [by_request[r.request_id] for r in self._ahead.requests]
        return token_ids

    def discard_ahead(self) -> None:
        """Drop a forward queued ahead (its step failed). On a GPU it still runs, in stream order
        before any later forward; it writes only slots that nothing reads before writing them again."""
        self._ahead = None

    def _count(self, hit: bool) -> None:
        if hit:
            self.pipeline_hits += 1
            self._backoff = 0
        else:  # requests stopped and others were admitted: the queued forward went to waste
            self.pipeline_misses += 1
            self._backoff = min(64, max(1, 2 * self._backoff))
            self._skip = self._backoff

    def _should_queue_ahead(self) -> bool:
        ahead = self.pipeline_scheduler
        outlook = ahead.next_batch_outlook() if ahead is not None else BatchOutlook.UNLIKELY
        if outlook == BatchOutlook.CERTAIN:
            return True
        if outlook == BatchOutlook.UNLIKELY:
            return False
        if self._skip:  # LIKELY, but the last guesses missed: wait a while before trying again
            self._skip -= 1
            return False
        return True

    def _launch_ahead(self, seqs: list[ForwardSeq], tokens: torch.Tensor) -> None:
        """Queue the next step's forward for the sequences that will decode again and whose next
        slot is in a block they already hold."""
        keep: list[int] = []
        for i, s in enumerate(seqs):
            r, pos = s.request, s.start + 1
            if not r.params.tokens_are_final or r.is_finished:
                continue
            if len(r.output_token_ids) + 1 >= r.params.max_tokens:  # this step's token is its last
                continue
            if r.max_model_len and pos + 1 >= r.max_model_len:
                continue
            if pos // self.block_size >= len(r.block_ids) and not self._claim_block(r, pos):
                continue
            keep.append(i)
        if not keep:
            return
        ids = tokens if len(keep) == len(seqs) else tokens[torch.tensor(keep, device=tokens.device)]
        nexts = [ForwardSeq(seqs[i].request, [0], seqs[i].start + 1, 1) for i in keep]
        logits = self.forward(nexts, input_ids_t=ids)
        blocks = [list(f.request.block_ids[: f.start // self.block_size + 1]) for f in nexts]
        self._ahead = _Ahead([f.request for f in nexts], [f.start for f in nexts], blocks, logits)

    def _claim_block(self, request: Request, pos: int) -> bool:
        """Have the scheduler reserve the fresh block that slot `pos` starts, as it would next step; False
        when none is free or the allocator would first copy a block (the queued write would precede it)."""
        before = list(request.block_ids)
        if not self.pipeline_scheduler.reserve_ahead(request, pos + 1):
            return False
        return request.block_ids[: len(before)] == before

    def _take(self, ahead: _Ahead, seqs: list[ForwardSeq]) -> torch.Tensor | None:
        """Rows of the forward queued ahead for `seqs`, when each one is exactly what it computed."""
        index = {r.request_id: i for i, r in enumerate(ahead.requests)}
        rows: list[int] = []
        for s in seqs:
            i = index.get(s.request.request_id)
            if i is None or len(s.token_ids) != 1 or s.logits_rows != 1 or s.start != ahead.positions[i]:
                return None
            if not ahead.tokens or s.token_ids[0] != ahead.tokens[i]:
                return None
            blocks = ahead.blocks[i]
            if s.request.block_ids[: len(blocks)] != blocks:
                return None
            rows.append(i)
        if rows == list(range(len(ahead.requests))):
            return ahead.logits
        return ahead.logits[torch.tensor(rows, device=ahead.logits.device)]
