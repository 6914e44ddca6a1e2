"""`fcfs`: continuous batching, first come first served, with preemption by recompute or swap.

The policy of the PagedAttention paper. Every step, running requests (earliest arrival first)
get their next tokens, decodes before any prefill chunk; when the allocator has no block left,
the latest-arrived running request is preempted: with `--preemption-mode swap` its blocks go to
the CPU pool (recompute when that is full), else they are freed and its prompt + output so far
are computed again later (the prefix cache usually still holds most of them). Preempted requests
go back to the waiting queue by arrival, so they are resumed before anything newer is admitted,
and nothing is admitted in a step that preempted. Long prompts are split into chunks so one step
never computes more than `max_num_batched_tokens`.

Admission shares what it can: a parallel sample waits for its parent's prompt and forks its
blocks; any other request adopts its longest cached prefix.
"""

from __future__ import annotations

import bisect

from infer.api import Capabilities, ScheduledSeq, SchedulerOutput
from infer.api.hookspecs import hookimpl
from infer.api.request import FinishReason, Request, RequestStatus
from infer.plugins.scheduler.base import SchedulerBase


class FcfsScheduler(SchedulerBase):
    capabilities = Capabilities()

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Request] = []
        finished: list[Request] = []

        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:  # preempted (or finished) making room for an earlier one
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # a beam waiting for the rest of its group
                continue
            if self._grant(request, num_new, preempted, finished):
                scheduled.append(ScheduledSeq(request, num_new, self.num_lookahead_tokens))
                budget -= num_new

        for request in list(self.waiting):
            if preempted or budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self.beams.is_idle(request):  # preempted after its candidates were recorded: nothing to run
                continue
            wait, parent = self._fork_parent(request)
            if wait:  # a parallel sample whose parent is still computing the prompt
                continue
            if not self.ensure_fits(request):
                finished.append(request)
                continue
            num_new = self._admit(request, parent, budget)
            if num_new is None:
                break  # head of line: nothing behind it overtakes it
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            scheduled.append(ScheduledSeq(request, num_new, self.num_lookahead_tokens))
            budget -= num_new

        if not scheduled and not preempted and self.waiting:
            self._free_an_idle_beam(preempted)

        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first (stable)
        return SchedulerOutput(scheduled, preempted, finished, block_ops=self.allocator.take_block_ops())

    def _fork_parent(self, request: Request) -> tuple[bool, Request | None]:
        """(wait, parent): a sample forks its running parent's prompt blocks, once they are computed."""
        parent = request.fork_parent
        if parent is None or request.block_ids or request.num_computed_tokens or self.allocator.is_swapped(request):
            return False, None
        shared = min(parent.num_prompt_tokens, request.num_tokens - 1)
        if shared <= 0 or parent.status is not RequestStatus.RUNNING:
            return False, None
        return parent.num_computed_tokens < shared, parent

    def _admit(self, request: Request, parent: Request | None, budget: int) -> int | None:
        """Give a waiting request its blocks (forked, cached, swapped back in or new); returns its
        tokens to compute this step, or None (nothing changed) when there is no room."""
        if parent is not None:
            self.allocator.fork(parent, request, min(parent.num_prompt_tokens, request.num_tokens - 1))
        computed = request.num_computed_tokens or self.allocator.num_cached_tokens(request)
        num_new = min(request.num_tokens - computed, budget)
        if self.allocator.allocate_slots(request, computed + num_new + self.num_lookahead_tokens) is None:
            if parent is not None:
                self.allocator.free(request)
                request.num_computed_tokens = 0
            return None
        assert request.num_computed_tokens == computed, "the cached prefix changed between lookup and allocation"
        return num_new

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

    def _free_an_idle_beam(self, preempted: list[Request]) -> None:
        """Nothing could run: the latest idle beam gives its blocks up (it keeps its candidates),
        so the beam its group waits for can come in."""
        idle = [r for r in self.running if self.beams.is_idle(r)]
        if idle:
            self._preempt(idle[-1])
            preempted.append(idle[-1])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        swap = self.preemption_mode == "swap" and not self.beams.holds(request)  # beams recompute
        if swap and self.allocator.swap_out(request):
            self.num_swap_preemptions += 1  # its blocks wait in the CPU pool; num_computed_tokens is kept
        else:
            self.allocator.free(request)
            request.num_computed_tokens = 0  # recompute prompt + output from scratch
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)


@hookimpl
def infer_register_schedulers(register) -> None:
    register("fcfs", FcfsScheduler)
