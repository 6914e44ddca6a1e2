"""Attention checks with messages that point at the fault, and the cases the kit runs a backend on.

`check_attention` runs one backend on one `AttentionCase` (random physical block placement) and
compares the written cache slots and every sequence's output with the naive oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infer.testing.attention import BATCH_SPECS, AttentionCase, BatchSpec, naive_attention, stored, written

HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@dataclass(frozen=True, slots=True)
class KitCase:
    batch_spec: BatchSpec
    heads: str  # a key of HEADS
    block_size: int
    dtype: torch.dtype

    def describe(self) -> str:
        num_heads, num_kv = HEADS[self.heads]
        return (
            f"batch spec '{self.batch_spec.name}' (block tables randomly permuted; {self.heads}: {num_heads} query "
            f"heads, {num_kv} KV heads; block size {self.block_size}; {str(self.dtype).removeprefix('torch.')})"
        )

    @property
    def id(self) -> str:
        return f"{self.batch_spec.name}-{self.heads}-bs{self.block_size}"


def tolerance(dtype: torch.dtype) -> float:
    return 2e-3 if dtype == torch.float32 else 3e-2


def specs_for(phases: frozenset[str]) -> list[BatchSpec]:
    """The named batches a backend serving `phases` gets (a prefill-only one never sees a decode)."""

    def serves(spec: BatchSpec) -> bool:
        has_decode = any(q == 1 for q in spec.query_lens)
        has_prefill = any(q > 1 for q in spec.query_lens)
        return (not has_decode or "decode" in phases) and (not has_prefill or "prefill" in phases)

    return [s for s in BATCH_SPECS if serves(s)]


def block_sizes_for(declared: frozenset[int] | None) -> list[int]:
    if declared is None:
        return [4, 16]
    ordered = sorted(declared)
    return sorted({ordered[0], 16 if 16 in declared else ordered[-1]})


def kit_cases(capabilities: Any, dtype: torch.dtype) -> list[KitCase]:
    return [
        KitCase(spec, heads, block_size, dtype)
        for spec in specs_for(capabilities.phases)
        for heads in HEADS
        for block_size in block_sizes_for(capabilities.block_sizes)
    ]


def _hint(case: AttentionCase, bad: list[int]) -> str:
    batch, spec = case.batch, case.spec
    if all(batch.seq_lens[i] > batch.block_size for i in bad) and any(s <= batch.block_size for s in batch.seq_lens):
        return (
            "only sequences longer than one block differ: is the block table read through "
            "block_tables[seq, pos // block_size] (offset pos % block_size) for every position?"
        )
    if all(batch.seq_lens[i] > batch.block_size for i in bad):
        return (
            "every failing sequence spans several blocks: is the block table read through "
            "block_tables[seq, pos // block_size] (offset pos % block_size) for every position?"
        )
    if spec.num_kv_heads != spec.num_heads:
        return (
            f"does query head h read KV head h // {spec.num_heads // spec.num_kv_heads} "
            f"(grouped-query attention: num_heads // num_kv_heads query heads per KV head)?"
        )
    if any(batch.query_lens[i] > 1 for i in bad):
        return (
            "is the causal mask applied among the new tokens (query j of a sequence sees positions "
            "< seq_len - query_len + j + 1)?"
        )
    return "are the scale (spec.scale) and the context length (seq_lens[i] tokens, all of them) right?"


def check_cache_writes(name: str, where: str, case: AttentionCase) -> None:
    batch = case.batch
    for i, (which, new) in enumerate((("K", case.k), ("V", case.v))):
        expected = stored(case.kv_cache, i, new).float()
        wrong = (written(case, i) != expected).flatten(1).any(-1).nonzero().flatten().tolist()
        if not wrong:
            continue
        t = wrong[0]
        seq = next(i for i in range(batch.num_seqs) if batch.cu_seqlens_q[i + 1].item() > t)
        pos = int(batch.positions[t])
        raise AssertionError(
            f"attention backend {name}: {where}: the new tokens' {which} were not written to their cache slots "
            f"({len(wrong)} of {batch.num_tokens} tokens); token {t} (sequence {seq}, position {pos}) belongs in slot "
            f"slot_mapping[{t}] = {int(batch.slot_mapping[t])} = block_tables[{seq}, {pos} // {batch.block_size}] * "
            f"{batch.block_size} + {pos % batch.block_size}: does forward() write k and v through batch.slot_mapping?"
        )


def check_output(name: str, where: str, case: AttentionCase, out: torch.Tensor, tol: float) -> None:
    if tuple(out.shape) != tuple(case.q.shape):
        raise AssertionError(
            f"attention backend {name}: {where}: forward returned shape {tuple(out.shape)}, "
            f"expected [num_tokens, num_heads, head_dim] = {tuple(case.q.shape)}"
        )
    expected = naive_attention(case).to(out.device)
    err = (out.float() - expected).abs()
    too_far = err > tol + tol * expected.abs()
    bad, errors = [], []
    for i in range(case.batch.num_seqs):
        lo, hi = int(case.batch.cu_seqlens_q[i]), int(case.batch.cu_seqlens_q[i + 1])
        if bool(too_far[lo:hi].any()) or not bool(torch.isfinite(out[lo:hi]).all()):
            bad.append(i)
            errors.append(float(err[lo:hi].max()))
    if not bad:
        return
    others = f" (sequences {', '.join(map(str, bad))} of {case.batch.num_seqs} differ)" if len(bad) > 1 else ""
    raise AssertionError(
        f"attention backend {name}: {where}: output of sequence {bad[0]} (query length "
        f"{case.batch.query_lens[bad[0]]}, {case.batch.seq_lens[bad[0]]} tokens in context) differs from the "
        f"reference — max abs err {errors[0]:.3g}{others}; {_hint(case, bad)}"
    )


def check_attention(name: str, factory: Any, case: AttentionCase, where: str, tol: float) -> None:
    backend = factory(case.spec)
    backend.plan(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.kv_cache)
    check_cache_writes(name, where, case)
    check_output(name, where, case, out, tol)


def check_cuda_graph(name: str, factory: Any, case: AttentionCase, where: str, tol: float) -> None:
    """Capture forward on a placeholder decode batch, then plan the real batch into the same static
    tensors and replay, as the engine's CudaGraphRunner does: the kernels must read the batch only
    through those tensors."""
    batch, device = case.batch, case.q.device
    assert batch.num_decode_seqs == batch.num_seqs, "CUDA graphs serve decode-only batches"
    n, width = batch.num_seqs, batch.block_tables_t.shape[1]
    used = {b for table in batch.block_tables for b in table}
    null = min(set(range(case.kv_cache[0].shape[0])) - used)  # a block no sequence owns
    seq_lens = torch.ones(n, dtype=torch.int32, device=device)
    tables = torch.full((n, width), null, dtype=torch.int32, device=device)
    slots = torch.full((n,), null * batch.block_size, dtype=torch.int64, device=device)
    positions = torch.zeros(n, dtype=torch.int64, device=device)
    cu = torch.arange(n + 1, dtype=torch.int32, device=device)

    def layout(lens: list[int], block_tables: list[list[int]]):
        return type(batch)(
            query_lens=[1] * n,
            seq_lens=lens,
            block_tables=block_tables,
            block_size=batch.block_size,
            num_decode_seqs=n,
            cu_seqlens_q=cu,
            seq_lens_t=seq_lens,
            block_tables_t=tables,
            slot_mapping=slots,
            positions=positions,
        )

    backend = factory(case.spec)
    q, k, v = torch.zeros_like(case.q), torch.zeros_like(case.k), torch.zeros_like(case.v)
    backend.plan(layout([1] * n, [[null]] * n))
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, case.kv_cache)  # warm-up: compilation happens outside the graph
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = backend.forward(q, k, v, case.kv_cache)
    except Exception as exc:
        raise AssertionError(
            f"attention backend {name} declares cuda_graph_safe but forward() cannot be captured "
            f"in a CUDA graph ({type(exc).__name__}: {exc}): no host syncs or allocations in forward"
        ) from exc
    for static, real in (
        (seq_lens, batch.seq_lens_t),
        (tables, batch.block_tables_t),
        (slots, batch.slot_mapping),
        (positions, batch.positions),
        (q, case.q),
        (k, case.k),
        (v, case.v),
    ):
        static.copy_(real)
    backend.plan(layout(list(batch.seq_lens), [list(t) for t in batch.block_tables]))
    graph.replay()
    torch.cuda.synchronize(device)
    check_output(
        name, f"{where}, replayed from a CUDA graph captured on another batch of the same size", case, out, tol
    )
