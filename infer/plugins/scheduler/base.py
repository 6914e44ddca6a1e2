"""What every scheduler does the same way: appending tokens, stop conditions, finishing, beams."""

from __future__ import annotations

import bisect
import time

from infer.api import BatchOutlook, KVAllocator, SchedulerOutput, StepResult
from infer.api.config import EngineConfig
from infer.api.request import FinishReason, Request, RequestStatus
from infer.api.scheduling import stop_reason
from infer.plugins.scheduler.beam_search import BeamSearch


def append_tokens(
    request: Request, token_ids: list[int], logprobs: list[dict[int, float]] | None
) -> FinishReason | None:
    """Append accepted tokens one by one; tokens after a stop condition are dropped."""
    for i, token in enumerate(token_ids):
        request.output_token_ids.append(token)
        if logprobs is not None:
            request.output_logprobs.append(logprobs[i])
        reason = stop_reason(request)
        if reason is not None:
            return reason
    return None


class SchedulerBase:
    """Queues, bookkeeping and `update`; subclasses decide `schedule`."""

    def __init__(self, config: EngineConfig, allocator: KVAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.max_num_seqs: int = config.max_num_seqs
        self.max_num_batched_tokens: int = config.max_num_batched_tokens
        self.num_lookahead_tokens = 0  # set by the builder from the decoder
        self.waiting: list[Request] = []  # sorted by rank (`rank`: priority, then arrival)
        self.running: list[Request] = []  # sorted by rank
        self.priority_aging_s: float = config.priority_aging_s
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of num_preemptions, those that swapped (the rest recompute)
        self.num_steps = 0
        self.preemption_mode: str = config.preemption_mode
        self.beams = BeamSearch()  # beam groups: their slots, candidates and finished hypotheses

    def rank(self, request: Request) -> tuple[float, int]:
        """Lower runs first: the arrival time, pushed back `priority_aging_s` per priority level, then
        the arrival order. So a request waits at most (its priority - a later one's) x the aging behind
        a later arrival; with every priority equal it is first come, first served."""
        return (request.arrival_time + request.params.priority * self.priority_aging_s, request.arrival)

    def set_token_budget(self, tokens: int) -> None:
        """`TokenBudgeted`: the tokens each step computes at most, from the next step on."""
        self.max_num_batched_tokens = tokens

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if not self.beams.add(request):
            return  # a dormant beam slot: it joins when its group takes its first step
        bisect.insort(self.waiting, request, key=self.rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    self.finish(request, FinishReason.ABORT)
                    return request
        dormant = self.beams.dormant(request_id)
        if dormant is not None:
            self.finish(dormant, FinishReason.ABORT)
        return dormant

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.is_finished:
            return
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        self.allocator.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.perf_counter()
        self.beams.on_finish(self, request, reason)  # a beam group ends as a whole

    def place(self, request: Request) -> None:
        """Queue a request whose block table was rewritten (a beam): running when it holds blocks,
        else waiting to be recomputed."""
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        if request.block_ids:
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self.rank)
        else:
            request.status = RequestStatus.PREEMPTED
            bisect.insort(self.waiting, request, key=self.rank)

    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        self.num_steps += 1
        finished = list(out.finished)
        now = time.perf_counter()
        for seq in out.scheduled:
            request = seq.request
            if request.is_finished:  # stopped by a stop string or aborted meanwhile
                continue
            # a speculative step says how many tokens stay valid (accepted draft positions kept,
            # rejected ones rolled back); otherwise every computed token is kept
            request.num_computed_tokens = result.num_computed.get(
                request.request_id, request.num_computed_tokens + seq.num_new_tokens
            )
            tokens = result.sampled.get(request.request_id)
            if not tokens:
                continue
            if self.beams.record(request, result.logprobs.get(request.request_id)):
                continue  # a beam: its candidates wait for the rest of its group
            if request.first_token_time is None:
                request.first_token_time = now
            reason = append_tokens(request, tokens, result.logprobs.get(request.request_id))
            # the newest token's K/V are computed in the next step (and a stop may have dropped tokens)
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            if reason is not None:
                self.finish(request, reason)
                finished.append(request)
        finished.extend(self.beams.resolve(self))
        return finished

    def ensure_fits(self, request: Request) -> bool:
        """Finish a request that cannot fit in the whole KV cache even alone."""
        lookahead = 0 if request.params.pooling is not None else self.num_lookahead_tokens  # embeddings never draft
        if self.allocator.can_ever_run(request, request.num_tokens + 1 + lookahead):
            return True
        self.finish(request, FinishReason.CAPACITY)
        return False

    def next_batch_outlook(self) -> BatchOutlook:
        if not self.waiting:
            return BatchOutlook.CERTAIN  # nobody to admit: the batch can only shrink
        return BatchOutlook.LIKELY if len(self.running) >= self.max_num_seqs else BatchOutlook.UNLIKELY

    def reserve_ahead(self, request: Request, num_tokens: int) -> bool:
        return self.allocator.allocate_slots(request, num_tokens) is not None

    def reset_stats(self) -> None:
        self.num_steps = self.num_preemptions = self.num_swap_preemptions = 0

    def stats(self) -> dict[str, float]:
        return {
            "preemptions": self.num_preemptions,
            "preemptions_swap": self.num_swap_preemptions,
            "preemptions_recompute": self.num_preemptions - self.num_swap_preemptions,
            "steps": self.num_steps,
        }
