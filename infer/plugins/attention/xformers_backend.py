"""`xformers`: prefill attention with xformers' `memory_efficient_attention_forward` (prefill only).

Used as `--prefill-attention xformers` next to a decode backend (`--attention paged-cuda` or
`torch`). The step's prompts are packed into one [1, T, ...] sequence and attend through a
block-diagonal causal bias, GQA in xformers' 5-D [B, M, G, H, K] layout (keys expanded over H).

When no sequence has cached context, queries, keys and values are the step's new tokens and the
bias is `BlockDiagonalCausalMask`. When any sequence has cached context (a chunked-prefill
continuation, a prefix-cache hit), the whole step gathers every sequence's keys and values from
the paged cache (after writing the new ones) into packed [sum(seq_lens), Hkv, D] tensors and uses
`BlockDiagonalCausalFromBottomRightMask`, whose causal diagonal ends at each sequence's last key.
xformers' paged biases are not used: its PyTorch-flash path (the one that runs without its own
compiled extension) does not support them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from infer.api import AttentionBatch, AttentionSpec, Capabilities, KVCache
from infer.api.hookspecs import hookimpl
from infer.api.kv_cache import write_kv


@functools.cache
def _available() -> str | None:
    try:
        from xformers.ops import fmha
    except Exception as exc:
        return f"xformers is not importable ({type(exc).__name__}: {exc}); install it with `pip install 'infer[gpu]'`"
    if not torch.cuda.is_available():
        return "no CUDA device: xformers' attention kernels run only on GPUs"
    try:
        q = torch.zeros(1, 2, 1, 64, dtype=torch.float16, device="cuda")  # [B, M, H, K]
        bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens([2], device=q.device)
        fmha.memory_efficient_attention_forward(q, q, q, attn_bias=bias)
    except Exception as exc:
        return f"xformers is installed but its ops cannot run here: {type(exc).__name__}: {exc}"
    return None


def context_slots(batch: AttentionBatch) -> torch.Tensor:
    """Cache slot of every key of every sequence, sequences packed: [sum(seq_lens)] int64, on the device."""
    seq_lens = batch.seq_lens_t.to(torch.int64)  # [B]
    total = sum(batch.seq_lens)
    device = seq_lens.device
    seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=device), seq_lens, output_size=total)  # [L]
    starts = torch.cumsum(seq_lens, 0) - seq_lens  # [B]
    pos = torch.arange(total, device=device) - starts[seq]  # [L] position within its sequence
    blocks = batch.block_tables_t.to(torch.int64)[seq, pos // batch.block_size]  # [L]
    return blocks * batch.block_size + pos % batch.block_size


@dataclass(slots=True)
class _StepPlan:
    batch: AttentionBatch
    bias: Any  # the step's xformers attention bias
    kv_slots: torch.Tensor | None  # [sum(seq_lens)] int64 when keys come from the cache, else None


class XformersAttention:
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        phases=frozenset({"prefill"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        available=_available,
    )

    def __init__(self, spec: AttentionSpec) -> None:
        from xformers.ops import fmha

        assert spec.num_heads % spec.num_kv_heads == 0
        self._fmha = fmha
        self.spec = spec
        self._plan: _StepPlan | None = None

    def plan(self, batch: AttentionBatch) -> None:
        masks = self._fmha.attn_bias
        device = batch.seq_lens_t.device
        if batch.seq_lens == batch.query_lens:
            bias = masks.BlockDiagonalCausalMask.from_seqlens(batch.query_lens, device=device)
            kv_slots = None
        else:
            bottom_right = masks.BlockDiagonalCausalFromBottomRightMask
            bias = bottom_right.from_seqlens(batch.query_lens, batch.seq_lens, device=device)
            kv_slots = context_slots(batch)
        self._plan = _StepPlan(batch=batch, bias=bias, kv_slots=kv_slots)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        plan, spec = self._plan, self.spec
        assert plan is not None, "plan() first"
        write_kv(kv_cache, k, v, plan.batch.slot_mapping)
        keys, values = k, v  # [L, Hkv, D]
        if plan.kv_slots is not None:
            k_cache, v_cache = kv_cache  # [N, bs, Hkv, D]
            keys = k_cache.flatten(0, 1)[plan.kv_slots].to(q.dtype)
            values = v_cache.flatten(0, 1)[plan.kv_slots].to(q.dtype)
        num_tokens, group = q.shape[0], spec.num_heads // spec.num_kv_heads
        if group == 1:
            query, keys, values = q[None], keys[None], values[None]  # [1, M, H, K]
        else:
            query = q.unflatten(1, (spec.num_kv_heads, group))[None]  # [1, T, G, H, K]
            shape = (1, keys.shape[0], spec.num_kv_heads, group, spec.head_dim)
            keys = keys[None, :, :, None].expand(shape)  # [1, L, G, H, K], stride 0 over H
            values = values[None, :, :, None].expand(shape)
        out = self._fmha.memory_efficient_attention_forward(query, keys, values, attn_bias=plan.bias, scale=spec.scale)
        return out.reshape(num_tokens, spec.num_heads, spec.head_dim)


@hookimpl
def infer_register_attention_backends(register) -> None:
    register("xformers", XformersAttention)
