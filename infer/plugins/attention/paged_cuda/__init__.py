"""`paged-cuda`: attention over the paged KV cache with this project's own Triton kernels.

Per layer, `forward` launches (see `triton_kernels/`): the cache write, the
paged decode kernel over the leading `num_decode_seqs` sequences (splitting each context into
partitions when the batch is too small to fill the GPU, plus a kernel that combines them),
and the varlen causal prefill kernel over the rest (why three launches, not one:
docs/performance.md, "Paged decode attention").
Sliding windows and soft caps are the kernels' constexprs (`WINDOW`, `SOFT_CAP`): a windowed layer
runs its own compiled variant, which starts each query's walk at the oldest key its window shows
(the blocks before it are never read), and a layer without a window runs the kernels as they are
without one (the same PTX). A layer's window is the same at capture and replay, so graphs hold.
An FP8 cache (`FP8KVCache`, `--kv-cache-dtype fp8`) is the same: the cache write quantizes, decode and
prefill read e4m3 and dequantize in registers (`KV_FP8`, `FP8`: constexprs), the layer's static
scales are kernel arguments; an unsplit decode batch over it goes to `decode_e4m3` where that fits
(K and V loaded by PTX straight into MMA registers; 1.3x the Triton kernel's rate at 250 sequences on
an H200). e4m3 needs compute capability 8.9 (Ada, Hopper) or the interpreter.
Everything that depends only on the step's layout is decided once in `plan`. Decode-only steps
launch with fixed grids into scratch allocated at construction and never sync with the host, so
they can be captured in a CUDA graph (one graph per decode batch size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.api import AttentionBatch, AttentionSpec, Capabilities, KVCache
from infer.api.errors import IncompatiblePluginsError
from infer.api.hookspecs import hookimpl
from infer.api.kv_cache import FP8, kv_scales
from infer.common import env


def _available() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc}); install it with `pip install 'infer[triton]'`"
    if env.triton_interpret():  # CI: the kernels run on the CPU, interpreted
        return None
    if not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels on the CPU)"
    return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _StepPlan:
    batch: AttentionBatch
    num_decode: int  # leading sequences served by the decode kernel
    split: bool  # decode splits contexts into partitions and reduces them
    q_block_seq: torch.Tensor  # [num_q_blocks] int32: prefill query block -> sequence
    q_block_start: torch.Tensor  # [num_q_blocks] int32: query block -> first token within its sequence
    splits: int  # decode partitions per context (1: unsplit)


class PagedCudaAttention:
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        block_sizes=frozenset({8, 16, 32, 64}),
        writes_kv_first=True,  # the cache write is its own kernel, before attention
        cuda_graph_safe=True,
        pipeline_safe=True,
        sliding_window=True,
        soft_cap=True,
        fp8_kv=True,
        priority=20,
        available=_available,
    )

    def __init__(
        self,
        spec: AttentionSpec,
        split_below_programs: int | None = None,  # split when seqs x kv_heads < this; default 1.5 x SMs
        split_programs: int | None = None,  # aim split decode at this many programs; default 4 x SMs
        max_splits: int = 64,  # partitions per context at most
        decode_block_n: int = 64,  # decode key tile, tokens
        prefill_block_m: int = 64,  # prefill tile rows (tokens x GQA group)
        prefill_block_n: int = 64,  # prefill key tile, tokens
    ) -> None:
        # triton is imported here, not at module import, so the registry loads without it.
        from infer.plugins.attention.paged_cuda.kernels import cache_write, decode, decode_e4m3, prefill

        self._cache_write, self._decode, self._prefill = cache_write, decode, prefill
        self._decode_e4m3 = decode_e4m3
        assert spec.num_heads % spec.num_kv_heads == 0
        on_gpu = spec.device.type == "cuda"
        if spec.kv_cache_dtype == FP8 and on_gpu and torch.cuda.get_device_capability(spec.device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(spec.device)
            raise IncompatiblePluginsError(
                f"--attention paged-cuda reads an FP8 KV cache on GPUs of compute capability 8.9 or newer (Ada, "
                f"Hopper), and {torch.cuda.get_device_name(spec.device)} is {major}.{minor}: use --kv-cache-dtype auto"
            )
        self.spec = spec
        self.decode_block_n = decode_block_n
        self.prefill_block_m, self.prefill_block_q = prefill.prefill_tile(
            spec.num_heads, spec.num_kv_heads, prefill_block_m
        )
        self.prefill_block_n = prefill_block_n
        num_sms = torch.cuda.get_device_properties(spec.device).multi_processor_count if on_gpu else 132
        if split_below_programs is None:
            # split below 1.5 programs per SM: splitting won at 128 (sequence, KV head) programs
            # and lost at 256 on an H200 (docs/performance.md, "Split-K crossover")
            split_below_programs = 3 * num_sms // 2
        self.split_below_programs = split_below_programs
        self.num_sms = num_sms
        self.split_programs = 4 * num_sms if split_programs is None else split_programs
        # no more partitions than tiles in the longest context
        self.max_splits = max(1, min(max_splits, _cdiv(spec.max_model_len, decode_block_n)))
        # Split-K scratch for every batch size that splits, allocated once (a captured CUDA graph
        # needs fixed addresses) and viewed as [S, H, P, D] per step: S x P stays near split_programs.
        self.split_rows = min(spec.max_num_seqs, _cdiv(split_below_programs, spec.num_kv_heads))
        cells = max(
            (b * self.num_splits(b) for b in range(1, self.split_rows + 1) if self.num_splits(b) > 1), default=0
        )
        self.scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if cells:
            f32 = dict(dtype=torch.float32, device=spec.device)
            self.scratch = (
                torch.empty(cells * spec.num_heads * spec.head_dim, **f32),  # part out
                torch.empty(cells * spec.num_heads, **f32),  # part max logit
                torch.empty(cells * spec.num_heads, **f32),  # part exp sum
            )
        self._plan: _StepPlan | None = None
        self._no_prefill = torch.empty(0, dtype=torch.int32, device=spec.device)

    def num_splits(self, num_decode: int) -> int:
        """Partitions per context for a decode batch of this size (never its lengths: graph-safe)."""
        if num_decode == 0 or num_decode * self.spec.num_kv_heads >= self.split_below_programs:
            return 1
        return max(1, min(self.max_splits, _cdiv(self.split_programs, num_decode * self.spec.num_kv_heads)))

    def plan(self, batch: AttentionBatch) -> None:
        assert batch.max_seq_len <= self.spec.max_model_len, "sequence longer than spec.max_model_len"
        num_decode = batch.num_decode_seqs
        splits = self.num_splits(num_decode)
        split = self.scratch is not None and num_decode <= self.split_rows and splits > 1
        device = batch.seq_lens_t.device
        if len(batch.query_lens) > num_decode:
            seqs, starts = self._prefill.query_blocks(batch.query_lens[num_decode:], num_decode, self.prefill_block_q)
            q_block_seq = torch.tensor(seqs, dtype=torch.int32, device=device)
            q_block_start = torch.tensor(starts, dtype=torch.int32, device=device)
        else:  # decode only (every CUDA-graph step): no prefill blocks, nothing to copy
            q_block_seq = q_block_start = self._no_prefill
        self._plan = _StepPlan(
            batch=batch,
            num_decode=num_decode,
            split=split,
            q_block_seq=q_block_seq,
            q_block_start=q_block_start,
            splits=splits if split else 1,
        )

    def _scratch(self, num_decode: int, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.scratch is not None
        h, d = self.spec.num_heads, self.spec.head_dim
        out, mx, sm = self.scratch
        n = num_decode * h * splits
        return (
            out[: n * d].view(num_decode, h, splits, d),
            mx[:n].view(num_decode, h, splits),
            sm[:n].view(num_decode, h, splits),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, window: int | None = None
    ) -> torch.Tensor:
        assert self._plan is not None, "plan() first"
        assert q.stride(-1) == 1, "head_dim must be contiguous"
        k_cache, v_cache = kv_cache  # [num_blocks, block_size, Hkv, D]
        self._cache_write.cache_write(k, v, k_cache, v_cache, self._plan.batch.slot_mapping, kv_scales(kv_cache))
        return self._attend(q, kv_cache, window)

    def fuses_rotary(self) -> bool:
        """Whether `forward_with_rotary` takes this model's heads (head_dim / 2 a power of two)."""
        return self._cache_write.fits(self.spec.head_dim)

    def forward_with_rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """`forward` of q and k rotated by the Neox-style rotary embedding at `positions` (cos, sin:
        [max_position, D/2] float32 tables), the rotation done in the cache write's kernel: one
        kernel fewer per layer, the same bits as rotating first."""
        assert self._plan is not None, "plan() first"
        k_cache, v_cache = kv_cache
        q = self._cache_write.rotary_cache_write(
            positions, q, k, v, cos, sin, k_cache, v_cache, self._plan.batch.slot_mapping, kv_scales(kv_cache)
        )
        return self._attend(q, kv_cache, window)

    def _attend(self, q: torch.Tensor, kv_cache: KVCache, window: int | None) -> torch.Tensor:
        # one compiled variant per window the model declared, not per value a caller might pass
        assert window is None or window in self.spec.sliding_windows, f"window {window} not in the spec"
        plan = self._plan
        batch = plan.batch
        k_cache, v_cache = kv_cache
        scales = kv_scales(kv_cache)
        out = torch.empty_like(q)  # [T, H, D]
        tensors = (out, q, k_cache, v_cache, batch.block_tables_t, batch.seq_lens_t)  # every kernel's first six
        if not plan.split and self._decode_e4m3.fits(q, k_cache, v_cache, window, self.spec.soft_cap):
            # an FP8 cache's unsplit decode: K and V straight into MMA registers (decode_e4m3)
            self._decode_e4m3.paged_decode_e4m3(
                *tensors,
                self.spec.scale,
                num_seqs=plan.num_decode,
                scratch=None,
                block_n=self.decode_block_n,
                scales=scales,
                num_warps=self._decode_e4m3.warps(plan.num_decode * self.spec.num_kv_heads, self.num_sms),
            )
        else:
            self._decode.paged_decode(
                *tensors,
                self.spec.scale,
                num_seqs=plan.num_decode,
                scratch=self._scratch(plan.num_decode, plan.splits) if plan.split else None,
                block_n=self.decode_block_n,
                window=window,
                soft_cap=self.spec.soft_cap,
                scales=scales,
            )
        self._prefill.paged_prefill(
            *tensors,
            batch.cu_seqlens_q,
            plan.q_block_seq,
            plan.q_block_start,
            self.spec.scale,
            block_m=self.prefill_block_m,
            block_q=self.prefill_block_q,
            block_n=self.prefill_block_n,
            window=window,
            soft_cap=self.spec.soft_cap,
            scales=scales,
        )
        return out


@hookimpl
def infer_register_attention_backends(register) -> None:
    register("paged-cuda", PagedCudaAttention)
