"""The FP8 cache's decode with K and V loaded straight into `mma.sync` registers.

`decode._decode_kernel` feeds its MMAs through shared memory, where an e4m3 V tile is widened and
transposed on the way (P @ V sums over tokens, and each thread's operand holds values of consecutive
tokens); that trip, not the bytes, bounds it at about half the bf16 kernel's rate. Here a warp takes 16
tokens a step and each lane loads its operands' bytes itself, 16 at a time, in the order the MMA wants:

- scores, S = q K^T with m16n8k16 f16 MMAs: lane (g = lane / 4, t = lane % 4) loads bytes [32t, 32t + 32)
  of tokens g and 8 + g, which are its B fragments for the 8 k-steps of two 8-token tiles as they are
  (the MMA's k order is then a permutation of d, the same for q's A fragments, loaded once per program in
  that order, so the sums are the same); row g of the 16 is query head g of the GQA group (at most 8; the
  rest, and rows 8-15, are zero);
- P @ V: the softmax weights of the two tiles are the A fragment of one k16 step as they come out of the
  scores' MMAs (rows g), and lane (g, t) loads bytes [16g, 16g + 16) of tokens 2t, 2t + 1, 2t + 8, 2t + 9:
  a byte permute pairs consecutive tokens and one conversion widens each pair to f16x2, the B fragments of
  16 n-tiles whose columns are d = 16g + j (j the n-tile), so the output's columns are permuted, undone
  where it is stored;
- an online softmax in fp32 over each row's 4 lanes (two butterfly shuffles), exp2 with log2(e) and k_scale
  folded into the logits' scale, as in `decode._decode_kernel`.

A warp's steps are software-pipelined: the next step's K and V are loaded while this one is computed (and
the block-table entry of the one after), and rows past the context's end are not read.

Loading q, loading a step, computing it and storing the output are PTX (`decode_e4m3_ptx`, run by
`tl.inline_asm_elementwise`, one element a thread: element e of a [WARPS * 32] tensor lives in lane e % 32
of warp e // 32, Triton's default layout for it, which the PTX's `%laneid` and the lane arithmetic around
it both assume); Triton cannot place these operands in registers itself. Triton does the rest: the
partition of the context (`decode._partition`), the block-table walk, and the combination of the warps'
shares (a program of WARPS warps gives warp w the steps w, w + WARPS, ...; the combined rows are held by
every warp, so each stores them). The asm is declared impure, as it reads memory the kernel before writes
(the SASS is the same either way). With one warp a program the kernel streams an FP8 cache at ~1.3x the
rate of `decode._decode_kernel` when the grid holds some 16 warps an SM, and 1.2-1.9x with 2-4 warps a
program over 32-128 sequences (docs/performance.md, "An FP8 cache's decode"); with few programs and short
contexts it loses (each warp walks its tokens alone), so the backend takes it for unsplit decode batches
only, with `warps` a program.

Requires: an e4m3 cache [num_blocks, block_size, Hkv, D], D = 128 contiguous, block_size a multiple of 16,
16-byte-aligned rows; a GQA group of at most 8 heads; q and out bf16 or fp16; no sliding window or soft cap.
PTX does not run under Triton's interpreter: on a CPU the decode kernel serves every batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.triton_pdl import kernel_args, wait_and_release
from infer.plugins.attention.paged_cuda.kernels import interpreted
from infer.plugins.attention.paged_cuda.kernels.decode import _partition, _reduce, launch_args
from infer.plugins.attention.paged_cuda.kernels.decode_e4m3_ptx import LOAD_ASM, OUT_ASM, Q_ASM, STEP_ASM

__all__ = ["fits", "layout_fits", "paged_decode_e4m3", "warps"]


# fmt: off
# (a lane's 32 output or K/V registers are 32 names, listed compactly; Triton takes no starred lists)
@triton.jit
def _load_step(
    LOAD_ASM: tl.constexpr, k_cache_ptr, v_cache_ptr, block, first, end, lane_k, lane_v, stride,
    kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr,
):
    """A warp's K and V registers for its 16 tokens from `first` (in cache block `block`; none past `end`)."""
    row = block * stride_cb + (first % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    return tl.inline_asm_elementwise(
        LOAD_ASM,
        "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,r",
        [
            (k_cache_ptr + row + lane_k).to(tl.int64),
            (v_cache_ptr + row + lane_v).to(tl.int64),
            stride,
            tl.minimum(tl.maximum(end - first, 0), 16),
        ],
        dtype=(
            tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
            tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
            tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
            tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
        ),
        is_pure=False,
        pack=1,
    )


@triton.jit
def _decode_e4m3_kernel(
    out_ptr,  # [T, H, D]; decode token i belongs to sequence i
    part_out_ptr, part_max_ptr, part_sum_ptr,  # SPLIT: as in decode._decode_kernel
    q_ptr,  # [T, H, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D] e4m3
    block_tables_ptr, seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e) * k_scale
    v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ps, stride_ph,
    head_dim, group, max_partitions,
    SPLIT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the partitions' granularity (the reduce's), a multiple of 16
    WARPS: tl.constexpr,
    Q_ASM: tl.constexpr,
    LOAD_ASM: tl.constexpr,
    STEP_ASM: tl.constexpr,
    OUT_ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = _partition(seq_len, part, max_partitions, SPLIT, None, BLOCK_N)
    if start < end:
        e = tl.arange(0, WARPS * 32)  # one element a thread: warp e // 32, lane e % 32
        warp = e // 32
        g = e % 32 // 4
        t = e % 4
        head = kv_head * group + g
        q_addr = (q_ptr + seq * stride_qt + head * stride_qh + 32 * t).to(tl.int64)
        q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15 = tl.inline_asm_elementwise(
            Q_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,l,r", [q_addr, (g < group).to(tl.int32)],
            dtype=(
                tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
                tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
            ),
            is_pure=False,
            pack=1,
        )
        m = tl.full([WARPS * 32], float("-inf"), tl.float32)
        z = tl.zeros([WARPS * 32], tl.float32)
        l = z
        a0, a1, a2, a3, a4, a5, a6, a7 = z, z, z, z, z, z, z, z
        a8, a9, a10, a11, a12, a13, a14, a15 = z, z, z, z, z, z, z, z
        a16, a17, a18, a19, a20, a21, a22, a23 = z, z, z, z, z, z, z, z
        a24, a25, a26, a27, a28, a29, a30, a31 = z, z, z, z, z, z, z, z
        table = block_tables_ptr + seq * stride_bt
        lane_k = g.to(tl.int64) * stride_cs + 32 * t  # token g, bytes [32t, 32t + 32)
        lane_v = (2 * t).to(tl.int64) * stride_cs + 16 * g  # token 2t, bytes [16g, 16g + 16)
        stride = tl.zeros([WARPS * 32], tl.int64) + stride_cs
        step = 16 * WARPS
        # software-pipelined: a step's K and V are loaded while the step before is computed, and the
        # block-table entry a step before that (the loads' addresses do not wait on it)
        first = start + 16 * warp  # this warp's 16 tokens, all in one block
        block = tl.load(table + first // BLOCK_SIZE, mask=first < end, other=0).to(tl.int64)
        (
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
            c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27, c28, c29, c30, c31,
        ) = _load_step(LOAD_ASM, k_cache_ptr, v_cache_ptr, block, first, end, lane_k, lane_v, stride,
                       kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        block = tl.load(table + (first + step) // BLOCK_SIZE, mask=first + step < end, other=0).to(tl.int64)
        for n in range(start, end, step):
            first = n + 16 * warp
            ahead = tl.load(table + (first + 2 * step) // BLOCK_SIZE, mask=first + 2 * step < end, other=0)
            (
                n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15,
                n16, n17, n18, n19, n20, n21, n22, n23, n24, n25, n26, n27, n28, n29, n30, n31,
            ) = _load_step(LOAD_ASM, k_cache_ptr, v_cache_ptr, block, first + step, end, lane_k, lane_v, stride,
                           kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            (
                m, l, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31,
            ) = tl.inline_asm_elementwise(
                STEP_ASM,
                "=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,"
                "f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,"
                "r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,"
                "r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,f",
                [
                    m, l, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                    a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31,
                    q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15,
                    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
                    c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27, c28, c29, c30, c31,
                    tl.minimum(tl.maximum(end - first, 0), 16),
                    z + scale_log2,
                ],
                dtype=(
                    tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                    tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                    tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                    tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                    tl.float32, tl.float32,
                ),
                is_pure=False,
                pack=1,
            )
            c0, c1, c2, c3, c4, c5, c6, c7 = n0, n1, n2, n3, n4, n5, n6, n7
            c8, c9, c10, c11, c12, c13, c14, c15 = n8, n9, n10, n11, n12, n13, n14, n15
            c16, c17, c18, c19, c20, c21, c22, c23 = n16, n17, n18, n19, n20, n21, n22, n23
            c24, c25, c26, c27, c28, c29, c30, c31 = n24, n25, n26, n27, n28, n29, n30, n31
            block = ahead.to(tl.int64)
        # the warps' shares of each row meet on the same 32 lanes
        m_w = tl.reshape(m, [WARPS, 32])
        m = tl.max(m_w, axis=0)
        f = tl.exp2(m_w - m[None, :])
        l = tl.sum(tl.reshape(l, [WARPS, 32]) * f, axis=0)
        a0 = tl.sum(tl.reshape(a0, [WARPS, 32]) * f, axis=0)
        a1 = tl.sum(tl.reshape(a1, [WARPS, 32]) * f, axis=0)
        a2 = tl.sum(tl.reshape(a2, [WARPS, 32]) * f, axis=0)
        a3 = tl.sum(tl.reshape(a3, [WARPS, 32]) * f, axis=0)
        a4 = tl.sum(tl.reshape(a4, [WARPS, 32]) * f, axis=0)
        a5 = tl.sum(tl.reshape(a5, [WARPS, 32]) * f, axis=0)
        a6 = tl.sum(tl.reshape(a6, [WARPS, 32]) * f, axis=0)
        a7 = tl.sum(tl.reshape(a7, [WARPS, 32]) * f, axis=0)
        a8 = tl.sum(tl.reshape(a8, [WARPS, 32]) * f, axis=0)
        a9 = tl.sum(tl.reshape(a9, [WARPS, 32]) * f, axis=0)
        a10 = tl.sum(tl.reshape(a10, [WARPS, 32]) * f, axis=0)
        a11 = tl.sum(tl.reshape(a11, [WARPS, 32]) * f, axis=0)
        a12 = tl.sum(tl.reshape(a12, [WARPS, 32]) * f, axis=0)
        a13 = tl.sum(tl.reshape(a13, [WARPS, 32]) * f, axis=0)
        a14 = tl.sum(tl.reshape(a14, [WARPS, 32]) * f, axis=0)
        a15 = tl.sum(tl.reshape(a15, [WARPS, 32]) * f, axis=0)
        a16 = tl.sum(tl.reshape(a16, [WARPS, 32]) * f, axis=0)
        a17 = tl.sum(tl.reshape(a17, [WARPS, 32]) * f, axis=0)
        a18 = tl.sum(tl.reshape(a18, [WARPS, 32]) * f, axis=0)
        a19 = tl.sum(tl.reshape(a19, [WARPS, 32]) * f, axis=0)
        a20 = tl.sum(tl.reshape(a20, [WARPS, 32]) * f, axis=0)
        a21 = tl.sum(tl.reshape(a21, [WARPS, 32]) * f, axis=0)
        a22 = tl.sum(tl.reshape(a22, [WARPS, 32]) * f, axis=0)
        a23 = tl.sum(tl.reshape(a23, [WARPS, 32]) * f, axis=0)
        a24 = tl.sum(tl.reshape(a24, [WARPS, 32]) * f, axis=0)
        a25 = tl.sum(tl.reshape(a25, [WARPS, 32]) * f, axis=0)
        a26 = tl.sum(tl.reshape(a26, [WARPS, 32]) * f, axis=0)
        a27 = tl.sum(tl.reshape(a27, [WARPS, 32]) * f, axis=0)
        a28 = tl.sum(tl.reshape(a28, [WARPS, 32]) * f, axis=0)
        a29 = tl.sum(tl.reshape(a29, [WARPS, 32]) * f, axis=0)
        a30 = tl.sum(tl.reshape(a30, [WARPS, 32]) * f, axis=0)
        a31 = tl.sum(tl.reshape(a31, [WARPS, 32]) * f, axis=0)
        lane = tl.arange(0, 32)
        g = lane // 4
        t = lane % 4
        head = kv_head * group + g
        if SPLIT:
            dst = part_out_ptr + seq * stride_ps + head * stride_ph + part * head_dim + 32 * t
        else:
            dst = out_ptr + seq * stride_ot + head * stride_oh + 32 * t
        # every partition's output is times v_scale too: the reduce's sum is convex
        l = tl.inline_asm_elementwise(
            OUT_ASM,
            "=f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,f,l,r,f",
            [
                a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31,
                l, dst.to(tl.int64), (g < group).to(tl.int32), tl.zeros([32], tl.float32) + v_scale,
            ],
            dtype=tl.float32,
            is_pure=False,
            pack=1,
        )
        if SPLIT:
            stat = (seq * tl.num_programs(1) * group + head) * max_partitions + part
            row0 = (t == 0) & (g < group)
            tl.store(part_max_ptr + stat, m, mask=row0)
            tl.store(part_sum_ptr + stat, l, mask=row0)
# fmt: on


def fits(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None, soft_cap: float | None
) -> bool:
    """Whether `paged_decode_e4m3` serves this decode here: a compiled run on a GPU, and `layout_fits`."""
    return not interpreted() and q.is_cuda and layout_fits(q, k_cache, v_cache, window, soft_cap)


def layout_fits(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None, soft_cap: float | None
) -> bool:
    """Whether the kernel takes these tensors (the module's Requires): its lanes load 16 bytes at a time
    from the caches and q, so their rows must start 16-byte aligned."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    return (
        k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
        and q.dtype in (torch.bfloat16, torch.float16)
        and head_dim == 128
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 8
        and block_size % 16 == 0
        and k_cache.shape == v_cache.shape
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(3) == 1
        and all(s % 16 == 0 for s in k_cache.stride()[:3])
        and k_cache.data_ptr() % 16 == 0
        and v_cache.data_ptr() % 16 == 0
        and q.stride(2) == 1
        and q.stride(0) % 8 == 0
        and q.stride(1) % 8 == 0
        and q.data_ptr() % 16 == 0
        and window is None
        and soft_cap is None
    )


def warps(programs: int, num_sms: int) -> int:
    """Warps a program for a grid of `programs` (sequence, KV head) programs: some 16 warps an SM in all,
    in 1, 2 or 4 a program (H200: one warp won at 2,000 programs, four at 256-512; docs/performance.md)."""
    w = 1
    while w < 4 and programs * w * 2 <= 16 * num_sms:
        w *= 2
    return w


def paged_decode_e4m3(
    out: torch.Tensor,  # [T, H, D]; rows [0, num_seqs) written
    q: torch.Tensor,  # [T, H, D]; rows [0, num_seqs) are the decode tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] e4m3
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32
    scale: float,
    num_seqs: int,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # as in decode.paged_decode
    block_n: int,  # the partitions' granularity, a multiple of 16
    scales: tuple[float, float],  # (k_scale, v_scale)
    num_warps: int = 1,
) -> None:
    """`decode.paged_decode` over an FP8 cache that `fits`, without window or soft cap."""
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert block_n % 16 == 0 and q.stride(2) == 1 and out.stride(2) == 1
    pdl = kernel_args(q.device)
    args, max_partitions = launch_args(out, q, k_cache, v_cache, block_tables, seq_lens, scale, scales, scratch)
    _decode_e4m3_kernel[(num_seqs, num_kv_heads, max_partitions)](
        *args,
        SPLIT=scratch is not None,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        WARPS=num_warps,
        Q_ASM=Q_ASM[q.dtype],
        LOAD_ASM=LOAD_ASM,
        STEP_ASM=STEP_ASM,
        OUT_ASM=OUT_ASM[torch.float32 if scratch is not None else out.dtype],
        num_warps=num_warps,
        num_stages=1,
        **pdl,
    )
    if scratch is not None:
        _reduce(out, scratch, seq_lens, (num_seqs, num_heads), head_dim, None, block_n, 128, pdl)
