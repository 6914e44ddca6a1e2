"""The scheduler, and what it hands the decoder and gets back each step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from infer.api.kv import BlockOps
from infer.api.request import FinishReason

if TYPE_CHECKING:
    from infer.api.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    request: "Request"
    num_new_tokens: int  # tokens computed for this request this step (query length)
    num_lookahead_tokens: int = 0  # speculative slots reserved past the new tokens

    @property
    def samples(self) -> bool:
        """Whether this step completes the request's known tokens (so its logits are sampled)."""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decodes first, then prefills/extends
    preempted: list["Request"] = field(default_factory=list)  # preempted in this step
    finished: list["Request"] = field(default_factory=list)  # ended without running (capacity)
    block_ops: BlockOps = field(default_factory=BlockOps)  # applied to the KV tensors before the forward

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class StepResult:
    """What the decoder returns: new tokens per sampled request (more than one when speculating)."""

    sampled: dict[str, list[int]]  # request_id -> accepted new token ids
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)  # proposals, acceptances, ...: summed by the engine
    # request_id -> tokens whose K/V are valid after this step, where fewer than all but the newest
    # (speculative: rejected draft slots are rolled back); absent: every computed token is kept
    num_computed: dict[str, int] = field(default_factory=dict)


class Scheduler(Protocol):
    """Decides, every step, which requests run and how many tokens each computes.

    `schedule` may allocate and free KV blocks (through the allocator) and preempt requests.
    `update` appends the step's tokens to the requests, applies stop conditions and frees the
    blocks of finished requests; it returns the requests that finished in this step.
    `num_lookahead_tokens` (the decoder's KV slots to reserve past the new tokens) is set by the builder.
    Optional abilities: `ResettableStats.reset_stats` starts the counters of `stats` again;
    `TokenBudgeted.set_token_budget` lets the engine size each step's tokens (`max_step_ms`). With a
    `PipeliningScheduler` the runner queues decode forwards ahead: between `schedule` and `update`,
    `next_batch_outlook` says how likely the next batch is this one, and `reserve_ahead` grows a table
    to `num_tokens` tokens, as the next `schedule` would, or returns False and changes nothing.
    """

    num_lookahead_tokens: int

    def add(self, request: "Request") -> None: ...

    def abort(self, request_id: str) -> "Request | None": ...

    def finish(self, request: "Request", reason: "FinishReason") -> None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update(self, out: SchedulerOutput, result: StepResult) -> list["Request"]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict[str, float]: ...


class BatchOutlook(enum.IntEnum):  # how likely the next step's batch is this step's (or part of it)
    UNLIKELY = 0  # there is room to admit a waiting request
    LIKELY = 1  # some wait but the batch is full: only a request that stops lets one in
    CERTAIN = 2  # nobody waits to be admitted: the batch can only shrink


@runtime_checkable
class PipeliningScheduler(Protocol):
    def next_batch_outlook(self) -> BatchOutlook: ...

    def reserve_ahead(self, request: Request, num_tokens: int) -> bool: ...


@runtime_checkable
class ResettableStats(Protocol):
    def reset_stats(self) -> None: ...


@runtime_checkable
class TokenBudgeted(Protocol):
    """A scheduler whose per-step token budget the engine may change between steps (`max_step_ms`:
    the engine sizes it to the device's measured speed). `max_num_batched_tokens` is the budget it
    schedules with: the configured one until the engine calls `set_token_budget(tokens)` (never above
    the configured one), which sets it for the steps after. `schedule` never computes more tokens than
    it allows (a budget below a decode batch still runs the decodes it can)."""

    @property
    def max_num_batched_tokens(self) -> int: ...  # a plain attribute serves

    def set_token_budget(self, tokens: int) -> None: ...


def stop_reason(request: "Request") -> FinishReason | None:
    """Why `request` must stop after its latest token, if it must (plugin API 2.2): EOS (unless `ignore_eos`)
    or a stop token, `max_tokens`, the context length. What a scheduler's `update` checks after each token it
    appends; stop strings are the engine's (they need the text)."""
    params, last = request.params, request.output_token_ids[-1]
    if not params.ignore_eos and last in request.eos_token_ids:
        return FinishReason.STOP
    if last in params.stop_token_ids:
        return FinishReason.STOP
    if len(request.output_token_ids) >= params.max_tokens:
        return FinishReason.LENGTH
    if request.max_model_len and request.num_tokens >= request.max_model_len:
        return FinishReason.LENGTH
    return None


def adapter_room(request: "Request", running: Sequence["Request"], max_adapters: int) -> bool:
    """Whether `request` may join `running` within `max_adapters` distinct adapters a step
    (`EngineConfig.max_loras`; plugin API 2.3): a scheduler admitting a request for which this is false
    would make a step the engine refuses. True for the base model, an adapter already running, or room."""
    key = request.adapter_key
    if key is None:
        return True
    keys = {r.adapter_key for r in running if r.adapter_key is not None}
    return key in keys or len(keys) < max_adapters
