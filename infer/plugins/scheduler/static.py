"""`static`: fixed batches run to completion — the way inference ran before continuous batching.

A batch is formed only when the previous one has fully finished: up to `max_num_seqs` waiting
requests whose whole maximum length (prompt + max_tokens) can be reserved now. The batch is
prefilled in one step and decoded until its last request ends, while finished slots sit idle.
Kept as the baseline that continuous batching is measured against.
"""

from __future__ import annotations

from infer.api import Capabilities, ScheduledSeq, SchedulerOutput
from infer.api.hookspecs import hookimpl
from infer.api.request import FinishReason, Request, RequestStatus
from infer.api.scheduling import adapter_room
from infer.plugins.scheduler.base import SchedulerBase


class StaticScheduler(SchedulerBase):
    capabilities = Capabilities()

    def schedule(self) -> SchedulerOutput:
        finished: list[Request] = []
        if not self.running:
            finished = self._form_batch()
        scheduled = [
            ScheduledSeq(r, r.num_tokens - r.num_computed_tokens, self.num_lookahead_tokens)
            for r in self.running
            if r.num_tokens > r.num_computed_tokens  # a beam waiting for its group has nothing to compute
        ]
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return SchedulerOutput(scheduled=scheduled, finished=finished, block_ops=self.allocator.take_block_ops())

    def _form_batch(self) -> list[Request]:
        finished: list[Request] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not adapter_room(request, self.running, self.config.max_loras):  # the next batch takes it
                break
            if not self.ensure_fits(request):
                finished.append(request)
                continue
            limit = request.num_prompt_tokens + request.params.max_tokens + self.num_lookahead_tokens
            if request.max_model_len:
                limit = min(limit, request.max_model_len + self.num_lookahead_tokens)
            if not self.allocator.can_ever_fit(limit):
                if self.running:  # its whole length never fits: it runs alone, with the whole cache
                    break
                limit = self.allocator.num_blocks * self.allocator.block_size
            if self.allocator.allocate_slots(request, limit) is None:
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return finished

    def update(self, out, result):
        finished = super().update(out, result)
        for request in list(self.running):  # grow reservations that could not be made up front
            need = request.num_tokens + self.num_lookahead_tokens
            if self.allocator.allocate_slots(request, need) is None:
                self.finish(request, FinishReason.CAPACITY)
                finished.append(request)
        return finished


@hookimpl
def infer_register_schedulers(register) -> None:
    register("static", StaticScheduler)
