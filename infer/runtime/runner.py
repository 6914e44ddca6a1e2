"""ModelRunner: a scheduled step -> attention metadata -> model forward -> logits -> sampler.

Decode-only steps may take faster paths that change no token (`set_decode_paths`): a replay of
captured CUDA graphs, and a forward queued ahead by a `DecodePipeline` (`infer.runtime`).

Under pipeline parallelism (`--pp N`) every stage runs each forward (rank 0 sends it to the others, as
under --tp) over its own layers, in micro-batches: contiguous runs of the step's tokens, a sequence's
prompt split between two the way a chunked prefill splits it. A stage takes each micro-batch's
activations from the stage before, runs it, and hands it on at once, so stage i works on micro-batch
m while stage i + 1 works on m - 1; the last stage sends the logits (and kept hidden rows) back to
the first, which samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.api import (
    AttentionBackend,
    AttentionBatch,
    CausalLM,
    DecodeGraphs,
    DecodePipeline,
    DeviceWaits,
    Executor,
    KVCache,
    LocalExecutor,
    PipelineLink,
    PipelineStage,
    Sampler,
    SchedulerOutput,
    StepResult,
)
from infer.api.constrain import constrain, constrain_ahead, is_constrained
from infer.api.pooling import hidden_rows, keep_hidden
from infer.api.prompt_logprobs import prompt_rows, take_prompt_logprobs
from infer.api.runner import ForwardSeq, StepInputs
from infer.common import cpus
from infer.core.adapters import Adapters


@dataclass(frozen=True, slots=True)
class StageRun:
    """How a runner's forwards cross the pipeline stages: this process's stage of the model, the links
    beside it, how many micro-batches a step is cut into, and the shapes that travel between stages."""

    link: PipelineLink
    stage: PipelineStage
    micro_batches: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype


def micro_batches(step: StepInputs, count: int) -> list[StepInputs]:
    """`step` cut into at most `count` runs of its tokens, as even as they go; a sequence cut in two is
    two chunks of its query (the second attends to the first's KV, written by the time it runs).
    Logits and hidden rows are each micro-batch's own, in order."""
    total = len(step.input_ids)
    count = max(1, min(count, total))
    bounds = [total * i // count for i in range(count + 1)]
    parts, seq, offset = [], 0, 0  # the sequence being cut, and its tokens given to earlier parts
    for lo, hi in zip(bounds, bounds[1:]):
        part = StepInputs([], [], [], [], [], step.num_layers, False)
        part.input_ids = step.input_ids[lo:hi]
        if step.input_ids_t is not None:  # the ids not on the host yet (a draft's or a verify step's)
            part.input_ids_t = step.input_ids_t[lo:hi]
        at = lo
        while at < hi:
            take = min(step.query_lens[seq] - offset, hi - at)
            part.query_lens.append(take)
            part.seq_lens.append(step.seq_lens[seq] - step.query_lens[seq] + offset + take)
            part.block_tables.append(step.block_tables[seq])
            if step.adapter_slots:
                part.adapter_slots.append(step.adapter_slots[seq])
            at, offset = at + take, offset + take
            if offset == step.query_lens[seq]:
                seq, offset = seq + 1, 0
        part.logits_rows = [r - lo for r in step.logits_rows if lo <= r < hi]
        part.hidden_rows = [r - lo for r in step.hidden_rows if lo <= r < hi]
        parts.append(part)
    return parts


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
        executor: Executor | None = None,  # how each forward reaches every rank (None: it runs here alone)
        waits: DeviceWaits | None = None,  # the engine's: announced before the sampler waits for the device
        kv_scales: list[tuple[float, float]] | None = None,
        pools: bool = False,  # keeps embedding requests' hidden states (the target's runner; not a draft's)
        adapters: Adapters | None = None,  # the run's adapters, whose layers its model calls (the target's)
        stages: StageRun | None = None,  # --pp N > 1: this process's stage, and the links beside it
    ) -> None:
        self.model = model
        self.attention = attention
        self.kv_caches = kv_caches
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.num_layers = num_layers
        self.executor = executor if executor is not None else LocalExecutor()
        self.waits = waits if waits is not None else DeviceWaits()
        # (k_scale, v_scale) per layer for an FP8 KV cache: its checkpoint's calibrated scales (None: 1.0)
        self.kv_scales = kv_scales
        self.pools = pools
        self.adapters = adapters
        self.stages = stages
        self.graphs: DecodeGraphs | None = None  # replays decode-only steps (`set_decode_paths`)
        self.pipeline: DecodePipeline | None = None  # queues the next decode forward ahead
        # on the CPU, a governor that keeps torch's threads off cores other processes take
        self.threads: cpus.Governor | None = None

    def set_decode_paths(self, graphs: DecodeGraphs | None = None, pipeline: DecodePipeline | None = None) -> None:
        """Called once, after the KV caches exist (`infer.runtime.decode_paths` does, for the builder)."""
        self.graphs = graphs
        self.pipeline = pipeline

    def release(self) -> None:
        """Give this runner's device memory back now: the CUDA graphs and their pool, then the storage
        of the weights, the buffers and the KV cache, whoever still holds the tensors (a caller's frame,
        a traceback, a backend's views). The runner cannot run again. A self-draft shares the target's
        model and cache: releasing both is the same as releasing one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a forward queued ahead may still read the cache
        if self.graphs is not None:
            self.graphs.release()
        self.discard_ahead()
        tensors = [*self.model.parameters(), *self.model.buffers(), *(t for layer in self.kv_caches for t in layer)]
        for tensor in tensors:
            tensor.untyped_storage().resize_(0)
        self.kv_caches.clear()

    @torch.inference_mode()
    def forward(self, seqs: list[ForwardSeq], input_ids_t: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model over `seqs` (decodes first) on every rank; returns logits
        [sum(prompt_rows + logits_rows), V] float32. `input_ids_t`: the step's ids as a device tensor
        (decode pipelining; seqs' token_ids unused)."""
        step = self.step_inputs(seqs, input_ids_t)
        with self.executor.forwarding(step):  # under tensor parallelism: the other ranks get the step first
            logits = self.run(step)
        self._keep_hidden(seqs, step)
        return logits

    def step_inputs(self, seqs: list[ForwardSeq], input_ids_t: torch.Tensor | None = None) -> StepInputs:
        """The flat inputs of one forward over `seqs`, and whether its captured CUDA graphs can run it."""
        graphs = self.graphs
        if graphs is None:
            use_graphs = False
        elif all(len(s.token_ids) == 1 and s.logits_rows == 1 for s in seqs):
            use_graphs = graphs.can_run(len(seqs))
        else:  # prompt tokens (or verify tokens) too: each token a row, when the step is small enough
            use_graphs = graphs.takes(
                sum(len(s.token_ids) for s in seqs), sum(s.logits_rows + s.prompt_rows for s in seqs)
            )
        step = StepInputs([], [], [], [], [], self.num_layers, use_graphs, input_ids_t)
        for seq in seqs:
            begin = len(step.input_ids)
            step.input_ids.extend(seq.token_ids)
            step.query_lens.append(len(seq.token_ids))
            step.seq_lens.append(seq.start + len(seq.token_ids))
            step.block_tables.append(seq.request.block_ids)
            end = len(step.input_ids)
            step.logits_rows.extend(range(end - seq.logits_rows - seq.prompt_rows, end))
            kept = hidden_rows(seq.request, seq.start, len(seq.token_ids)) if self.pools and not self.num_layers else 0
            if kept:  # the chunk's last `kept` prompt positions (its first ones may be kept from before)
                first = max(seq.start, seq.request.num_pooled_rows) - seq.start
                step.hidden_rows.extend(range(begin + first, begin + first + kept))
        if step.hidden_rows:
            step.use_graphs = False  # a graph returns logits alone
        if self.adapters is not None:
            step.adapter_slots, step.adapter_loads = self.adapters.assign([s.request.adapter_key for s in seqs])
        return step

    def _keep_hidden(self, seqs: list[ForwardSeq], step: StepInputs) -> None:
        """Hand the hidden states `run` kept to the embedding requests they belong to, in `step_inputs`' order."""
        if not step.hidden_rows:
            return
        assert step.hidden is not None
        # in host memory, which the KV cache's sizing leaves alone; a copy per request, so that no request
        # keeps the step's others alive (the copy waits for the forward, as the sampler is about to)
        hidden = step.hidden.to("cpu")
        step.hidden = None
        at = 0
        for seq in seqs:
            kept = hidden_rows(seq.request, seq.start, len(seq.token_ids))
            if kept:
                keep_hidden(seq.request, hidden[at : at + kept].clone())
                at += kept

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """The forward itself, on this rank alone (every tensor-parallel rank runs this; `forward` gets the
        step to the others first): logits [len(logits_rows), vocab] float32."""
        if self.threads is not None:
            self.threads.tick()
        if self.adapters is not None:  # every rank: the step's loads into device slots, then the kind's plan
            rows = self.graphs.rows(sum(step.query_lens)) if step.use_graphs and self.graphs is not None else None
            self.adapters.prepare(step.adapter_loads, step.adapter_slots, step.query_lens, rows)
        if step.use_graphs:
            assert self.graphs is not None
            args = (step.input_ids, step.seq_lens, step.block_tables, step.input_ids_t)
            if len(step.query_lens) == len(step.logits_rows) == sum(step.query_lens):  # a token and its logits a seq
                return self.graphs.run(*args)
            return self.graphs.run(*args, query_lens=step.query_lens, logits_rows=step.logits_rows)
        if self.stages is not None:
            return self._run_stages(step, self.stages)
        batch = AttentionBatch.build(step.query_lens, step.seq_lens, step.block_tables, self.block_size, self.device)
        self.attention.plan(batch)
        ids = step.input_ids_t
        if ids is None:
            ids = torch.tensor(step.input_ids, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(ids, batch.positions, self.kv_caches, step.num_layers)  # [T, hidden]
        if step.hidden_rows:
            step.hidden = hidden[torch.tensor(step.hidden_rows, device=self.device)]
        if not step.logits_rows:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(step.logits_rows, device=self.device)])

    def _run_stages(self, step: StepInputs, stages: StageRun) -> torch.Tensor:
        """This stage's part of the forward (`run` under --pp), micro-batch by micro-batch. The first
        stage returns the logits (and leaves the kept hidden rows in `step.hidden`); the others return
        an empty tensor."""
        link, stage = stages.link, stages.stage
        parts = micro_batches(step, stages.micro_batches)
        for part in parts:
            tokens = len(part.input_ids)
            batch = AttentionBatch.build(
                part.query_lens, part.seq_lens, part.block_tables, self.block_size, self.device
            )
            self.attention.plan(batch)
            carried = None if stage.is_first else link.recv_activations(tokens, stages.hidden_size, stages.dtype)
            ids = part.input_ids_t
            if ids is None:
                ids = torch.tensor(part.input_ids, dtype=torch.int64, device=self.device)
            out = self.model.forward(ids, batch.positions, self.kv_caches, None, carried=carried)
            if not stage.is_last:
                link.send_activations(out)
                continue
            if part.logits_rows:
                link.send_rows(self.model.compute_logits(out[torch.tensor(part.logits_rows, device=self.device)]))
            if part.hidden_rows:
                link.send_rows(out[torch.tensor(part.hidden_rows, device=self.device)])
        logits: list[torch.Tensor | None] = []
        hidden: list[torch.Tensor | None] = []
        if stage.is_first:  # the last stage's rows, in the order it sent them (None: this rank samples nothing)
            for part in parts:
                if part.logits_rows:
                    logits.append(link.recv_rows((len(part.logits_rows), stages.vocab_size), torch.float32))
                if part.hidden_rows:
                    hidden.append(link.recv_rows((len(part.hidden_rows), stages.hidden_size), stages.dtype))
        link.finish()
        logits, hidden = [t for t in logits if t is not None], [t for t in hidden if t is not None]
        if hidden:
            step.hidden = torch.cat(hidden)
        if not logits:
            return torch.empty(0, 0, dtype=torch.float32, device=self.device)
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def execute(self, out: SchedulerOutput) -> StepResult:
        seqs = []
        for s in out.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            tokens = [r.token_at(start)] if s.num_new_tokens == 1 else r.all_token_ids[start : start + s.num_new_tokens]
            seqs.append(ForwardSeq(r, tokens, start, 1 if s.samples else 0, prompt_rows(r, start, len(tokens))))
        logits = self.pipeline.take(seqs) if self.pipeline is not None else None
        if not seqs:
            return StepResult(sampled={})
        if logits is None:  # `forward`, inline: the data path stays short
            step = self.step_inputs(seqs)
            with self.executor.forwarding(step):
                logits = self.run(step)
            self._keep_hidden(seqs, step)
        logits = take_prompt_logprobs(logits, seqs)  # the rows left: one per request that samples
        sampled_requests = [s.request for s in seqs if s.logits_rows]
        if not sampled_requests:
            return StepResult(sampled={})
        constrained = is_constrained(sampled_requests)
        if constrained:  # the masks are filled on the host while the forward runs (most of them ahead, below)
            constrain(logits, sampled_requests)
        token_ids = self.pipeline.sample(logits, seqs) if self.pipeline is not None else None
        if token_ids is not None:
            if constrained:  # the next step's masks start now, beside the engine's host work
                constrain_ahead(sampled_requests, [[t] for t in token_ids])
            return StepResult(sampled={r.request_id: [t] for r, t in zip(sampled_requests, token_ids)})
        self.waits.waiting()  # the sampler's copy to the host waits for the forward (the pipeline announces its own)
        result = self.sampler.sample(logits, sampled_requests)
        if constrained:
            constrain_ahead(sampled_requests, [[t] for t in result.token_ids])
        sampled = {r.request_id: [t] for r, t in zip(sampled_requests, result.token_ids)}
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {
                r.request_id: [lp] for r, lp in zip(sampled_requests, result.logprobs) if r.params.logprobs is not None
            }
        return StepResult(sampled=sampled, logprobs=logprobs)

    def discard_ahead(self) -> None:
        """Drop a forward queued ahead (its step failed, or a decoder runs a forward of its own instead)."""
        if self.pipeline is not None:
            self.pipeline.discard()
