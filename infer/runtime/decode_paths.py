"""Which runners get the faster decode paths (`infer.api.decode_paths`), as the config
and the strategies' capabilities allow: CUDA graphs (`cuda_graphs`) and decode pipelining through
the scheduler (`pipeline`). The builder calls `attach_decode_paths` once every KV cache exists.
"""

from __future__ import annotations

from typing import Sequence

import torch

from infer.api import Capabilities, Scheduler, capabilities_of
from infer.api.config import EngineConfig
from infer.runtime.cuda_graphs import CudaGraphRunner
from infer.runtime.hybrid_attention import HybridAttention
from infer.runtime.pipeline import Pipeline
from infer.runtime.runner import ModelRunner


def attach_decode_paths(
    config: EngineConfig,
    decoder: Capabilities,  # the decoder strategy's
    runners: Sequence[ModelRunner],  # every model's, target first
    scheduler: Scheduler,
    max_rows: int,  # decode rows a step may have: max_num_seqs x (1 + lookahead), a verify step's rows
    max_model_len: int,
    null_block: int,  # the spare KV block padded rows read and write
    device: torch.device,
) -> None:
    """Capture each runner's CUDA graphs and give the target a pipeline, where allowed."""
    runner = runners[0]
    attention = runner.attention
    use_graphs = config.cuda_graphs and device.type == "cuda" and attention.capabilities.cuda_graph_safe
    if runner.adapters is not None:  # the adapter kind's layers run inside the target's graphs
        use_graphs = use_graphs and capabilities_of(runner.adapters.kind).cuda_graph_safe
    pipeline = config.pipeline_decode if config.pipeline_decode is not None else device.type == "cuda"
    pipeline = pipeline and attention.capabilities.pipeline_safe and decoder.pipeline_safe
    if runner.adapters is not None:  # the next forward's plan may run while this one is queued
        pipeline = pipeline and capabilities_of(runner.adapters.kind).pipeline_safe
    if runner.stages is not None:  # a stage's forward is micro-batches and sends between them: neither path yet
        use_graphs = pipeline = False
    # steps with prompt tokens replay as rows: the backend writes a step's K/V before attending (each row
    # sees the rows before it), and no --prefill-attention backend was chosen for them
    rows = attention.capabilities.writes_kv_first and not isinstance(attention, HybridAttention)
    for r in runners:
        # CUDA graphs: the target's decode-only steps when the decoder allows (verify steps of decode
        # rows included); a draft's proposal steps whatever the decoder does with the target.
        graphs = None
        if use_graphs and (r is not runner or decoder.cuda_graph_safe):
            graphs = CudaGraphRunner(
                r.model,
                r.attention,
                r.kv_caches,
                config.block_size,
                max_rows,
                max_model_len,
                null_block=null_block,
                device=device,
                num_layers=r.num_layers,
                adapters=r.adapters,
                # verify steps' rows (1 + lookahead a request): kernels tuned for those row counts
                tune_rows=r is runner and max_rows > config.max_num_seqs,
                # a self-draft's runner shares the target's cache: the target computes its prompts
                max_tokens=config.cuda_graph_max_tokens
                if rows and (r is runner or r.kv_caches is not runner.kv_caches)
                else 0,
            )
            graphs.capture()
        r.set_decode_paths(graphs, Pipeline(r, scheduler) if pipeline and r is runner else None)
