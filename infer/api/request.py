"""Requests and their outputs: what crosses the engine's public boundary (with SamplingParams,
defined beside the other inputs in `infer.api.params`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from infer.api.params import SamplingParams  # re-exported: plugins import it from here


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted by the caller
    CAPACITY = "capacity"  # the KV cache cannot hold this request even alone


@dataclass(slots=True, eq=False)
class Request:
    """One sequence inside the engine. Parallel samples (n > 1) are one Request each.

    Compared by identity: a request is one entity, and the scheduler's queue look-ups (`in`,
    `remove`) over hundreds of running requests would otherwise compare every field of each."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # monotonic arrival index: lower arrived earlier (preemption order)
    eos_token_ids: frozenset[int] = frozenset()
    seed: int = 0  # effective sampling seed (params.seed or drawn by the engine)
    max_model_len: int = 0  # context length limit (prompt + output)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # i -> prompt token i + 1's, as scored
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_ids: list[int] = field(default_factory=list)  # block table: logical block i -> physical id
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # prompt tokens whose K/V it found computed when first scheduled (a cached prefix, a parent's fork);
    # None until then
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    # parallel samples and beams: the prompt's first request, whose blocks this one shares (forks)
    fork_parent: "Request | None" = field(default=None, repr=False)
    constraints: tuple[tuple[Any, Any], ...] = field(default=(), repr=False)  # (logits processor, its state)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when a step first scheduled it (perf_counter; API 2.6)
    # an embedding request's (params.pooling): the hidden states of its first prompt positions, as computed
    pooled_hidden: list[Any] = field(default_factory=list, repr=False)
    num_pooled_rows: int = 0
    arrival_time: float = 0.0
    finish_time: float | None = None
    # the adapter it runs with (plugin API 2.3, `infer.api.adapters`), and the engine's key for that
    # load of it (unique per adapter loaded: a name unloaded and loaded again gets a new one)
    lora_request: Any = None
    adapter_key: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def computes_whole_prompt(self) -> bool:
        """A prefix cache must not serve this request: it reads every prompt position's output (prompt
        logprobs, an embedding's hidden states), which a cached prefix does not keep (plugin API 2.2)."""
        return self.params.prompt_logprobs is not None or self.params.pooling is not None

    @property
    def prefix_key(self) -> tuple[Any, ...] | None:
        """What a prefix cache keys this request's blocks under besides their tokens (plugin API 2.3):
        blocks of requests whose keys differ are never shared (an adapter changes every K/V)."""
        return None if self.adapter_key is None else ("adapter", self.adapter_key)

    def token_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "capacity", or None while running
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when this request was rejected; the others are unaffected
    prompt_logprobs: list[dict[int, float] | None] | None = None  # None, then prompt token i's (i >= 1); if asked
    num_cached_tokens: int | None = None  # prompt tokens not computed: found in the prefix cache (or shared)
    embedding: list[float] | None = None  # an embedding request's vector (`SamplingParams.pooling`)
    metrics: dict[str, float] = field(default_factory=dict)  # queue_s, ttft_s, latency_s, ...


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # [] for a refused request


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """`LLM.embed`'s output for one prompt (vLLM's shape: `out.outputs.embedding`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    error: str | None = None  # set when this prompt was refused; the others are unaffected

    @classmethod
    def of(cls, output: RequestOutput) -> "EmbeddingRequestOutput":
        return cls(
            output.request_id,
            output.prompt,
            output.prompt_token_ids,
            EmbeddingOutput(output.embedding or []),
            output.finished,
            output.error,
        )
