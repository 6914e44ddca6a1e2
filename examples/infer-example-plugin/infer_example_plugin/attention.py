"""`example-sdpa`: attention over the paged KV cache, one sequence at a time, with torch's SDPA.

`forward` writes the step's new K/V into their slots (`write_kv`), then for each sequence reads its
blocks through its block table (`gather`), makes them the model's dtype (`dequantize`: an FP8 cache
times its scales) and runs causal SDPA of its new tokens over its whole context. Slow (a Python loop
over the sequences) but plain; it declines sliding windows and soft-capped scores in its
capabilities, so the engine refuses a model that needs them with this backend.
`pytest --infer-kit attention=example-sdpa` checks it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import infer
from infer.api import AttentionBatch, AttentionSpec, KVCache
from infer.api.kv_cache import dequantize, gather, kv_scales, write_kv

INFER_PLUGIN_API = ">=2,<3"


class SdpaAttention:
    # every K/V of a step is written before any is read: a speculative verify step may rely on it
    capabilities = infer.Capabilities(devices=frozenset({"cpu", "cuda"}), writes_kv_first=True, fp8_kv=True)

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.batch: AttentionBatch | None = None

    def plan(self, batch: AttentionBatch) -> None:
        self.batch = batch  # nothing to precompute: forward reads the layout as it goes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        batch, spec = self.batch, self.spec
        assert batch is not None, "plan() first"
        write_kv(kv_cache, k, v, batch.slot_mapping)
        (k_cache, v_cache), (k_scale, v_scale) = kv_cache, kv_scales(kv_cache)
        group = spec.num_heads // spec.num_kv_heads  # query heads per KV head
        out, start = torch.empty_like(q), 0
        for i, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens)):
            table = batch.block_tables_t[i, : -(-seq_len // batch.block_size)].long()
            # [blocks, block_size, Hkv, D] -> [Hkv, seq_len, D] -> [H, seq_len, D]
            keys = dequantize(gather(k_cache, table), k_scale, q.dtype).flatten(0, 1)[:seq_len].transpose(0, 1)
            values = dequantize(gather(v_cache, table), v_scale, q.dtype).flatten(0, 1)[:seq_len].transpose(0, 1)
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
            # query j sits at position seq_len - q_len + j and sees the positions up to its own
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
            queries = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=spec.scale)
            out[start : start + q_len] = attended.transpose(0, 1)
            start += q_len
        return out


@infer.hookimpl
def infer_register_attention_backends(register) -> None:
    register("example-sdpa", SdpaAttention)
