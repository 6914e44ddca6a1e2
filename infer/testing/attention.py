"""Named attention batch specs with randomly permuted block tables, and a naive oracle.

`make_case` builds a paged cache holding each sequence's context at random physical blocks,
plus the new tokens' q/k/v; `naive_attention` computes the expected output one sequence at a
time from dense tensors (no paging at all), so any backend can be checked against it. An FP8 case
(`kv_cache_dtype=torch.float8_e4m3fn`) holds its context quantized in an `FP8KVCache`, and its dense
K/V are what that cache holds, dequantized (the new tokens' too: a backend reads them back quantized);
the same seed without it gives the same values unquantized.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from infer.api import AttentionBatch, AttentionSpec, KVCache
from infer.api.kv_cache import FP8, FP8KVCache, kv_scales, quantize_fp8


@dataclass(frozen=True, slots=True)
class BatchSpec:
    name: str
    query_lens: tuple[int, ...]  # new tokens per sequence
    context_lens: tuple[int, ...]  # tokens already cached per sequence


BATCH_SPECS = (
    BatchSpec("decode-1", (1,), (17,)),
    BatchSpec("decode-mixed", (1, 1, 1, 1), (1, 15, 16, 40)),
    BatchSpec("prefill-1", (19,), (0,)),
    BatchSpec("prefill-varlen", (5, 16, 33), (0, 0, 0)),
    BatchSpec("extend", (3, 7), (16, 21)),
    BatchSpec("mixed", (1, 1, 9, 4), (30, 2, 0, 13)),
)


@dataclass(slots=True)
class AttentionCase:
    spec: AttentionSpec
    batch: AttentionBatch
    kv_cache: KVCache  # an FP8KVCache for an FP8 case
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    dense_k: list[torch.Tensor]  # seq i -> [seq_len, Hkv, D], context then new tokens
    dense_v: list[torch.Tensor]
    window: int | None = None  # forward(window=): each query sees its last `window` positions


def make_case(
    batch_spec: BatchSpec,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    window: int | None = None,
    soft_cap: float | None = None,
    kv_cache_dtype: torch.dtype | None = None,  # float8_e4m3fn: an FP8 cache; None: dtype
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
) -> AttentionCase:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(batch_spec.query_lens, batch_spec.context_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # random physical placement
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(perm[start : start + n])
        start += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    k_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)  # garbage where unused
    v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    dense_k, dense_v, new_k, new_v = [], [], [], []
    for table, q_len, c_len in zip(tables, batch_spec.query_lens, batch_spec.context_lens):
        seq_k, seq_v = rand(q_len + c_len, num_kv_heads, head_dim), rand(q_len + c_len, num_kv_heads, head_dim)
        for pos in range(c_len):  # the cached context lives in the paged cache already
            k_cache[table[pos // block_size], pos % block_size] = seq_k[pos]
            v_cache[table[pos // block_size], pos % block_size] = seq_v[pos]
        dense_k.append(seq_k)
        dense_v.append(seq_v)
        new_k.append(seq_k[c_len:])
        new_v.append(seq_v[c_len:])
    num_tokens = sum(batch_spec.query_lens)
    spec = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=1.0 / math.sqrt(head_dim),
        dtype=dtype,
        device=torch.device(device),
        block_size=block_size,
        max_num_seqs=max(len(seq_lens), 1),
        max_model_len=max(seq_lens) + 64,
        sliding_windows=(window,) if window is not None else (),
        soft_cap=soft_cap,
    )
    batch = AttentionBatch.build(list(batch_spec.query_lens), seq_lens, tables, block_size, device)
    case = AttentionCase(
        spec=spec,
        batch=batch,
        kv_cache=(k_cache, v_cache),
        q=rand(num_tokens, num_heads, head_dim),
        k=torch.cat(new_k),
        v=torch.cat(new_v),
        dense_k=dense_k,
        dense_v=dense_v,
        window=window,
    )
    return quantized(case, kv_scales) if kv_cache_dtype == FP8 else case


def quantized(case: AttentionCase, kv_scales: tuple[float, float] = (1.0, 1.0)) -> AttentionCase:
    """The case over an FP8 cache: its cache quantized with kv_scales, its dense K/V what that cache holds,
    read back with the scales (the new tokens' too: a backend reads them back from the cache)."""
    dtype = case.q.dtype
    dense = [
        [(quantize_fp8(x, s).float() * s).to(dtype) for x in xs]
        for xs, s in zip((case.dense_k, case.dense_v), kv_scales)
    ]
    return dataclasses.replace(
        case,
        spec=dataclasses.replace(case.spec, kv_cache_dtype=FP8),
        kv_cache=FP8KVCache(*(quantize_fp8(c, s) for c, s in zip(case.kv_cache, kv_scales)), *kv_scales),
        dense_k=dense[0],
        dense_v=dense[1],
    )


def naive_attention(case: AttentionCase) -> torch.Tensor:
    """Expected output [T, H, D], in float32, from the dense per-sequence K/V."""
    spec, outs, t = case.spec, [], 0
    group = spec.num_heads // spec.num_kv_heads
    for q_len, keys, values in zip(case.batch.query_lens, case.dense_k, case.dense_v):
        q = case.q[t : t + q_len].float()  # [q, H, D]
        t += q_len
        k = keys.float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
        if spec.soft_cap is not None:
            scores = spec.soft_cap * torch.tanh(scores / spec.soft_cap)
        seq_len = keys.shape[0]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if case.window is not None:
            hidden |= k_pos <= q_pos - case.window
        scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def check_backend(backend_cls, case: AttentionCase, atol: float, rtol: float) -> None:
    """Run one backend on a case; compare the output and the written cache slots to the oracle."""
    backend = backend_cls(case.spec)
    backend.plan(case.batch)
    window = {} if case.window is None else {"window": case.window}
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, **window)
    expected = naive_attention(case).to(out.device)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    for which, new in enumerate((case.k, case.v)):
        torch.testing.assert_close(written(case, which), stored(case.kv_cache, which, new).float(), atol=0, rtol=0)


def stored(kv_cache: KVCache, which: int, x: torch.Tensor) -> torch.Tensor:
    """What a cache holds for new K (which=0) or V (1) values x: x in its dtype, or quantized (FP8)."""
    cache = kv_cache[which]
    return quantize_fp8(x, kv_scales(kv_cache)[which]) if cache.dtype == FP8 else x.to(cache.dtype)


def written(case: AttentionCase, which: int) -> torch.Tensor:
    """The K (which=0) or V (1) slots of the case's new tokens as float32 ([T, Hkv, D])."""
    cache = case.kv_cache[which]
    flat = cache.view(torch.uint8) if cache.dtype == FP8 else cache  # float8 indexes as its bytes everywhere
    rows = flat.reshape(-1, *flat.shape[2:])[case.batch.slot_mapping]
    return (rows.view(FP8) if cache.dtype == FP8 else rows).float()
