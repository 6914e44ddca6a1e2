"""Compose a prefill backend and a decode backend into one (`--prefill-attention X --attention Y`).

The runner orders every batch decodes first, so the split is one index: the first
`num_decode_seqs` sequences (one token each) go to the decode backend, the rest to prefill.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from infer.api import AttentionBackend, AttentionBatch, KVCache


class HybridAttention:
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill = prefill
        self.decode = decode
        self.num_decode_tokens = 0
        self.has_prefill = False
        # the decode backend's (graphs replay decode steps only), but a window or a soft cap only
        # where both halves honour it: a windowed layer's batch may go to either
        dec, pre = decode.capabilities, prefill.capabilities
        self.capabilities = replace(
            dec, sliding_window=dec.sliding_window and pre.sliding_window, soft_cap=dec.soft_cap and pre.soft_cap
        )

    def plan(self, batch: AttentionBatch) -> None:
        n = batch.num_decode_seqs
        self.num_decode_tokens = n
        self.has_prefill = n < batch.num_seqs
        if n:
            self.decode.plan(batch.select(0, n))
        if self.has_prefill:
            self.prefill.plan(batch.select(n, batch.num_seqs))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, window: int | None = None
    ) -> torch.Tensor:
        n = self.num_decode_tokens
        windowed = {} if window is None else {"window": window}  # a half without windows takes no window=
        if not self.has_prefill:
            return self.decode.forward(q, k, v, kv_cache, **windowed)
        if n == 0:
            return self.prefill.forward(q, k, v, kv_cache, **windowed)
        out_decode = self.decode.forward(q[:n], k[:n], v[:n], kv_cache, **windowed)
        out_prefill = self.prefill.forward(q[n:], k[n:], v[n:], kv_cache, **windowed)
        return torch.cat([out_decode, out_prefill])
