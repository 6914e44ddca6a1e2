"""`flashinfer`: FlashInfer's paged decode and paged prefill kernels over this project's KV cache.

The cache is used as it is: a layer's (k_cache, v_cache), each [num_blocks, block_size, Hkv, D], is
FlashInfer's NHD layout with one page per block. `plan` turns the step's block tables into
FlashInfer's CSR page table (indptr / indices / last_page_len) on the host and plans two wrappers:
decode over the leading `num_decode_seqs` sequences, causal paged prefill (cached prefix included)
over the rest. `forward` writes the new K/V into the cache and runs both into one output.

Sliding windows and soft caps: FlashInfer fixes a wrapper's `window_left` (W - 1: the token at p sees
p - W + 1 .. p) and `logits_soft_cap` when it is planned, so there is one set of wrappers per window
the model uses (`spec.sliding_windows`, plus whole contexts) and `plan` plans each of them every step;
`forward(window=W)` runs that window's. The soft cap is the model's, the same in every wrapper.

CUDA graphs: decode-only steps of a graph bucket size (`infer.runtime.cuda_graphs.bucket_sizes`) run
through graph-mode decode wrappers, one per size and window (FlashInfer fixes a graph-mode wrapper's
batch size and split-KV grid), whose page tables live in buffers allocated once (sized from
max_num_seqs and max_model_len) and shared by the windows (the tables are the same). A captured
decode step stays valid as long as `plan` is called with each step's batch before its replay, as
`CudaGraphRunner` does: plan only refills those buffers. Other decode-only sizes and the decode part
of mixed steps use the eager decode wrappers.

FP8 KV cache (`FP8KVCache`): the wrappers are planned with kv_data_type float8_e4m3fn, the cache write
quantizes as the `torch` backend does, and `run` takes the layer's static k_scale and v_scale (FlashInfer
folds k_scale into the softmax scale and multiplies the output by v_scale). Paged prefill then runs on
FlashInfer's fa2 kernels: its fa3 (Hopper) kernels read an FP8 cache only with FP8 queries.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from infer.api import AttentionBatch, AttentionSpec, Capabilities, KVCache
from infer.api.decode_paths import bucket_sizes
from infer.api.hookspecs import hookimpl
from infer.api.kv_cache import FP8, kv_scales, write_kv

INT_WORKSPACE_BYTES = 8 << 20  # what FlashInfer allocates per wrapper for its plan data


@functools.cache
def _available() -> str | None:
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or an install whose own imports fail
        return f"flashinfer is not importable ({type(exc).__name__}: {exc}); install it with `pip install 'infer[gpu]'`"
    if not torch.cuda.is_available():
        return "no CUDA device: flashinfer's kernels run only on NVIDIA GPUs"
    return None


def paged_kv_layout(
    seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer's page table: indptr [B + 1], indices [indptr[-1]], last_page_len [B] in 1..block_size."""
    indptr, indices, last_page_len = [0], [], []
    for seq_len, table in zip(seq_lens, block_tables):
        num_pages = -(-seq_len // block_size)
        indices.extend(table[:num_pages])
        indptr.append(indptr[-1] + num_pages)
        last_page_len.append(seq_len - (num_pages - 1) * block_size)
    return indptr, indices, last_page_len


def _cumsum0(values: list[int]) -> list[int]:
    out = [0]
    for x in values:
        out.append(out[-1] + x)
    return out


@dataclass(slots=True)
class _Window:
    """FlashInfer's wrappers for one window (None: whole contexts), all planned with its window_left."""

    window_left: int  # FlashInfer's: the token at p sees keys p - window_left .. p; -1: all of them
    decoder: Any  # eager decode wrapper
    prefill: Any  # paged prefill wrapper
    graph_decoders: dict[int, Any] = field(default_factory=dict)  # decode batch size -> graph-mode wrapper
    # the plan data its graph-mode wrappers share (one step plans one of them per window)
    graph_int_workspace: torch.Tensor | None = None


@dataclass(slots=True)
class _StepPlan:
    batch: AttentionBatch
    num_decode: int  # leading sequences (one token each) run by the decoders
    decoders: dict[int | None, Any]  # window -> its planned decode wrapper, eager or graph-mode
    has_prefill: bool  # sequences past num_decode run by the window's prefill wrapper


class FlashInferAttention:
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        block_sizes=frozenset({1, 2, 4, 8, 16, 32, 64}),  # page_size is a runtime argument of every kernel
        writes_kv_first=True,  # the cache write is its own kernel, before attention
        cuda_graph_safe=True,
        sliding_window=True,  # window_left
        soft_cap=True,  # logits_soft_cap
        fp8_kv=True,  # kv_data_type, k_scale, v_scale
        priority=10,  # below paged-cuda: the first run JIT-compiles for about a minute
        available=_available,
    )

    def __init__(
        self,
        spec: AttentionSpec,
        workspace_bytes: int = 128 << 20,  # split-KV scratch shared by every wrapper
        prefill_backend: str = "auto",  # FlashInfer picks fa3 on Hopper, fa2 elsewhere
        cuda_graph: bool = True,  # decode-only steps of the graph sizes through graph-mode wrappers
        graph_batch_sizes: Collection[int] | None = None,  # default: the graph runner's buckets
    ) -> None:
        import flashinfer

        assert spec.num_heads % spec.num_kv_heads == 0
        self._fi = flashinfer
        self.spec = spec
        device = spec.device
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        # each graph-mode wrapper pins 8 MiB of host memory: only for the sizes a graph may replay
        sizes = bucket_sizes(spec.max_num_seqs) if graph_batch_sizes is None else graph_batch_sizes
        self.graph_batch_sizes = frozenset(n for n in sizes if n <= spec.max_num_seqs) if cuda_graph else frozenset()
        self.kv_dtype = spec.kv_cache_dtype or spec.dtype
        if self.kv_dtype == FP8 and prefill_backend == "auto":
            prefill_backend = "fa2"  # fa3 reads an FP8 cache only with FP8 queries
        self.windows = {w: self._wrappers(w, prefill_backend) for w in (None, *spec.sliding_windows)}
        if self.graph_batch_sizes:
            max_pages = -(-spec.max_model_len // spec.block_size)
            i32 = dict(dtype=torch.int32, device=device)
            self.graph_indptr = torch.zeros(spec.max_num_seqs + 1, **i32)  # [S + 1]
            self.graph_indices = torch.zeros(spec.max_num_seqs * max_pages, **i32)  # [S * max_pages]
            self.graph_last_page_len = torch.zeros(spec.max_num_seqs, **i32)  # [S]
        self._plan: _StepPlan | None = None

    def _wrappers(self, window: int | None, prefill_backend: str) -> _Window:
        fi = self._fi
        int_workspace = None
        if self.graph_batch_sizes:
            int_workspace = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.spec.device)
        return _Window(
            window_left=-1 if window is None else window - 1,
            decoder=fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD"),
            prefill=fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend),
            graph_int_workspace=int_workspace,
        )

    def _graph_decoder(self, window: _Window, num_seqs: int) -> Any:
        wrapper = window.graph_decoders.get(num_seqs)
        if wrapper is None:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=self.graph_indptr[: num_seqs + 1],
                paged_kv_indices_buffer=self.graph_indices,
                paged_kv_last_page_len_buffer=self.graph_last_page_len[:num_seqs],
            )
            wrapper.reset_workspace_buffer(self.workspace, window.graph_int_workspace)
            window.graph_decoders[num_seqs] = wrapper
        return wrapper

    def plan(self, batch: AttentionBatch) -> None:
        spec, bs, n = self.spec, batch.block_size, batch.num_decode_seqs
        dec_indptr, dec_indices, dec_last = paged_kv_layout(batch.seq_lens[:n], batch.block_tables[:n], bs)
        pre_indptr, pre_indices, pre_last = paged_kv_layout(batch.seq_lens[n:], batch.block_tables[n:], bs)
        parts = [dec_indices, pre_indices, dec_indptr, dec_last, _cumsum0(batch.query_lens[n:]), pre_indptr, pre_last]
        host = torch.tensor([x for part in parts for x in part], dtype=torch.int32)
        if spec.device.type == "cuda":
            host = host.pin_memory()  # copies from it run asynchronously
        # FlashInfer reads indptr / last_page_len on the host and only the page indices on the device:
        # one copy for the indices (no blocking copy inside a graph-mode plan), the rest stays here.
        num_indices = len(dec_indices) + len(pre_indices)
        indices = host[:num_indices].to(spec.device, non_blocking=True)
        dec_indices, pre_indices = torch.split(indices, [len(dec_indices), len(pre_indices)])
        tables = torch.split(host[num_indices:], [len(p) for p in parts[2:]])
        dec_indptr, dec_last, qo_indptr, pre_indptr, pre_last = tables
        heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim, bs)
        common = dict(
            q_data_type=spec.dtype, kv_data_type=self.kv_dtype, sm_scale=spec.scale, logits_soft_cap=spec.soft_cap
        )
        graph = n == batch.num_seqs and n in self.graph_batch_sizes
        graph = graph and len(dec_indices) <= len(self.graph_indices)
        decoders = {}
        has_prefill = n < batch.num_seqs
        for window, w in self.windows.items():  # each window's wrappers, every step
            kw = dict(common, window_left=w.window_left)
            if n:
                decoders[window] = self._graph_decoder(w, n) if graph else w.decoder
                decoders[window].plan(dec_indptr, dec_indices, dec_last, *heads, **kw)
            if has_prefill:
                w.prefill.plan(qo_indptr, pre_indptr, pre_indices, pre_last, *heads, causal=True, **kw)
        self._plan = _StepPlan(batch=batch, num_decode=n, decoders=decoders, has_prefill=has_prefill)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, window: int | None = None
    ) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() first"
        write_kv(kv_cache, k, v, plan.batch.slot_mapping)
        out = q.new_empty(q.shape)  # [T, H, D]
        n = plan.num_decode
        scales = dict(zip(("k_scale", "v_scale"), kv_scales(kv_cache))) if self.kv_dtype == FP8 else {}
        if n:
            plan.decoders[window].run(q[:n], kv_cache, out=out[:n], **scales)
        if plan.has_prefill:
            self.windows[window].prefill.run(q[n:], kv_cache, out=out[n:], **scales)
        return out


@hookimpl
def infer_register_attention_backends(register) -> None:
    register("flashinfer", FlashInferAttention)
