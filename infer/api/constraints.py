"""Logits processors: per-request constraints applied between the model and the sampler."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from infer.api.config import EngineConfig
    from infer.api.request import Request


@dataclass(frozen=True, slots=True)
class ProcessorContext:
    """What a logits processor factory gets, once per engine."""

    tokenizer: Any  # the run's HF tokenizer; None when the model has none on disk
    vocab_size: int  # the logits' width (may exceed the tokenizer's: the ids past it are never valid text)
    eos_token_ids: frozenset[int]
    device: Any  # torch.device of the logits
    config: "EngineConfig | None" = None  # the engine's; None outside an engine (a kit, a test)


@dataclass(slots=True)
class LogitsRow:
    """One logits row to constrain: the request's next token after `draft` (speculative decoding
    verifies the positions after each prefix of a proposal; elsewhere `draft` is empty)."""

    index: int  # the row in the step's logits
    request: "Request"
    state: Any  # what the processor's `admit` returned for this request
    draft: Sequence[int] = ()  # proposed tokens after the request's output tokens, before this row


@dataclass(frozen=True, slots=True)
class AheadRow:
    """An admitted request's new tokens, as they reach the host (`AheadProcessor.ahead`). Plugin API 2.5."""

    request: "Request"
    state: Any  # what the processor's `admit` returned for this request
    tokens: Sequence[int]  # the tokens this step gave it, in order: its `output_token_ids` may not hold them yet


class LogitsProcessor(Protocol):
    """Masks or shifts logits for the requests that ask for it. Every installed processor is built
    with the engine (factory(ctx: ProcessorContext)); none of them runs for a request that no
    processor admitted.

    `admit` runs when a request is added: it returns the request's state (a grammar matcher, the
    token ids to ban ...) or None when the request does not ask for this processor, and raises
    `RequestError` naming the field and the fix for a constraint it cannot serve. `apply` runs once
    per step, before the sampler, on the rows of the admitted requests, in place; it reads the
    request's output tokens itself (a state catches up with tokens it has not seen), so a step
    that emits several tokens at once (speculation) needs nothing more. A row's distribution must
    keep at least one finite logit. A processor serving `SamplingParams.structured` says so with a
    class attribute `serves = ("structured",)` (`ServingProcessor`): a structured request no such
    processor admits is refused (its `backend` names one that is not installed).
    """

    def admit(self, request: "Request") -> Any | None: ...

    def apply(self, logits: Tensor, rows: Sequence[LogitsRow]) -> None: ...


@runtime_checkable
class ServingProcessor(Protocol):
    """A logits processor that answers for `SamplingParams` fields: `serves` names them ("structured":
    `SamplingParams.structured`). A request asking for one that no such processor admits is refused; a
    processor without `serves` answers for none (it may still admit requests, on fields of its own)."""

    serves: tuple[str, ...]


@runtime_checkable
class KitParams(Protocol):
    """A logits processor class that names a request it admits, for the conformance kit (`pytest
    --infer-kit logits_processor=NAME`): `kit_params` are that request's `SamplingParams` fields
    (`{"logit_bias": {70: 5.0}}`). The kit refuses a processor without them."""

    kit_params: dict[str, Any]


@runtime_checkable
class PreparingProcessor(Protocol):
    """A logits processor whose `admit` needs slow work first (a grammar to compile) that must not
    stall the step loop. `prepare` runs when a request is added, on the engine's thread, before
    `admit`; it returns None when the request needs nothing prepared, else a Future that is done
    when `admit` can run at once (the work runs elsewhere: a pool of the processor's own). Until
    every such future is done the request waits outside the running batch; then `admit` runs. A
    future that raises refuses the request with its message (raise `RequestError` naming the field
    and the fix). The engine cancels the future when the request is aborted before it is done,
    and when it is not done within `EngineConfig.structured_compile_timeout_s` (the request is then
    refused with that limit named)."""

    def prepare(self, request: "Request") -> Future | None: ...


@runtime_checkable
class AheadProcessor(Protocol):
    """A logits processor whose host work for a step can start before that step is scheduled.
    `ahead(rows)` runs on the engine's thread as soon as a step's sampled tokens reach the host, before
    the engine appends them to the requests: one `AheadRow` for each request this processor admitted
    that got tokens. It starts the work on threads of its own (a grammar matcher taking the tokens and
    filling the mask for the next one) and returns at once, so the work overlaps the engine's own host
    work (outputs, the scheduler, the next step's inputs) and the next forward. The next `apply` waits
    for it and uses what still holds (the request is in the step, with no tokens since); it does the
    rest itself. A request that then stops or leaves the batch only wastes the work: `apply` gives the
    same rows the same masks whether or not `ahead` ran (`apply` may not rely on it). The rows' states
    are the processor's alone until that `apply` returns. Plugin API 2.5."""

    def ahead(self, rows: Sequence[AheadRow]) -> None: ...
