"""The attention backend, and the batch layout and KV cache it is handed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from infer.api.capabilities import Capabilities


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The shape of attention in the model being served (per rank under tensor parallelism)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    device: torch.device
    block_size: int
    max_num_seqs: int  # decode rows per step at most: requests x (1 + the decoder's lookahead)
    max_model_len: int
    sliding_windows: tuple[int, ...] = ()  # the distinct windows the model's layers pass to forward(window=)
    soft_cap: float | None = None  # scores s (after the scale) become soft_cap * tanh(s / soft_cap)
    kv_cache_dtype: torch.dtype | None = None  # None: dtype; float8_e4m3fn: scaled (infer.runtime.kv_cache.FP8KVCache)


@dataclass(slots=True)
class AttentionBatch:
    """One step's attention layout, built by the runner. Sequences are ordered decodes first.

    A sequence's new tokens are the last `query_lens[i]` of its `seq_lens[i]` cached tokens.
    """

    query_lens: list[int]  # seq i -> new tokens this step
    seq_lens: list[int]  # seq i -> tokens in the cache after this step (context + new)
    block_tables: list[list[int]]  # seq i -> physical block ids
    block_size: int
    num_decode_seqs: int  # leading sequences with query_len == 1
    # device tensors
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens_t: torch.Tensor  # [B] int32
    block_tables_t: torch.Tensor  # [B, max_blocks] int32, rows padded with 0 (never read)
    slot_mapping: torch.Tensor  # [T] int64: token t's K/V go to slot block * block_size + offset
    positions: torch.Tensor  # [T] int64

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        max_blocks: int | None = None,
    ) -> "AttentionBatch":
        num_decode = 0
        while num_decode < len(query_lens) and query_lens[num_decode] == 1:
            num_decode += 1
        positions: list[int] = []
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s - q, s):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max_blocks if max_blocks is not None else max((len(t) for t in block_tables), default=0)
        width = max(width, 1)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            block_tables=[list(t) for t in block_tables],
            block_size=block_size,
            num_decode_seqs=num_decode,
            cu_seqlens_q=torch.tensor(cu, **i32),
            seq_lens_t=torch.tensor(seq_lens, **i32),
            block_tables_t=torch.tensor(padded, **i32).reshape(len(block_tables), width),
            slot_mapping=torch.tensor(slots, **i64),
            positions=torch.tensor(positions, **i64),
        )

    def select(self, start: int, stop: int) -> "AttentionBatch":
        """Sequences [start, stop) as a batch of their own (tensors are views or small copies)."""
        t0, t1 = sum(self.query_lens[:start]), sum(self.query_lens[:stop])
        cu = self.cu_seqlens_q[start : stop + 1] - self.cu_seqlens_q[start]
        return AttentionBatch(
            query_lens=self.query_lens[start:stop],
            seq_lens=self.seq_lens[start:stop],
            block_tables=self.block_tables[start:stop],
            block_size=self.block_size,
            num_decode_seqs=max(0, min(self.num_decode_seqs, stop) - start),
            cu_seqlens_q=cu,
            seq_lens_t=self.seq_lens_t[start:stop],
            block_tables_t=self.block_tables_t[start:stop],
            slot_mapping=self.slot_mapping[t0:t1],
            positions=self.positions[t0:t1],
        )


KVCache = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_blocks, block_size, num_kv_heads, head_dim]


class AttentionBackend(Protocol):
    """Attention over the paged KV cache.

    Built once per engine with an `AttentionSpec`. `plan` runs once per step, before the model
    forward, and may precompute anything that depends only on the batch layout. `forward` runs
    once per layer: it writes the new tokens' K/V into their slots of that layer's cache and
    returns the attention output for the new tokens (causal within a sequence, attending to the
    sequence's whole cached context).
    Sliding windows: a backend whose `capabilities.sliding_window` is true also takes `window=W`
    (one of `spec.sliding_windows`), and then the token at position p attends to positions
    p - W + 1 .. p only (W tokens, itself included, as HF transformers' `sliding_window`). Models
    pass `window=` only for windowed layers, and only to such a backend: the builder refuses
    the others when the model's window is shorter than the context.
    Optional ability: `RotaryFusingAttention.forward_with_rotary` is `forward` of q and k rotated
    (Neox-style, in the cache write) at `positions` by the tables cos, sin ([max_position, head_dim / 2]
    float32), for the heads `fuses_rotary()` accepts; a model calls it instead of rotating first.
    """

    capabilities: ClassVar[Capabilities]

    def plan(self, batch: AttentionBatch) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: KVCache,
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]


@runtime_checkable
class RotaryFusingAttention(Protocol):
    def fuses_rotary(self) -> bool: ...

    def forward_with_rotary(  # also takes window= where forward does
        self, positions: Tensor, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, cos: Tensor, sin: Tensor
    ) -> Tensor: ...
