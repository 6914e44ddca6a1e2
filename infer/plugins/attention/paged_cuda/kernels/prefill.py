"""Paged prefill/extend attention: variable-length, causal, K/V read through the block table.

Sequence i's `query_lens[i]` new tokens sit at positions [seq_len - query_len, seq_len) and
attend to every cached token up to their own position, so chunked prefill and speculative
verification are the same kernel as a plain prefill.

Grid: (query block, kv_head). A query block is BLOCK_Q consecutive tokens of one sequence
(`q_block_seq`, `q_block_start`, built once per step on the host); its tile has
BLOCK_M = BLOCK_Q x group rows, (token, query head of the GQA group), so one K/V read serves
the whole group. Keys come in tiles of BLOCK_N tokens gathered through the block table, up to
the last position the block's queries can see; scores and P @ V are `tl.dot`s with an online
softmax in fp32. Under a sliding window (`WINDOW`, a constexpr) the keys start at the oldest one
the block's first query sees, so the blocks before it are never read; tiles that some row's window
leaves out are masked. A soft cap (`SOFT_CAP`) caps the logits (`scores.logits`). Left None, both
compile to the kernel without them. An FP8 cache (`KV_FP8`) is read as in the decode kernel: e4m3
cast to the dot dtype in registers, k_scale in the logits' scale, v_scale on the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.plugins.attention.paged_cuda.kernels import dot_config
from infer.plugins.attention.paged_cuda.kernels.fp8 import scale_output
from infer.plugins.attention.paged_cuda.kernels.scores import logits, window_start

LOG2E = 1.4426950408889634


@triton.jit
def _attend(
    acc,
    l_i,
    m_i,  # running output [M, D], exp sum [M], max logit [M] (fp32, log2 units)
    q,
    q_pos,  # [M, D] queries, [M] their positions
    k_cache_ptr,
    v_cache_ptr,
    table,  # table: this sequence's row of block_tables
    kv_head,
    start,
    end,
    kv_end,
    scale_log2,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    head_dim,
    CAUSAL: tl.constexpr,  # False: every key in [start, end) is visible to every row, skip the masks
    WINDOW: tl.constexpr,  # None, or each row sees its last WINDOW positions
    SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)  # [N] key positions
        if CAUSAL:
            tok_mask = offs < kv_end
            block = tl.load(table + offs // block_size, mask=tok_mask, other=0).to(tl.int64)
            kv_mask = tok_mask[:, None] & dim_mask[None, :]
        else:
            block = tl.load(table + offs // block_size).to(tl.int64)
            kv_mask = dim_mask[None, :]
        row = block * stride_cb + (offs % block_size) * stride_cs + kv_head * stride_ch  # [N]
        k = tl.load(k_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
        s = logits(tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION), scale_log2, SOFT_CAP)
        if CAUSAL:
            seen = (offs[None, :] <= q_pos[:, None]) & tok_mask[None, :]  # [M, N]
            if WINDOW is not None:
                seen = seen & (offs[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new  # what exp2 measures from
        if CAUSAL:
            if WINDOW is not None:  # a row shown no key yet keeps m = -inf: from 0, not -inf - -inf (NaN)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_context(
    q,
    q_pos,  # [M, D] queries, [M] their positions
    k_cache_ptr,
    v_cache_ptr,
    table,  # this sequence's row of block_tables
    kv_head,
    first_q_pos,  # position of the query block's first token
    seq_len,
    scale_log2,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    head_dim,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A query block's attention over every key it can see: the unnormalised output [M, D] and exp
    sums [M] (fp32), over three ranges of keys. [first, edge): a window's left edge hides some of
    them from some rows (masked; under a window only, `first` its oldest key for the block's first
    row); [edge, full_end): before the block's first query and in every row's window, whole tiles
    without masks; [full_end, kv_end): up to the last key the block sees (masked). Without a window
    the max logit turns finite in the first tile (its first key is visible to every row)."""
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)
    if WINDOW is None:
        edge = 0
        full_end = first_q_pos // BLOCK_N * BLOCK_N
    else:
        q_pos = tl.minimum(q_pos, seq_len - 1)  # padded rows (never stored) as the last query: no 0 / 0
        first = window_start(first_q_pos, WINDOW)
        edge = tl.minimum(first + tl.cdiv(window_start(kv_end - 1, WINDOW) - first, BLOCK_N) * BLOCK_N, kv_end)
        full_end = edge + tl.maximum(first_q_pos - edge, 0) // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for part in tl.static_range(0 if WINDOW is not None else 1, 3):  # the ranges in order, unrolled
        if part == 0:
            start, end = first, edge
        elif part == 1:
            start, end = edge, full_end
        else:
            start, end = full_end, kv_end
        acc, l_i, m_i = _attend(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            table,
            kv_head,
            start,
            end,
            kv_end,
            scale_log2,
            stride_cb,
            stride_cs,
            stride_ch,
            block_size,
            head_dim,
            part != 1,
            WINDOW,
            SOFT_CAP,
            DOT_DTYPE,
            DOT_PRECISION,
            BLOCK_N,
            BLOCK_D,
        )
    return acc, l_i


@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32, context + new tokens
    cu_seqlens_q_ptr,  # [B + 1] int32
    q_block_seq_ptr,  # [num_q_blocks] int32: query block -> sequence
    q_block_start_ptr,  # [num_q_blocks] int32: query block -> first new token, within its sequence
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
    block_size,
    head_dim,
    group,
    WINDOW: tl.constexpr,  # None, or each query sees its last WINDOW positions
    SOFT_CAP: tl.constexpr,  # None, or the logits are capped (scores.logits)
    KV_FP8: tl.constexpr,  # the cache is e4m3: scale the output by v_scale
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    q_block, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(q_block_seq_ptr + q_block)
    q_start = tl.load(q_block_start_ptr + q_block)
    tok0 = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - tok0
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_start + rows // group  # [M] query token within the sequence
    heads = kv_head * group + rows % group  # [M]
    dims = tl.arange(0, BLOCK_D)
    row_mask = (rows < BLOCK_Q * group) & (q_idx < q_len)
    q_mask = row_mask[:, None] & (dims < head_dim)[None, :]
    q_rows = (tok0 + q_idx).to(tl.int64)
    q_offs = q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(DOT_DTYPE)  # [M, D]
    q_pos = ctx_len + q_idx  # [M]; padded rows sit past seq_len: they see every key, are never stored

    table = block_tables_ptr + seq * stride_bt
    acc, l_i = _attend_context(
        q,
        q_pos,
        k_cache_ptr,
        v_cache_ptr,
        table,
        kv_head,
        ctx_len + q_start,
        seq_len,
        scale_log2,
        stride_cb,
        stride_cs,
        stride_ch,
        block_size,
        head_dim,
        WINDOW,
        SOFT_CAP,
        DOT_DTYPE,
        DOT_PRECISION,
        BLOCK_M,
        BLOCK_Q,
        BLOCK_N,
        BLOCK_D,
    )
    out = scale_output(acc / l_i[:, None], v_scale, KV_FP8).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :], out, mask=q_mask)


def query_blocks(query_lens: list[int], first_seq: int, block_q: int) -> tuple[list[int], list[int]]:
    """Split each sequence's new tokens into blocks of block_q: (sequence, first token) per block."""
    seqs: list[int] = []
    starts: list[int] = []
    for i, q_len in enumerate(query_lens):
        for start in range(0, q_len, block_q):
            seqs.append(first_seq + i)
            starts.append(start)
    return seqs, starts


def prefill_tile(num_heads: int, num_kv_heads: int, block_m: int = 64) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_Q tokens): rows hold BLOCK_Q tokens x the GQA group."""
    group = num_heads // num_kv_heads
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group


def paged_prefill(
    out: torch.Tensor,  # [T, H, D]
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    q_block_seq: torch.Tensor,  # [num_q_blocks] int32, from query_blocks
    q_block_start: torch.Tensor,  # [num_q_blocks] int32
    scale: float,
    block_m: int,
    block_q: int,
    block_n: int = 64,
    window: int | None = None,  # each query sees its last `window` positions; None: all of them
    soft_cap: float | None = None,  # logits capped as soft_cap * tanh(s / soft_cap)
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    num_q_blocks = q_block_seq.shape[0]
    if num_q_blocks == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    dot_dtype, precision = dot_config(q.dtype, k_cache.dtype)
    _prefill_kernel[(num_q_blocks, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        q_block_seq,
        q_block_start,
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
        block_size,
        head_dim,
        num_heads // num_kv_heads,
        WINDOW=window,
        SOFT_CAP=soft_cap,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=num_warps,
        num_stages=num_stages,
    )
