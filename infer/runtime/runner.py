"""ModelRunner: a scheduled step -> attention metadata -> model forward -> logits -> sampler.

Decode-only steps may take faster paths that change no token (`set_decode_paths`): a replay of
captured CUDA graphs, and a forward queued ahead by a `DecodePipeline` (`infer.runtime`).
"""

from __future__ import annotations

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
