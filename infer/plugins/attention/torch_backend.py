"""`torch`: the reference attention backend over the paged KV cache (CPU and GPU).

Every other backend is tested against this one. It gathers each sequence's context through its
block table into a padded [B, L, H, D] tensor and calls SDPA with an explicit mask, which is
simple enough to trust and fast enough for the CPU default. Sliding windows narrow the mask (one
per window the model uses); soft-capped scores (Gemma 2) take the explicit softmax path.
An FP8 cache (`FP8KVCache`) is the reference for every FP8 backend: a write stores
`quantize_fp8(x, scale)`, a read gathers the e4m3 values and multiplies them by the scale in float32
before SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.api import AttentionBatch, AttentionSpec, Capabilities, KVCache
from infer.api.hookspecs import hookimpl
from infer.api.kv_cache import dequantize, gather, kv_scales, write_kv


class TorchAttention:
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        pipeline_safe=True,
        writes_kv_first=True,
        sliding_window=True,
        soft_cap=True,
        fp8_kv=True,
        priority=0,
    )

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.batch: AttentionBatch | None = None
        self.mask: torch.Tensor | None = None  # [B, 1, Qmax, Lmax] bool, True = attend
        self.window_masks: dict[int, torch.Tensor] = {}  # window -> the mask narrowed to it
        self.query_index: torch.Tensor | None = None  # [T] flat index into [B * Qmax]
        self.context_width = 0

    def plan(self, batch: AttentionBatch) -> None:
        device = batch.positions.device
        bs = batch.block_size
        num_seqs, q_max = batch.num_seqs, max(batch.max_query_len, 1)
        self.context_width = -(-batch.max_seq_len // bs) * bs
        self.batch = batch
        q_lens = torch.tensor(batch.query_lens, device=device)
        seq_lens = batch.seq_lens_t.to(torch.int64)
        # query j of seq i sits at position seq_len - q_len + j; it sees keys at positions <= that.
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(q_max, device=device)[None, :]  # [B, Qmax]
        k_pos = torch.arange(self.context_width, device=device)  # [Lmax]
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, Lmax]
        mask &= k_pos[None, None, :] < seq_lens[:, None, None]
        # padded query rows attend to key 0 so softmax stays finite; their output is dropped.
        mask[:, :, 0] = True
        self.mask = mask[:, None]
        self.window_masks = {}
        for w in self.spec.sliding_windows:
            windowed = mask & (k_pos[None, None, :] > q_pos[:, :, None] - w)
            windowed[:, :, 0] |= ~windowed.any(-1)  # padded rows again
            self.window_masks[w] = windowed[:, None]
        starts = batch.cu_seqlens_q[:-1].to(torch.int64)
        token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
        token_off = torch.arange(batch.num_tokens, device=device) - starts[token_seq]
        self.query_index = token_seq * q_max + token_off

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, window: int | None = None
    ) -> torch.Tensor:
        batch, spec = self.batch, self.spec
        assert batch is not None and self.mask is not None and self.query_index is not None, "plan() first"
        write_kv(kv_cache, k, v, batch.slot_mapping)
        (k_cache, v_cache), (k_scale, v_scale) = kv_cache, kv_scales(kv_cache)
        num_seqs, q_max = batch.num_seqs, self.mask.shape[2]
        num_ctx_blocks = self.context_width // batch.block_size
        tables = batch.block_tables_t[:, :num_ctx_blocks].to(torch.int64)  # [B, nb]
        # [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]
        keys = dequantize(gather(k_cache, tables), k_scale, q.dtype).flatten(1, 2).transpose(1, 2)
        values = dequantize(gather(v_cache, tables), v_scale, q.dtype).flatten(1, 2).transpose(1, 2)
        queries = q.new_zeros(num_seqs * q_max, spec.num_heads, spec.head_dim)
        queries[self.query_index] = q
        queries = queries.view(num_seqs, q_max, spec.num_heads, spec.head_dim).transpose(1, 2)  # [B, H, Q, D]
        grouped = spec.num_kv_heads != spec.num_heads
        mask = self.mask if window is None else self.window_masks[window]
        if spec.soft_cap is None:  # grouped-query heads read their shared K/V in place (half a long step's time)
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=spec.scale, enable_gqa=grouped
            )
        else:
            if grouped:
                group = spec.num_heads // spec.num_kv_heads
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            scores = (queries @ keys.transpose(-1, -2)).float() * spec.scale
            scores = spec.soft_cap * torch.tanh(scores / spec.soft_cap)
            out = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype) @ values
        out = out.transpose(1, 2).reshape(num_seqs * q_max, spec.num_heads, spec.head_dim)
        return out[self.query_index]


@hookimpl
def infer_register_attention_backends(register) -> None:
    register("torch", TorchAttention)
