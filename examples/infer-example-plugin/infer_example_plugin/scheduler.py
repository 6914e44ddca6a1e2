"""`example-fifo`: continuous batching, first in first out, whole prompts, preemption by recompute.

Every step the running requests each compute their next token; then waiting requests are admitted in
arrival order while the batch has room (`max_num_seqs`) and the step's token budget
(`max_num_batched_tokens`) holds their whole prompt: prompts are never chunked, so one longer than
the budget waits for an empty batch and runs alone. When the allocator has no block left, the
latest-arrived running request is preempted: its blocks are freed and it goes back to the waiting
queue, to compute its prompt and output again. A request that cannot fit the whole cache even alone
ends with `capacity`. Parallel samples each compute their own prompt (nothing is forked; a prefix
cache may still share its blocks); beam search is refused. `update` appends the step's tokens and
applies the stop conditions: EOS (unless `ignore_eos`), stop tokens, `max_tokens`, the context length.
"""

from __future__ import annotations

import bisect
import time

import infer
from infer.api import KVAllocator, ScheduledSeq, SchedulerOutput, StepResult
from infer.api.errors import RequestError
from infer.api.request import FinishReason, Request, RequestStatus
from infer.api.scheduling import stop_reason

INFER_PLUGIN_API = ">=2.2,<3"  # 2.2 published stop_reason


class FifoScheduler:
    capabilities = infer.Capabilities()

    def __init__(self, config, allocator: KVAllocator) -> None:
        self.allocator = allocator
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens  # read every step: set_token_budget tunes it
        self.num_lookahead_tokens = 0  # set by the builder from the decoder
        self.waiting: list[Request] = []  # by arrival
        self.running: list[Request] = []  # by arrival
        self.num_steps = self.num_preemptions = 0

    def add(self, request: Request) -> None:
        if not request.params.tokens_are_final:
            raise RequestError(
                "scheduler example-fifo does no beam search: drop use_beam_search, or use --scheduler fcfs"
            )
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)

    def abort(self, request_id: str) -> Request | None:
        request = next((r for r in self.running + self.waiting if r.request_id == request_id), None)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.is_finished:
            return
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        self.allocator.free(request)
        request.status, request.finish_reason, request.finish_time = RequestStatus.FINISHED, reason, time.perf_counter()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def set_token_budget(self, tokens: int) -> None:
        """`infer.api.TokenBudgeted`: the engine sizes a step's tokens to the device (`max_step_ms`)."""
        self.max_num_batched_tokens = tokens

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledSeq] = []
        preempted: list[Request] = []
        finished: list[Request] = []
        budget, ahead = self.max_num_batched_tokens, self.num_lookahead_tokens
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:  # preempted to make room for an earlier one
                continue
            while self.allocator.allocate_slots(request, request.num_tokens + ahead) is None:
                victim = self.running[-1]
                if victim is request and len(self.running) == 1:  # alone and still no room
                    self.finish(request, FinishReason.CAPACITY)
                    finished.append(request)
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                num_new = request.num_tokens - request.num_computed_tokens
                scheduled.append(ScheduledSeq(request, num_new, ahead))
                budget -= num_new
        for request in list(self.waiting):
            if preempted or len(self.running) >= self.max_num_seqs:
                break
            if not self.allocator.can_ever_run(request, request.num_tokens + 1 + ahead):
                self.finish(request, FinishReason.CAPACITY)
                finished.append(request)
                continue
            cached = self.allocator.num_cached_tokens(request)  # a prefix cache's blocks, if it keeps one
            if (request.num_tokens - cached > budget and scheduled) or self.allocator.allocate_slots(
                request, request.num_tokens + ahead
            ) is None:
                break  # no room now: nothing behind it overtakes it
            num_new = request.num_tokens - request.num_computed_tokens  # the allocator moved it past a cached prefix
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            scheduled.append(ScheduledSeq(request, num_new, ahead))
            budget -= num_new
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first
        return SchedulerOutput(scheduled, preempted, finished, block_ops=self.allocator.take_block_ops())

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request)
        request.num_computed_tokens = 0  # computed again from the start
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)

    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        self.num_steps += 1
        finished = list(out.finished)
        for seq in out.scheduled:
            request = seq.request
            if request.is_finished:  # ended by a stop string or aborted meanwhile
                continue
            # a speculative decoder says how many tokens' K/V stay valid; else all it computed
            request.num_computed_tokens = result.num_computed.get(
                request.request_id, request.num_computed_tokens + seq.num_new_tokens
            )
            tokens = result.sampled.get(request.request_id)
            if not tokens:
                continue
            logprobs = result.logprobs.get(request.request_id)
            if request.first_token_time is None:
                request.first_token_time = time.perf_counter()
            reason = None
            for i, token in enumerate(tokens):  # tokens after a stop condition are dropped
                request.output_token_ids.append(token)
                if logprobs is not None:
                    request.output_logprobs.append(logprobs[i])
                if (reason := stop_reason(request)) is not None:
                    break
            # the newest token's K/V are computed in the next step
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            if reason is not None:
                self.finish(request, reason)
                finished.append(request)
        return finished

    def stats(self) -> dict[str, float]:
        return {"preemptions": self.num_preemptions, "steps": self.num_steps}


@infer.hookimpl
def infer_register_schedulers(register) -> None:
    register("example-fifo", FifoScheduler)
