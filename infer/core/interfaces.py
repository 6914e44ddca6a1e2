"""The small interfaces every strategy implements, and the objects that cross between them.

Each interface is documented by *when* the engine calls it and *what* it may change.
Implementations are plain classes; a factory registered through a hook builds them once per
engine, so the hot loop is ordinary method calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from infer.core.config import ModelConfig
    from infer.core.request import FinishReason, Request


# --------------------------------------------------------------------------- capabilities


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a strategy declares it can do; checked before any weight loads."""

    devices: frozenset[str] = frozenset({"cpu", "cuda"})  # device types it runs on
    phases: frozenset[str] = frozenset({"prefill", "decode"})  # attention: which phases it serves
    dtypes: frozenset[torch.dtype] | None = None  # None: any dtype
    block_sizes: frozenset[int] | None = None  # None: any KV block size
    cuda_graph_safe: bool = False  # decode step may be captured in a CUDA graph
    # decode pipelining. attention: plan() for the next step may run while the step before is still
    # queued (it writes no host memory that queued copies still read); decoder: its steps go through
    # ModelRunner.execute, one token per sequence
    pipeline_safe: bool = False
    needs_draft: bool = False  # decoder: requires --draft
    lossy: bool = False  # decoder: changes the outputs (early exit); the run report says so
    distributed: bool = True  # works under tensor parallelism
    priority: int = 0  # higher wins when a slot is resolved "auto"
    # returns None when runnable here, else the reason (missing library, wrong GPU, ...)
    available: Callable[[], str | None] | None = None

    def describe(self) -> str:
        parts = [f"devices={','.join(sorted(self.devices))}"]
        if self.phases != frozenset({"prefill", "decode"}):
            parts.append(f"phases={','.join(sorted(self.phases))}")
        if self.dtypes is not None:
            parts.append("dtypes=" + ",".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes)))
        if self.block_sizes is not None:
            parts.append("block_sizes=" + ",".join(map(str, sorted(self.block_sizes))))
        if self.cuda_graph_safe:
            parts.append("cuda-graphs")
        if self.pipeline_safe:
            parts.append("pipelined-decode")
        if self.needs_draft:
            parts.append("needs-draft")
        if self.lossy:
            parts.append("lossy (changes outputs)")
        return " ".join(parts)


DEFAULT_CAPABILITIES = Capabilities()


def capabilities_of(factory: Any) -> Capabilities:
    return getattr(factory, "capabilities", DEFAULT_CAPABILITIES)


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The shape of attention in the model being served (per rank under tensor parallelism)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    device: torch.device
    block_size: int
    max_num_seqs: int
    max_model_len: int


@dataclass(slots=True)
class AttentionBatch:
    """One step's attention layout, built by the runner. Sequences are ordered decodes first.

    A sequence's new tokens are the last `query_lens[i]` of its `seq_lens[i]` cached tokens.
    """

    query_lens: list[int]  # seq i -> new tokens this step
    seq_lens: list[int]  # seq i -> tokens in the cache after this step (context + new)
    block_tables: list[list[int]]  # seq i -> physical block ids
    block_size: int
    num_decode_seqs: int  # leading sequences with query_len == 1
    # device tensors
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens_t: torch.Tensor  # [B] int32
    block_tables_t: torch.Tensor  # [B, max_blocks] int32, rows padded with 0 (never read)
    slot_mapping: torch.Tensor  # [T] int64: token t's K/V go to slot block * block_size + offset
    positions: torch.Tensor  # [T] int64

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        max_blocks: int | None = None,
    ) -> "AttentionBatch":
        num_decode = 0
        while num_decode < len(query_lens) and query_lens[num_decode] == 1:
            num_decode += 1
        positions: list[int] = []
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s - q, s):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max_blocks if max_blocks is not None else max((len(t) for t in block_tables), default=0)
        width = max(width, 1)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            block_tables=[list(t) for t in block_tables],
            block_size=block_size,
            num_decode_seqs=num_decode,
            cu_seqlens_q=torch.tensor(cu, **i32),
            seq_lens_t=torch.tensor(seq_lens, **i32),
            block_tables_t=torch.tensor(padded, **i32).reshape(len(block_tables), width),
            slot_mapping=torch.tensor(slots, **i64),
            positions=torch.tensor(positions, **i64),
        )

    def select(self, start: int, stop: int) -> "AttentionBatch":
        """Sequences [start, stop) as a batch of their own (tensors are views or small copies)."""
        t0, t1 = sum(self.query_lens[:start]), sum(self.query_lens[:stop])
        cu = self.cu_seqlens_q[start : stop + 1] - self.cu_seqlens_q[start]
        return AttentionBatch(
            query_lens=self.query_lens[start:stop],
            seq_lens=self.seq_lens[start:stop],
            block_tables=self.block_tables[start:stop],
            block_size=self.block_size,
            num_decode_seqs=max(0, min(self.num_decode_seqs, stop) - start),
            cu_seqlens_q=cu,
            seq_lens_t=self.seq_lens_t[start:stop],
            block_tables_t=self.block_tables_t[start:stop],
            slot_mapping=self.slot_mapping[t0:t1],
            positions=self.positions[t0:t1],
        )


KVCache = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_blocks, block_size, num_kv_heads, head_dim]


class AttentionBackend(Protocol):
    """Attention over the paged KV cache.

    Built once per engine with an `AttentionSpec`. `plan` runs once per step, before the model
    forward, and may precompute anything that depends only on the batch layout. `forward` runs
    once per layer: it writes the new tokens' K/V into their slots of that layer's cache and
    returns the attention output for the new tokens (causal within a sequence, attending to the
    sequence's whole cached context).
    """

    capabilities: ClassVar[Capabilities]

    def plan(self, batch: AttentionBatch) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: KVCache,
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]


# --------------------------------------------------------------------------- KV allocation


class KVAllocator(Protocol):
    """Owns the physical KV blocks and every request's block table (`request.block_ids`).

    Called by the scheduler only. `allocate_slots` grows a request's block table so that it can
    hold `num_tokens` tokens in total, or returns None and changes nothing when there is no room
    (the scheduler then preempts). On an empty table it may first adopt cached prefix blocks and
    move `request.num_computed_tokens` past them (`num_cached_tokens` says how many, beforehand);
    a block about to be written that is shared is replaced by a copy (copy-on-write). `free`
    returns a request's blocks. Blocks are reference counted: `fork` shares a parent's blocks
    with a child (parallel samples), `reassign` swaps whole tables between requests (beams).
    `swap_out` moves a preempted request's blocks to CPU memory (False when that is full); its
    next `allocate_slots` brings them back. Every copy these imply is recorded, and the scheduler
    hands them to the engine once per step with `take_block_ops`.
    """

    block_size: int
    num_blocks: int

    def num_free_blocks(self) -> int: ...

    def allocate_slots(self, request: "Request", num_tokens: int) -> list[int] | None: ...

    def num_cached_tokens(self, request: "Request") -> int: ...

    def fork(self, parent: "Request", child: "Request", num_tokens: int) -> None: ...

    def reassign(self, pairs: list[tuple["Request", "Request"]]) -> None:
        """For each (dst, src): dst's table becomes a share of src's table as it was before the call."""
        ...

    def free(self, request: "Request") -> None: ...

    def swap_out(self, request: "Request") -> bool: ...

    def is_swapped(self, request: "Request") -> bool: ...

    def take_block_ops(self) -> "BlockOps": ...

    def can_ever_fit(self, num_tokens: int) -> bool: ...

    def can_ever_run(self, request: "Request", num_tokens: int) -> bool:
        """Whether `request` could be granted `num_tokens` slots on an empty cache."""
        ...

    def usage(self) -> "KVUsage": ...


@dataclass(slots=True)
class KVUsage:
    num_blocks: int  # physical blocks in the cache
    num_used_blocks: int  # blocks owned by at least one request
    num_reserved_slots: int  # token slots in used blocks
    num_filled_slots: int  # token slots holding a real token (a shared block counts once)
    num_saved_blocks: int = 0  # block-table entries minus used blocks: what sharing saves now
    num_cached_blocks: int = 0  # blocks the prefix cache maps (owned or evictable)
    prefix_query_tokens: int = 0  # since the start: tokens of admitted requests looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens found cached (not computed again)
    num_swapped_blocks: int = 0  # CPU blocks holding swapped-out requests

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(slots=True)
class BlockOps:
    """KV block copies to make before a step's forward, in this order, each kind one batched copy.

    Block ids of `swap_out` and `swap_in` pairs name (device block, CPU block) and (CPU block,
    device block); `copies` are (src, dst) device blocks, copy-on-write. A step never both swaps
    out and swaps in. Every model cache indexed by the block tables (a draft's too) gets them.
    """

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)


# --------------------------------------------------------------------------- scheduling


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
    """

    def add(self, request: "Request") -> None: ...

    def abort(self, request_id: str) -> "Request | None": ...

    def finish(self, request: "Request", reason: "FinishReason") -> None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update(self, out: SchedulerOutput, result: StepResult) -> list["Request"]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict[str, float]: ...

    # Optional: reset_stats() -> None, start the counters behind `stats` again (after a warm-up run).


# --------------------------------------------------------------------------- sampling


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # row i -> sampled token
    logprobs: list[dict[int, float]] | None = None  # row i -> {token: logprob}, when asked for


class Sampler(Protocol):
    """Turns one step's logits into tokens. Called once per step with the rows to sample.

    Row i belongs to `requests[i]`; `positions[i]` is the index of the output token being sampled
    (so seeded sampling does not depend on which other requests share the batch).
    """

    def sample(
        self,
        logits: torch.Tensor,  # [B, vocab] float32
        requests: list["Request"],
        positions: list[int] | None = None,
    ) -> SamplerOutput: ...

    # Optional, lets the runner pipeline decode steps (launch step N+1 before step N's tokens reach
    # the host): sample_tokens(logits, requests, positions) -> [B] int64 tensor on the device, the
    # tokens `sample` would return, queued without a host sync; or None for a batch it cannot serve.
    # Optional, needed by speculative decoding to verify draft tokens:
    # probs(logits [B, V], requests, positions) -> [B, V]: the distribution `sample` draws row i
    #   from (penalties, temperature, min-p, top-k, top-p applied; one-hot at the argmax when greedy)
    # logprobs(logits [B, V], requests, token_ids) -> list[dict]: what `sample` reports for row i
    #   had it chosen token_ids[i] ({} where the request did not ask)


# --------------------------------------------------------------------------- decoding


class ModelRunnerLike(Protocol):
    def execute(self, out: SchedulerOutput) -> StepResult: ...


@dataclass(slots=True)
class DecoderContext:
    """What a decoder factory gets: the target's runner and a way to build more models."""

    runner: ModelRunnerLike  # the target model's runner (forward + sample)
    config: Any  # EngineConfig
    # (name_or_path, num_layers=None) -> a ModelRunner over its own weights and KV cache, indexed by
    # the target's block tables (same block ids); the builder sizes every cache after the decoder is built
    build_model: Callable[..., Any] | None = None
    model_config: Any = None  # the target's ModelConfig


class Decoder(Protocol):
    """A decoding strategy: turns a scheduled step into new tokens.

    `num_lookahead_tokens` tells the scheduler how many extra KV slots to reserve per running
    request (speculative proposals). `execute` runs once per step.
    Optional: `describe` (dict, merged into the run's description and report) and
    `summarize(totals) -> dict` (run-level figures from the summed `StepResult.stats`, in `Engine.stats`).
    """

    num_lookahead_tokens: int

    def execute(self, out: SchedulerOutput) -> StepResult: ...


# --------------------------------------------------------------------------- text


@dataclass(slots=True)
class DetokenizedDelta:
    text: str  # the request's text so far, stop string removed
    stop_index: int | None = None  # output-token index that completed a stop string, if any


class Detokenizer(Protocol):
    """Turns output tokens into text, incrementally, and finds stop strings.

    `submit` hands over each request's full output token list after a step; `collect` returns
    what was submitted last, as text. A strategy may work between the two calls (in a thread),
    so the engine calls `collect` only after launching the next step's forward pass.
    """

    def submit(self, updates: list[tuple["Request", list[int]]]) -> None: ...

    def collect(self) -> dict[str, DetokenizedDelta]: ...

    def release(self, request_id: str) -> None: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- models


LAYER_KINDS = ("rms_norm", "rotary_embedding", "silu_and_mul", "linear")


@dataclass(frozen=True, slots=True)
class Layers:
    """The layer implementations a model builds itself from, resolved once per engine."""

    rms_norm: Any  # (hidden_size, eps) -> module; forward(x, residual=None)
    rotary_embedding: Any  # (head_dim, max_position, theta, scaling) -> module; forward(positions, q, k)
    silu_and_mul: Any  # () -> module; forward(x [T, 2I]) -> [T, I]
    linear: Any  # (in_features, out_features, bias=False) -> module


class CausalLM(Protocol):
    """A model as the runner sees it."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache]) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Any) -> None: ...


class ModelArchitecture(Protocol):
    """Builds a model of one family. `hf_architectures` lists the config.json names it serves;
    `presets` maps named shapes (`llama2-7b`) to config.json-style dicts."""

    hf_architectures: ClassVar[tuple[str, ...]]
    presets: ClassVar[dict[str, dict[str, Any]]]

    def __call__(self, config: "ModelConfig", layers: "Any", attention: AttentionBackend) -> CausalLM: ...


RegisterFn = Callable[[str, Any], None]  # register(name, factory)
