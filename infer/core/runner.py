"""ModelRunner: a scheduled step -> attention metadata -> model forward -> logits -> sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infer.core.interfaces import (
    AttentionBackend,
    AttentionBatch,
    CausalLM,
    KVCache,
    Sampler,
    SchedulerOutput,
    StepResult,
)
from infer.core.request import Request


@dataclass(slots=True)
class ForwardSeq:
    """One sequence's slice of a forward pass: tokens [start, start + len(token_ids)) of it."""

    request: Request
    token_ids: list[int]  # the tokens computed (query)
    start: int  # position of the first one
    logits_rows: int  # how many trailing positions need logits (0: none, 1: the last, k: the last k)


@dataclass(slots=True)
class StepInputs:
    """One forward's flat inputs. Under tensor parallelism rank 0 broadcasts these and every rank runs them."""

    input_ids: list[int]  # [T], sequences one after another
    query_lens: list[int]  # seq i -> tokens computed
    seq_lens: list[int]  # seq i -> tokens in the cache after this forward
    block_tables: list[list[int]]  # seq i -> block ids
    logits_rows: list[int]  # which of the T tokens get logits, in order
    num_layers: int | None  # run only the first layers (early exit, self-draft); None: all
    use_graphs: bool  # a decode-only step replayed from a CUDA graph


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        kv_caches: list[KVCache],
        sampler: Sampler,
        block_size: int,
        device: torch.device,
        num_layers: int | None = None,  # run only the first layers (early exit)
    ) -> None:
        self.model = model
        self.attention = attention
        self.kv_caches = kv_caches
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.num_layers = num_layers
        self.graphs: Any = None  # a CudaGraphRunner for decode-only steps, when enabled

    @torch.inference_mode()
    def forward(self, seqs: list[ForwardSeq]) -> torch.Tensor:
        """Run the model over `seqs` (decodes first); returns logits [sum(logits_rows), vocab] float32."""
        use_graphs = self.graphs is not None and self.graphs.can_run(len(seqs)) and all(
            len(s.token_ids) == 1 and s.logits_rows == 1 for s in seqs
        )
        step = StepInputs([], [], [], [], [], self.num_layers, use_graphs)
        for seq in seqs:
            step.input_ids.extend(seq.token_ids)
            step.query_lens.append(len(seq.token_ids))
            step.seq_lens.append(seq.start + len(seq.token_ids))
            step.block_tables.append(seq.request.block_ids)
            end = len(step.input_ids)
            step.logits_rows.extend(range(end - seq.logits_rows, end))
        # rank 0 under tensor parallelism: the model's mirror sends the step to every rank, then runs it
        mirror = getattr(self.model, "mirror", None)
        return self.run(step) if mirror is None else mirror.forward(self, step)

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """The forward itself (every tensor-parallel rank runs this): logits [len(logits_rows), vocab] float32."""
        if step.use_graphs:
            return self.graphs.run(step.input_ids, step.seq_lens, step.block_tables)
        batch = AttentionBatch.build(step.query_lens, step.seq_lens, step.block_tables, self.block_size, self.device)
        self.attention.plan(batch)
        ids = torch.tensor(step.input_ids, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(ids, batch.positions, self.kv_caches, step.num_layers)  # [T, hidden]
        if not step.logits_rows:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(step.logits_rows, device=self.device)])

    def execute(self, out: SchedulerOutput) -> StepResult:
        seqs = []
        for s in out.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            tokens = [r.token_at(start)] if s.num_new_tokens == 1 else r.all_token_ids[start : start + s.num_new_tokens]
            seqs.append(ForwardSeq(r, tokens, start, 1 if s.samples else 0))
        if not seqs:
            return StepResult(sampled={})
        logits = self.forward(seqs)
        sampled_requests = [s.request for s in seqs if s.logits_rows]
        if not sampled_requests:
            return StepResult(sampled={})
        result = self.sampler.sample(logits, sampled_requests)
        sampled = {r.request_id: [t] for r, t in zip(sampled_requests, result.token_ids)}
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {
                r.request_id: [lp] for r, lp in zip(sampled_requests, result.logprobs) if r.params.logprobs is not None
            }
        return StepResult(sampled=sampled, logprobs=logprobs)
