"""Each row's argmax, as `torch.argmax(x, dim=-1)` gives it (the first index of the largest value, NaN
above every number), in two small kernels: programs over chunks of a row, then one a row over the
chunks' results. A greedy step at batch 1 takes the argmax of 128,256 logits, which torch's reduction
spends ~27 us on at one row on an H200 (one block), ~1% of an FP8 Llama-3-8B decode step
(docs/performance.md, "Batch 1, the step's edges").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.triton_pdl import kernel_args, wait_and_release

CHUNK = 4096  # columns a program of the first kernel takes
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # compared as float32, exactly
MAX_PARTS = 65535  # the chunks of a row lie on the grid's second axis, which CUDA caps there
_NONE = tl.constexpr(2**31 - 1)  # an index past every row


@triton.jit
def _first_largest(values, index):
    """(value, index) of `values`' largest entry and its first index, NaN counting as the largest; index
    holds each entry's index in the row (_NONE where there is none)."""
    nan = values != values
    first_nan = tl.min(tl.where(nan, index, _NONE), axis=0)
    numbers = tl.where(nan, float("-inf"), values)
    largest = tl.max(numbers, axis=0)
    first = tl.min(tl.where(numbers == largest, index, _NONE), axis=0)
    any_nan = first_nan != _NONE
    return tl.where(any_nan, float("nan"), largest), tl.where(any_nan, first_nan, first)


@triton.jit
def _chunks_kernel(x_ptr, value_ptr, index_ptr, V, stride, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * CHUNK + tl.arange(0, CHUNK)
    inside = cols < V
    values = tl.load(x_ptr + row * stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    value, index = _first_largest(values, tl.where(inside, cols, _NONE))
    out = row * tl.num_programs(1) + part
    tl.store(value_ptr + out, value)
    tl.store(index_ptr + out, index)


@triton.jit
def _rows_kernel(value_ptr, index_ptr, out_ptr, PARTS, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK)
    inside = parts < PARTS
    values = tl.load(value_ptr + row * PARTS + parts, mask=inside, other=float("-inf"))
    index = tl.load(index_ptr + row * PARTS + parts, mask=inside, other=_NONE)
    _, first = _first_largest(values, index)
    tl.store(out_ptr + row, first.to(tl.int64))


def takes(x: torch.Tensor) -> bool:
    """Whether `argmax_rows` takes x: [B, V] in float32, bfloat16 or float16 (float64 would lose its
    extra bits), 1 <= V <= MAX_PARTS * CHUNK."""
    return x.dim() == 2 and x.dtype in DTYPES and 0 < x.shape[1] <= MAX_PARTS * CHUNK


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [B, V] that this module `takes` -> [B] int64, `x.argmax(dim=-1)`'s values."""
    assert takes(x), f"argmax_rows takes [B, V] float32/bfloat16/float16 rows of 1 to {MAX_PARTS * CHUNK} columns"
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    parts = triton.cdiv(vocab, CHUNK)
    values = torch.empty(rows, parts, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, parts, dtype=torch.int32, device=x.device)
    launch = kernel_args(x.device)
    _chunks_kernel[(rows, parts)](x, values, index, vocab, x.stride(0), CHUNK=CHUNK, num_warps=4, **launch)
    block = triton.next_power_of_2(parts)
    _rows_kernel[(rows,)](values, index, out, parts, BLOCK=block, num_warps=1 if block <= 32 else 4, **launch)
    return out
