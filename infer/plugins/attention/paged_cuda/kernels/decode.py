"""Paged decode attention: one new query token per sequence, read through its block table.

Grid: (sequence, kv_head, partition). One program serves the whole GQA group of a KV head, so
each K/V row is read from memory once for all `group` query heads. It walks its partition of
the context in tiles of BLOCK_N tokens gathered through the block table (a tile spans
BLOCK_N // block_size blocks, or part of one; every row is head_dim contiguous elements, so
loads can be 16-byte vectors along D), keeping an online softmax in fp32 (exp2, log2e folded into
the scale). When batch x kv_heads cannot fill the GPU, each sequence's context is split into
`num_splits` partitions (the grid's third axis, fixed for a batch size so a captured graph stays
valid); a partition spans cdiv(cdiv(seq_len, num_splits), BLOCK_N) tiles, worked out in the kernel
from the sequence's current length, so every split has work however long the context is now.
Each writes its normalised output plus its max and sum, and `_reduce_kernel` combines them.
Under a sliding window (`WINDOW`, a constexpr: one compiled variant per window) the walk starts at
the oldest token the window shows, so the blocks before it are never read and no key needs a window
mask; the partitions split what the window shows. A soft cap (`SOFT_CAP`) caps the logits
(`scores.logits`). Left None, both compile to the kernel without them. An FP8 cache (`KV_FP8`) is
read as e4m3 (one byte an element) and cast to f16 in registers (exact; `dot_config`); k_scale is folded
into the logits' scale and v_scale multiplies each partition's output. Left False, the kernel is the
one without it.

Scores and P @ V are `tl.dot`s with the group padded to 16 rows (the MMA minimum), even for MHA
(group 1); the padding rows are zero queries, never stored. The cache write, this kernel and the
reduce are three launches. Requires: K/V caches [num_blocks, block_size, Hkv, D] with D contiguous,
H a multiple of Hkv, `seq_lens` counting the new token (already in the cache). Why the kernel looks
as it does, with the measurements: docs/performance.md, "Paged decode attention".
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from infer.kernels.triton_pdl import kernel_args, wait_and_release
from infer.plugins.attention.paged_cuda.kernels import dot_config
from infer.plugins.attention.paged_cuda.kernels.fp8 import scale_output, widen_values
from infer.plugins.attention.paged_cuda.kernels.scores import logits, window_start

LOG2E = 1.4426950408889634


@triton.jit
def _first_key(seq_len, WINDOW: tl.constexpr):
    """The first context token the query (at seq_len - 1) walks: 0, or under a window the oldest one
    it sees; the walk skips every block before it, and no key after it needs a window mask."""
    if WINDOW is None:
        return 0
    else:
        return window_start(seq_len - 1, WINDOW)


@triton.jit
def _partition(seq_len, part, max_partitions, SPLIT: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end): the tokens of a context of `seq_len` that partition `part` walks; SPLIT: whole
    tiles of cdiv(seen, max_partitions) tokens of the `seen` ones from the first key on (the last
    partitions may be empty), else all of them."""
    first = _first_key(seq_len, WINDOW)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(seq_len - first, max_partitions), BLOCK_N) * BLOCK_N
        start = first + part * chunk
        end = tl.minimum(start + chunk, seq_len)
    else:
        start = first
        end = seq_len
    return start, end


@triton.jit
def _attend_tile(
    q,
    k,
    v,
    tok_mask,
    acc,
    l_i,
    m_i,
    scale_log2,
    SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of keys and values ([N, D]; `tok_mask` [N]: the real tokens) into the running
    output, exp sum and max logit (acc [G, D], l_i [G], m_i [G]; fp32, log2 units) of queries q [G, D]."""
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)  # [G, N]
    s = tl.where(tok_mask[None, :], logits(s, scale_log2, SOFT_CAP), float("-inf"))
    # every tile holds at least one real token, so m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [G, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = widen_values(v, tok_mask[:, None], DOT_DTYPE)
    pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv  # [G, D]
    return acc, l_i, m_new


@triton.jit
def _decode_kernel(
    out_ptr,  # [T, H, D]; decode token i belongs to sequence i
    part_out_ptr,  # [S, H, P, D] fp32: per-partition output, already divided by its sum
    part_max_ptr,  # [S, H, P] fp32: per-partition max logit (log2 units)
    part_sum_ptr,  # [S, H, P] fp32: per-partition sum of exp2(logit - max)
    q_ptr,  # [T, H, D]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32, context + the new token
    scale_log2,  # softmax scale * log2(e) (* k_scale: an FP8 cache's keys are k_cache * k_scale)
    v_scale,  # KV_FP8: an FP8 cache's values are v_cache * v_scale
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ps,
    stride_ph,  # part_out strides; part_max/sum are [S, H, P] contiguous
    head_dim,
    group,
    max_partitions,
    SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,  # None, or the query sees its last WINDOW positions
    SOFT_CAP: tl.constexpr,  # None, or the logits are capped (scores.logits)
    KV_FP8: tl.constexpr,  # the cache is e4m3: scale the output by v_scale
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens a block: a constant, so no division at run time
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = _partition(seq_len, part, max_partitions, SPLIT, WINDOW, BLOCK_N)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * group + rows  # [G] query heads of this KV head
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < group
    dim_mask = dims < head_dim
    q_mask = row_mask[:, None] & dim_mask[None, :]
    # Short contexts leave the last partitions empty (each holds at least one whole tile).
    if start < end:
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
        q = q.to(DOT_DTYPE)  # [G, D]

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq * stride_bt
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)  # [N] token positions
            tok_mask = offs < end
            block = tl.load(table + offs // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
            row = block * stride_cb + (offs % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [N]
            kv_mask = tok_mask[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
            v = tl.load(v_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
            acc, l_i, m_i = _attend_tile(
                q, k, v, tok_mask, acc, l_i, m_i, scale_log2, SOFT_CAP, DOT_DTYPE, DOT_PRECISION
            )

        out = scale_output(acc / l_i[:, None], v_scale, KV_FP8)
        if SPLIT:
            stat = (seq * tl.num_programs(1) * group + heads) * max_partitions + part  # [S, H, P]
            tl.store(part_max_ptr + stat, m_i, mask=row_mask)
            tl.store(part_sum_ptr + stat, l_i, mask=row_mask)
            dst = part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + part * head_dim + dims[None, :]
            tl.store(dst, out, mask=q_mask)
        else:
            dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _reduce_kernel(
    out_ptr,  # [T, H, D]
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,  # as in _decode_kernel
    seq_lens_ptr,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_ph,
    head_dim,
    max_partitions,
    WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    seen = seq_len - _first_key(seq_len, WINDOW)  # as in _partition
    chunk = tl.cdiv(tl.cdiv(seen, max_partitions), BLOCK_N) * BLOCK_N
    num_parts = tl.cdiv(seen, chunk)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    stat = (seq * tl.num_programs(1) + head) * max_partitions
    part_out = part_out_ptr + seq * stride_ps + head * stride_ph + dims
    # softmax over the union of partitions: weight partition p by sum_p * 2^(max_p - max)
    m = tl.load(part_max_ptr + stat)
    l = tl.load(part_sum_ptr + stat)
    acc = tl.load(part_out, mask=dim_mask, other=0.0) * l
    for p in range(1, num_parts):
        m_p = tl.load(part_max_ptr + stat + p)
        l_p = tl.load(part_sum_ptr + stat + p)
        o_p = tl.load(part_out + p * head_dim, mask=dim_mask, other=0.0)
        m_new = tl.maximum(m, m_p)
        a, b = tl.exp2(m - m_new), tl.exp2(m_p - m_new) * l_p
        acc = acc * a + o_p * b
        l = l * a + b
        m = m_new
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, (acc / l).to(out_ptr.dtype.element_ty), mask=dim_mask)


def launch_args(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    scales: tuple[float, float],
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[tuple[Any, ...], int]:
    """The arguments before the constexprs that `_decode_kernel` and `decode_e4m3`'s kernel share (out
    through max_partitions), and the partitions a context is split into (the grid's third axis)."""
    if scratch is not None:
        part_out, part_max, part_sum = scratch
        assert part_out.is_contiguous() and part_max.is_contiguous(), "the kernels index the scratch densely"
        max_partitions = part_out.shape[2]
        stride_ps, stride_ph = part_out.stride(0), part_out.stride(1)
    else:
        part_out = part_max = part_sum = out  # unused when SPLIT is False
        max_partitions, stride_ps, stride_ph = 1, 0, 0
    args = (
        out,
        part_out,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale * scales[0] * LOG2E,
        scales[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        stride_ps,
        stride_ph,
        q.shape[2],  # head_dim
        q.shape[1] // k_cache.shape[2],  # group
        max_partitions,
    )
    return args, max_partitions


def paged_decode(
    out: torch.Tensor,  # [T, H, D]; rows [0, num_seqs) written
    q: torch.Tensor,  # [T, H, D]; rows [0, num_seqs) are the decode tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32
    scale: float,
    num_seqs: int,
    # split-K scratch, [num_seqs, H, P, D] and [num_seqs, H, P] fp32 for P partitions per context;
    # None: one program per (sequence, KV head) walks the whole context
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    block_n: int,
    window: int | None = None,  # each query sees its last `window` positions; None: all of them
    soft_cap: float | None = None,  # logits capped as soft_cap * tanh(s / soft_cap)
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
    # the best of every cache dtype: an e4m3 cache's K tiles pipelined as bf16's, its V tiles widened
    # first (`widen_values`; docs/performance.md, "An FP8 cache's decode")
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    # tl.dot needs M >= 16: pad the group's rows with zero queries that are never stored.
    group_pad = max(16, triton.next_power_of_2(group))
    dot_dtype, precision = dot_config(q.dtype, k_cache.dtype)
    pdl = kernel_args(q.device)
    args, max_partitions = launch_args(out, q, k_cache, v_cache, block_tables, seq_lens, scale, scales, scratch)
    _decode_kernel[(num_seqs, num_kv_heads, max_partitions)](
        *args,
        SPLIT=scratch is not None,
        WINDOW=window,
        SOFT_CAP=soft_cap,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        GROUP_PAD=group_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl,
    )
    if scratch is not None:
        _reduce(out, scratch, seq_lens, (num_seqs, num_heads), head_dim, window, block_n, block_d, pdl)


def _reduce(
    out: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    seq_lens: torch.Tensor,
    grid: tuple[int, int],  # (num_seqs, num_heads)
    head_dim: int,
    window: int | None,
    block_n: int,
    block_d: int,
    pdl: dict[str, Any],
) -> None:
    """Combine the partitions `_decode_kernel` wrote into `scratch` into `out`, per (sequence, head)."""
    part_out, part_max, part_sum = scratch
    _reduce_kernel[grid](
        out,
        part_out,
        part_max,
        part_sum,
        seq_lens,
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        head_dim,
        part_out.shape[2],
        WINDOW=window,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **pdl,
    )
