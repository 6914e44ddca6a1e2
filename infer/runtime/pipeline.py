"""Decode pipelining: the next decode forward queued before this step's tokens reach the host.

A decode step's host work (the sampled ids' trip to the host, the scheduler, the step's metadata)
would leave the GPU idle between forwards. When every sequence of a step only decodes and the
sampler can leave its tokens on the device (`TokenSampler`), the next forward is queued right after
the sampling kernels, fed by the sampled ids on the device (`_Ahead`), and only then does the host
wait for this step's ids. The next step takes the rows of that forward for the sequences it was
given when each one is exactly what was predicted (same token at the same position, the same
blocks), and runs the step itself otherwise. The scheduler (a `PipeliningScheduler`) reserves the
slots such a forward writes and says how likely the next batch is this one: a forward is queued
ahead when that is CERTAIN, or LIKELY and guesses have been hitting: after a miss (a request
stopped and a waiting one took its place) it waits 1, 2, 4 ... 64 steps before guessing again.
Nothing else changes: the scheduler, sampler and output see the same steps in the same order, so
the tokens are the ones the unpipelined engine makes. A forward run ahead for a sequence that then
stops writes only into the next slot of a block that sequence owns alone, which nothing reads
before it is written again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.api import BatchOutlook, PipeliningScheduler, Scheduler, TokenSampler
from infer.api.request import Request
from infer.api.runner import ForwardSeq
from infer.runtime.runner import ModelRunner


@dataclass(slots=True)
class _Ahead:
    """A decode forward queued before its inputs reached the host: sequence i computes position
    `positions[i]` of `requests[i]` from the token sampled on the device at the step before."""

    requests: list[Request]
    positions: list[int]
    blocks: list[list[int]]  # block table prefix in use, per sequence, when it was queued
    logits: torch.Tensor  # [len(requests), vocab] float32, filled once the forward runs
    tokens: list[int] = field(default_factory=list)  # the input tokens, once known on the host


class Pipeline:
    """A runner's `DecodePipeline`. `scheduler`: a `PipeliningScheduler` reserves the slots of the
    forwards queued ahead and gives the outlook; any other scheduler gets none queued."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler if isinstance(scheduler, PipeliningScheduler) else None
        self.samples_on_device = isinstance(runner.sampler, TokenSampler)
        self.hits = 0
        self.misses = 0
        self._ahead: _Ahead | None = None
        self._tokens_host: torch.Tensor | None = None  # pinned landing buffer for sampled ids
        self._backoff = 0  # after a miss while requests wait: steps to go without queuing ahead (doubles per miss)
        self._skip = 0

    def take(self, seqs: list[ForwardSeq]) -> torch.Tensor | None:
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        logits = self._rows(ahead, seqs) if seqs else None
        self._count(hit=logits is not None)
        return logits

    def discard(self) -> None:
        """On a GPU the dropped forward still runs, in stream order before any later forward; it writes
        only slots that nothing reads before writing them again."""
        self._ahead = None

    def sample(self, logits: torch.Tensor, seqs: list[ForwardSeq]) -> list[int] | None:
        if not self.samples_on_device:
            return None
        if not all(len(s.token_ids) == 1 and s.logits_rows == 1 for s in seqs):
            return None
        tokens = self.runner.sampler.sample_tokens(logits, [s.request for s in seqs])
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
        self.runner.waits.waiting()
        if ready is not None:
            ready.synchronize()  # this step's ids only: the forward queued ahead runs meanwhile
        token_ids = host.tolist()
        if self._ahead is not None:
            by_request = {s.request.request_id: t for s, t in zip(seqs, token_ids)}
            self._ahead.tokens = [by_request[r.request_id] for r in self._ahead.requests]
        return token_ids

    def _count(self, hit: bool) -> None:
        if hit:
            self.hits += 1
            self._backoff = 0
        else:  # requests stopped and others were admitted: the queued forward went to waste
            self.misses += 1
            self._backoff = min(64, max(1, 2 * self._backoff))
            self._skip = self._backoff

    def _should_queue_ahead(self) -> bool:
        outlook = self.scheduler.next_batch_outlook() if self.scheduler is not None else BatchOutlook.UNLIKELY
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
        block_size = self.runner.block_size
        keep: list[int] = []
        for i, s in enumerate(seqs):
            r, pos = s.request, s.start + 1
            if not r.params.tokens_are_final or r.is_finished:
                continue
            if len(r.output_token_ids) + 1 >= r.params.max_tokens:  # this step's token is its last
                continue
            if r.max_model_len and pos + 1 >= r.max_model_len:
                continue
            if pos // block_size >= len(r.block_ids) and not self._claim_block(r, pos):
                continue
            keep.append(i)
        if not keep:
            return
        ids = tokens if len(keep) == len(seqs) else tokens[torch.tensor(keep, device=tokens.device)]
        nexts = [ForwardSeq(seqs[i].request, [0], seqs[i].start + 1, 1) for i in keep]
        logits = self.runner.forward(nexts, input_ids_t=ids)
        blocks = [list(f.request.block_ids[: f.start // block_size + 1]) for f in nexts]
        self._ahead = _Ahead([f.request for f in nexts], [f.start for f in nexts], blocks, logits)

    def _claim_block(self, request: Request, pos: int) -> bool:
        """Have the scheduler reserve the fresh block that slot `pos` starts, as it would next step; False
        when none is free or the allocator would first copy a block (the queued write would precede it)."""
        before = list(request.block_ids)
        if not self.scheduler.reserve_ahead(request, pos + 1):
            return False
        return request.block_ids[: len(before)] == before

    @staticmethod
    def _rows(ahead: _Ahead, seqs: list[ForwardSeq]) -> torch.Tensor | None:
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
