"""`fcfs`: continuous batching, first come first served, with preemption by recompute.

Every step, running requests (earliest arrival first) get their next tokens; when the allocator
has no block left, the latest-arrived running request is preempted: its blocks are freed and it
goes back to the head of the waiting queue, to be recomputed (prompt + output so far) later.
New requests are admitted only while nothing preempted is waiting, and long prompts are split
into chunks so one step never computes more than `max_num_batched_tokens`.
"""

from __future__ import annotations

import bisect

from infer.core.hookspecs import hookimpl
from infer.core.interfaces import Capabilities, ScheduledSeq, SchedulerOutput
from infer.core.request import FinishReason, Request, RequestStatus
from infer.plugins.scheduling.base import SchedulerBase


class FcfsScheduler(SchedulerBase):
    capabilities = Capabilities()

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Request] = []
        finished: list[Request] = []

        for request in list(self.running):
            if request not in self.running:  # preempted while making room for an earlier one
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            if self._grant(request, num_new, preempted, finished):
                scheduled.append(ScheduledSeq(request, num_new, self.num_lookahead_tokens))
                budget -= num_new

        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self.ensure_fits(request):
                finished.append(request)
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            want = request.num_computed_tokens + num_new + self.num_lookahead_tokens
            if self.allocator.allocate_slots(request, want) is None:
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            scheduled.append(ScheduledSeq(request, num_new, self.num_lookahead_tokens))
            budget -= num_new

        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first (stable)
        return SchedulerOutput(scheduled=scheduled, preempted=preempted, finished=finished)

    def _grant(self, request: Request, num_new: int, preempted: list[Request], finished: list[Request]) -> bool:
        """Allocate slots for `request`, preempting later arrivals until it fits."""
        want = request.num_computed_tokens + num_new + self.num_lookahead_tokens
        while self.allocator.allocate_slots(request, want) is None:
            victim = self.running[-1]  # latest arrival
            if victim is request and len(self.running) == 1:
                self.finish(request, FinishReason.CAPACITY)  # alone and still no room
                finished.append(request)
                return False
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request)
        request.num_computed_tokens = 0  # recompute prompt + output from scratch
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)


@hookimpl
def infer_register_schedulers(register) -> None:
    register("fcfs", FcfsScheduler)
