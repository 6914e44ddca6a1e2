"""Batched LoRA: each token's adapter's low-rank delta, y += (x A_s^T) B_s^T, for a batch mixing adapters.

The adapters live in stacked device slots, A [S, R, K] and B [S, N, R] (the scaling folded into B), and
a token names its slot (-1: none, y unchanged). Two shapes of work, after Punica:

- BGMV, a program per token: the token's slot is read on the device, so a decode step (or any step a
  CUDA graph replays) needs no host knowledge of the batch; grids depend on the token count alone.
- SGMV, a program per tile of a slot's tokens (the tokens grouped by slot on the host, a prompt's chunk
  one run of them): the adapter's A and B tiles are read once per tile of tokens and multiplied with
  `tl.dot`, which a long prompt and a large decode batch need (per token, 64 decode rows would read
  their adapters' B 64 times); the grouping reaches the kernels through static buffers, so its grids
  depend on the token count alone, CUDA-graph safe too.

Each is two kernels: shrink (v = x A^T, [T, R] in float32) and expand (y += v B^T, in y's dtype). The
expands launch as programmatic dependents where PDL is on (`infer.kernels.triton_pdl`): scheduled while
the projection that made y finishes, each program reads its adapter's B, then waits for it.
`infer.kernels.lora_reference` is the same sum in torch, the CPU's path and the kernels' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.triton_pdl import kernel_args, wait_and_release


@triton.jit
def _bgmv_shrink(
    x_ptr, a_ptr, slots_ptr, v_ptr, K, R, sx, sa0, sa1, sv0, sv1,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    part = tl.program_id(1)  # this program's SPLIT_K columns of x and A: its partial sum, v[part, t]
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_rows = a_ptr + slot.to(tl.int64) * sa0 + r[:, None] * sa1
    for k0 in range(part * SPLIT_K, part * SPLIT_K + SPLIT_K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t.to(tl.int64) * sx + k, mask=k < K, other=0.0).to(tl.float32)
        ak = tl.load(a_rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(ak * xk[None, :], axis=1)
    tl.store(v_ptr + part.to(tl.int64) * sv0 + t.to(tl.int64) * sv1 + r, acc, mask=r < R)


@triton.jit
def _bgmv_expand(
    v_ptr, b_ptr, slots_ptr, y_ptr, N, R, PARTS, sv0, sv1, sb0, sb1, sy,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)  # the slots and B are written between forwards: read before the wait
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    bt = tl.load(
        b_ptr + tl.maximum(slot, 0).to(tl.int64) * sb0 + n[:, None] * sb1 + r[None, :],
        mask=(n[:, None] < tl.where(slot >= 0, N, 0)) & (r[None, :] < R),  # nothing for the base rows
        other=0.0,
    ).to(tl.float32)
    wait_and_release(USE_PDL)  # every program waits, those of the base rows too: a kernel after this one
    if slot < 0:  # relies on this one's end meaning its predecessor's (y's projection) end
        return
    p = tl.arange(0, BLOCK_P)  # the shrink's partial sums, all in one load (a loop of loads waits on each)
    v = tl.sum(
        tl.load(v_ptr + p[:, None].to(tl.int64) * sv0 + t.to(tl.int64) * sv1 + r[None, :], mask=(p[:, None] < PARTS) & (r[None, :] < R), other=0.0),
        axis=0,
    )  # fmt: skip
    delta = tl.sum(bt * v[None, :], axis=1)
    y_at = y_ptr + t.to(tl.int64) * sy + n
    y = tl.load(y_at, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _sgmv_shrink(
    x_ptr, a_ptr, order_ptr, tiles_ptr, v_ptr, K, R, sx, sa0, sa1, sv0, sv1,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    slot = tl.load(tiles_ptr + tl.program_id(0) * 3)  # this program's tile: (slot, start, end) in `order`
    part = tl.program_id(1)
    if slot < 0:
        return
    first = tl.load(tiles_ptr + tl.program_id(0) * 3 + 1)
    end = tl.load(tiles_ptr + tl.program_id(0) * 3 + 2)
    rows = first + tl.arange(0, BLOCK_M)
    tokens = tl.load(order_ptr + rows, mask=rows < end, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(part * SPLIT_K, part * SPLIT_K + SPLIT_K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(
            x_ptr + tokens[:, None] * sx + k[None, :], mask=(rows[:, None] < end) & (k[None, :] < K), other=0.0
        )
        at = tl.load(
            a_ptr + slot.to(tl.int64) * sa0 + r[None, :] * sa1 + k[:, None],
            mask=(r[None, :] < R) & (k[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(xt.to(at.dtype), at, input_precision=PRECISION)
    tl.store(
        v_ptr + part.to(tl.int64) * sv0 + tokens[:, None] * sv1 + r[None, :],
        acc,
        mask=(rows[:, None] < end) & (r[None, :] < R),
    )


@triton.jit
def _sgmv_expand(
    v_ptr, b_ptr, order_ptr, tiles_ptr, y_ptr, N, R, PARTS, sv0, sv1, sb0, sb1, sy,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    ONE_LOAD: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    slot = tl.load(tiles_ptr + tl.program_id(0) * 3)  # the tiles, the order and B: written between forwards
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    bt = tl.load(
        b_ptr + tl.maximum(slot, 0).to(tl.int64) * sb0 + n[None, :] * sb1 + r[:, None],
        mask=(n[None, :] < tl.where(slot >= 0, N, 0)) & (r[:, None] < R),
        other=0.0,
    )
    wait_and_release(USE_PDL)  # every program, as in _bgmv_expand
    if slot < 0:
        return
    first = tl.load(tiles_ptr + tl.program_id(0) * 3 + 1)
    end = tl.load(tiles_ptr + tl.program_id(0) * 3 + 2)
    rows = first + tl.arange(0, BLOCK_M)
    tokens = tl.load(order_ptr + rows, mask=rows < end, other=0).to(tl.int64)
    if ONE_LOAD:  # the shrink's partial sums, all in one load
        p = tl.arange(0, BLOCK_P)
        v = tl.sum(
            tl.load(
                v_ptr + p[:, None, None].to(tl.int64) * sv0 + tokens[None, :, None] * sv1 + r[None, None, :],
                mask=(p[:, None, None] < PARTS) & (rows[None, :, None] < end) & (r[None, None, :] < R),
                other=0.0,
            ),
            axis=0,
        )
    else:  # too many registers for one tile (high ranks): one load a part
        v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for part in range(0, PARTS):
            v += tl.load(
                v_ptr + part * sv0 + tokens[:, None] * sv1 + r[None, :],
                mask=(rows[:, None] < end) & (r[None, :] < R),
                other=0.0,
            )
    delta = tl.dot(v.to(bt.dtype), bt, input_precision=PRECISION)
    mask = (rows[:, None] < end) & (n[None, :] < N)
    y_at = y_ptr + tokens[:, None] * sy + n[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


# input columns a shrink program sums: a 4,096-wide input is 4 programs a token (or tile), a 14,336-wide one
# 14; the expand loads all their partial sums at once (BLOCK_P, a power of two: 16 at most there)
SPLIT_K = 1024
ONE_LOAD_MOST = 8192  # SGMV's expand loads its [parts, BLOCK_M, rank] partial sums at once up to this size


def _precision(t: torch.Tensor) -> str:
    """fp32 adapters multiply in full fp32 (tl.dot would round them to TF32 on tensor cores, 2e-3 off
    torch's fp32 matmul); 16-bit ones are exact in either."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _block(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def parts(k: int) -> int:
    """The shrink's partial sums for an input of `k` columns (a scratch holds [parts, tokens, rank])."""
    return triton.cdiv(k, SPLIT_K)


def bgmv_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, v: torch.Tensor) -> None:
    """BGMV's first half: v[p, t] = the p-th partial sum of x[t] A_{slots[t]}^T (`bgmv`)."""
    T, K = x.shape
    S, R, _ = a.shape
    if T == 0:
        return
    block_r = _block(R)
    block_k = min(SPLIT_K, max(16, min(128, 8192 // block_r)))  # A's [BLOCK_R, BLOCK_K] fp32 tile: <= 32 KB
    _bgmv_shrink[(T, parts(K))](
        x, a, slots, v, K, R, x.stride(0), a.stride(0), a.stride(1), v.stride(0), v.stride(1),
        block_r, block_k, SPLIT_K,
    )  # fmt: skip


def bgmv_expand(v: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor, k: int) -> None:
    """BGMV's second half: y[t] += (the sum of v's partial sums for t) B_{slots[t]}^T, after
    `bgmv_shrink` of an input `k` wide into `v`."""
    T, N = y.shape
    S, _, R = b.shape
    if T == 0:
        return
    block_r = _block(R)
    block_n = max(16, min(256, 8192 // block_r))  # B's [BLOCK_N, BLOCK_R] fp32 tile: <= 32 KB
    _bgmv_expand[(T, triton.cdiv(N, block_n))](
        v, b, slots, y, N, R, parts(k), v.stride(0), v.stride(1), b.stride(0), b.stride(1), y.stride(0),
        block_r, block_n, triton.next_power_of_2(parts(k)), **kernel_args(y.device),
    )  # fmt: skip


def bgmv(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, v: torch.Tensor
) -> None:
    """y[t] += (x[t] A_{slots[t]}^T) B_{slots[t]}^T for every token t with slots[t] >= 0, in place.
    x [T, K], y [T, N] (rows contiguous), a [S, R, K], b [S, N, R], slots [>= T] int32 on the device,
    v: a float32 scratch of at least [parts(K), T, R]: the shrink splits K over `parts(K)` programs a token
    (one token alone would leave all but one SM idle), whose partial sums the expand adds in one fixed order, the same
    sum in any batch. Grids depend on T alone: CUDA-graph safe. The two halves, `bgmv_shrink` and
    `bgmv_expand`, may run apart (the shrink needs only x: on another stream, beside x's projection)."""
    bgmv_shrink(x, a, slots, v)
    bgmv_expand(v, b, slots, y, x.shape[1])


BLOCK_M = 16  # SGMV's rows a program: a tile holds up to this many tokens of one slot


def group_by_slot(slots: list[int], num_slots: int) -> tuple[list[int], list[int]]:
    """SGMV's metadata from each token's slot: the tokens of slot 0, then of slot 1, ... (slot -1's left
    out), and the tiles over that order, (slot, start, end) flattened: each up to BLOCK_M tokens of
    one slot, `max_tiles(len(slots), num_slots)` of them, the unused ones (-1, 0, 0)."""
    groups: list[list[int]] = [[] for _ in range(num_slots)]
    for t, s in enumerate(slots):
        if s >= 0:
            groups[s].append(t)
    order: list[int] = []
    tiles: list[int] = []
    for slot, group in enumerate(groups):
        for first in range(0, len(group), BLOCK_M):
            tiles += [slot, len(order) + first, len(order) + min(first + BLOCK_M, len(group))]
        order += group
    unused = max_tiles(len(slots), num_slots) - len(tiles) // 3
    assert unused >= 0, "max_tiles bounds the tiles of any spread of the rows"
    tiles += [-1, 0, 0] * unused
    return order, tiles


def _check_tiles(tiles: torch.Tensor, tokens: int, num_slots: int) -> None:
    """The grid reads max_tiles(tokens, num_slots) tiles: a shorter list would be read past its end."""
    if tiles.numel() < 3 * max_tiles(tokens, num_slots):
        raise ValueError(
            f"{tiles.numel() // 3} tiles for {tokens} rows over {num_slots} slots: group_by_slot makes them"
        )


def max_tiles(tokens: int, num_slots: int) -> int:
    """The most tiles `tokens` rows over `num_slots` slots make (each slot's last tile may be short):
    SGMV's grid, which depends on the row count alone (CUDA-graph safe)."""
    return triton.cdiv(tokens, BLOCK_M) + min(num_slots, tokens)


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, tiles: torch.Tensor, v: torch.Tensor) -> None:
    """SGMV's first half: v[p, t] = the p-th partial sum of x[t] A_s^T, tokens grouped by slot (`sgmv`)."""
    T, K = x.shape
    S, R, _ = a.shape
    if T == 0:
        return
    block_r = _block(R)
    block_k = min(SPLIT_K, max(16, min(64, 16384 // block_r)))  # A's [BLOCK_K, BLOCK_R] bf16 tile: <= 32 KB
    _check_tiles(tiles, T, S)
    _sgmv_shrink[(max_tiles(T, S), parts(K))](
        x, a, order, tiles, v, K, R, x.stride(0), a.stride(0), a.stride(1), v.stride(0), v.stride(1),
        BLOCK_M, block_r, block_k, SPLIT_K, _precision(a),
    )  # fmt: skip


def sgmv_expand(
    v: torch.Tensor, b: torch.Tensor, order: torch.Tensor, tiles: torch.Tensor, y: torch.Tensor, k: int
) -> None:
    """SGMV's second half: y[t] += (the sum of v's partial sums for t) B_s^T, after `sgmv_shrink` of an
    input `k` wide into `v`."""
    T, N = y.shape
    S, _, R = b.shape
    if T == 0:
        return
    block_r = _block(R)
    block_n = max(16, min(256, 16384 // block_r))  # B's [BLOCK_R, BLOCK_N] tile: <= 32 KB of bf16
    block_p = triton.next_power_of_2(parts(k))
    _check_tiles(tiles, T, S)
    _sgmv_expand[(max_tiles(T, S), triton.cdiv(N, block_n))](
        v, b, order, tiles, y, N, R, parts(k), v.stride(0), v.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M, block_r, block_n, block_p, block_p * BLOCK_M * block_r <= ONE_LOAD_MOST, _precision(b),
        **kernel_args(y.device),
    )  # fmt: skip


def sgmv(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor,
    tiles: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """The same sum with the tokens grouped by slot (`group_by_slot`: `order`, and `tiles` of up to
    BLOCK_M tokens of one slot each): a program per tile (and per BLOCK_N outputs) reads that adapter's
    tiles once for its tokens and multiplies with `tl.dot`. The grid depends on T and the slots' count
    alone (`max_tiles`; the unused tiles' programs return at once): CUDA-graph safe when `order` and
    `tiles` are static buffers that each forward refills. `v`: as for `bgmv`; so are the halves,
    `sgmv_shrink` and `sgmv_expand`."""
    sgmv_shrink(x, a, order, tiles, v)
    sgmv_expand(v, b, order, tiles, y, x.shape[1])
