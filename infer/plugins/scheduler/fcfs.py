"""`fcfs`: continuous batching, first come first served by priority, with preemption by recompute or swap.

The policy of the PagedAttention paper, ranked by priority. Requests are ranked by arrival, a
request of priority p as if it had arrived p x `--priority-aging-s` later (`SchedulerBase.rank`;
lower priority values run first); with every priority equal that is plain arrival order. Every
step, running requests (best rank first) get their next tokens, decodes before any prefill chunk;
when the allocator has no block left, the worst-ranked running request is preempted: with
`--preemption-mode swap` its blocks go to the CPU pool (recompute when that is full), else they are
freed and its prompt + output so far are computed again later (the prefix cache usually still holds
most of them). Preempted requests go back to the waiting queue by rank, so they are resumed before
anything ranked after them is admitted, and in a step that preempted only a request of a strictly
higher priority than every one preempted is admitted. A waiting request that finds no room (no
block, or `max_num_seqs` running) preempts running requests of a strictly lower priority that rank
after it, worst first, until it fits. Long prompts are split into chunks so one step never computes
more than `max_num_batched_tokens`.

Nothing starves: a request of priority p waits behind a later arrival of priority q < p for at most
(p - q) x `--priority-aging-s` (then it outranks it), plus the time the requests ranked before it
take to finish.

Admission shares what it can: a parallel sample waits for its parent's prompt and forks its
blocks; any other request adopts its longest cached prefix.
"""

from __future__ import annotations

import bisect

from infer.api import Capabilities, ScheduledSeq, SchedulerOutput
from infer.api.hookspecs import hookimpl
from infer.api.request import FinishReason, Request, RequestStatus
from infer.api.scheduling import adapter_room
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
            if budget <= 0 or (preempted and not _outranks_all(request, preempted)):
                break
            if self.beams.is_idle(request):  # preempted after its candidates were recorded: nothing to run
                continue
            if not adapter_room(request, self.running, self.config.max_loras):  # waits for an adapter to end
                continue
            wait, parent = self._fork_parent(request)
            if wait:  # a parallel sample whose parent is still computing the prompt
                continue
            if not self.ensure_fits(request):
                finished.append(request)
                continue
            num_new = self._admit_by_priority(request, parent, budget, scheduled, preempted)
            if num_new is None:
                break  # head of line: nothing behind it overtakes it
            budget += sum(s.num_new_tokens for s in scheduled if s.request.status is RequestStatus.PREEMPTED)
            scheduled = [s for s in scheduled if s.request.status is not RequestStatus.PREEMPTED]
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self.rank)
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

    def _admit_by_priority(
        self,
        request: Request,
        parent: Request | None,
        budget: int,
        scheduled: list[ScheduledSeq],
        preempted: list[Request],
    ) -> int | None:
        """`_admit`, preempting running requests of a strictly lower priority ranked after `request`
        (worst first) while it finds no room; a victim scheduled in this step leaves the step (the
        caller drops it and takes back its tokens)."""
        while True:
            if len(self.running) < self.max_num_seqs:
                num_new = self._admit(request, parent, budget)
                if num_new is not None:
                    return num_new
            victim = self.running[-1] if self.running else None
            if (
                victim is None
                or victim is parent
                or victim.params.priority <= request.params.priority
                or self.rank(victim) < self.rank(request)
            ):
                return None
            budget += sum(s.num_new_tokens for s in scheduled if s.request is victim)
            self._preempt(victim)
            preempted.append(victim)

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
        """Allocate slots for `request`, preempting the worst-ranked until it fits."""
        want = request.num_computed_tokens + num_new + self.num_lookahead_tokens
        while self.allocator.allocate_slots(request, want) is None:
            victim = self.running[-1]  # the worst rank: the latest arrival of the lowest priority
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
        bisect.insort(self.waiting, request, key=self.rank)


def _outranks_all(request: Request, preempted: list[Request]) -> bool:
    """Whether `request` may be admitted in a step that preempted: its priority strictly higher (a
    lower value) than every preempted request's. With equal priorities, nothing is admitted."""
    return all(request.params.priority < p.params.priority for p in preempted)


@hookimpl
def infer_register_schedulers(register) -> None:
    register("fcfs", FcfsScheduler)
