"""`paged-cuda` compiled on a GPU, at real shapes: Llama-2-7B heads (32 x 128), GQA 32/8, batch
up to 64, contexts up to 4096, bf16/fp16/fp32, KV blocks of 16 and 32. Run: `pytest -m gpu tests/gpu`.
"""

import math
import os
import random

import pytest
import torch

from infer.api import AttentionBatch, AttentionSpec
from infer.testing.attention import AttentionCase, check_backend, naive_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 interprets the kernels"),
]
pytest.importorskip("triton")

HEAD_DIM, MAX_MODEL_LEN = 128, 4096 + 64
HEADS = {"mha": (32, 32), "gqa": (32, 8)}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
_rng = random.Random(0)
BATCHES = {  # name -> (query_lens, context_lens); decodes first, as the runner orders them
    "decode-64-to-4096": ((1,) * 64, (4095,) + tuple(_rng.randrange(0, 4095) for _ in range(63))),
    "decode-1x4096": ((1,), (4095,)),
    "decode-edges": ((1,) * 5, (0, 15, 16, 511, 512)),
    "prefill-varlen": ((512, 1000, 37, 2048), (0, 0, 0, 0)),
    "extend-chunked-spec": ((256, 7, 64), (3000, 4089, 17)),
    "mixed-60-decode": ((1,) * 60 + (300, 5), tuple(_rng.randrange(1, 4000) for _ in range(60)) + (0, 1200)),
}


def paged_case(
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    num_blocks: int | None = None,
) -> AttentionCase:
    """`infer.testing.attention.make_case` at real sizes: the cache is filled with one scatter."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = num_blocks or sum(blocks_per_seq) + 8
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(perm[start : start + n])
        start += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    k_cache = rand(num_blocks, block_size, num_kv_heads, HEAD_DIM)  # garbage where unused
    v_cache = rand(num_blocks, block_size, num_kv_heads, HEAD_DIM)
    dense_k = [rand(s, num_kv_heads, HEAD_DIM) for s in seq_lens]
    dense_v = [rand(s, num_kv_heads, HEAD_DIM) for s in seq_lens]
    for table, c_len, seq_k, seq_v in zip(tables, context_lens, dense_k, dense_v):
        pos = torch.arange(c_len, device="cuda")
        slots = torch.tensor(table, device="cuda")[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, HEAD_DIM).index_copy_(0, slots, seq_k[:c_len])
        v_cache.view(-1, num_kv_heads, HEAD_DIM).index_copy_(0, slots, seq_v[:c_len])
    spec = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        scale=1.0 / math.sqrt(HEAD_DIM),
        dtype=dtype,
        device=torch.device("cuda"),
        block_size=block_size,
        max_num_seqs=64,
        max_model_len=MAX_MODEL_LEN,
    )
    max_blocks = -(-MAX_MODEL_LEN // block_size)
    batch = AttentionBatch.build(list(query_lens), seq_lens, tables, block_size, "cuda", max_blocks=max_blocks)
    return AttentionCase(
        spec=spec,
        batch=batch,
        kv_cache=(k_cache, v_cache),
        q=rand(sum(query_lens), num_heads, HEAD_DIM),
        k=torch.cat([k[c:] for k, c in zip(dense_k, context_lens)]),
        v=torch.cat([v[c:] for v, c in zip(dense_v, context_lens)]),
        dense_k=dense_k,
        dense_v=dense_v,
    )


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", TOLERANCE, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_naive(batch_name, heads, block_size, dtype):
    from infer.plugins.attention.paged_cuda import PagedCudaAttention

    case = paged_case(*BATCHES[batch_name], *heads, block_size=block_size, dtype=dtype)
    check_backend(PagedCudaAttention, case, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("split_below_programs", [1, 10**6], ids=["unsplit", "split"])
def test_split_and_unsplit_decode_agree(split_below_programs):
    from infer.plugins.attention.paged_cuda import PagedCudaAttention

    case = paged_case(*BATCHES["decode-64-to-4096"], *HEADS["gqa"], block_size=16, dtype=torch.bfloat16, seed=1)
    backend = PagedCudaAttention(case.spec, split_below_programs=split_below_programs)
    backend.plan(case.batch)
    assert backend._plan.split == (split_below_programs > 1)
    out = backend.forward(case.q, case.k, case.v, case.kv_cache)
    torch.testing.assert_close(out.float(), naive_attention(case), atol=2e-2, rtol=2e-2)


def replayed(first: AttentionCase, second: AttentionCase):
    """`PagedCudaAttention`'s forward over `first`, captured in a CUDA graph, then replayed with `second`'s
    lengths, tables, inputs and cache copied into first's tensors in place: (the backend, the output)."""
    from infer.plugins.attention.paged_cuda import PagedCudaAttention

    backend = PagedCudaAttention(first.spec)
    backend.plan(first.batch)  # graph-shaped: the same batch tensors are refilled before each replay
    kv_cache = first.kv_cache
    backend.forward(first.q, first.k, first.v, kv_cache)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(first.q, first.k, first.v, kv_cache)
    for name in ("seq_lens_t", "block_tables_t", "slot_mapping", "positions"):
        getattr(first.batch, name).copy_(getattr(second.batch, name))
    for dst, src in [(first.q, second.q), (first.k, second.k), (first.v, second.v), *zip(kv_cache, second.kv_cache)]:
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    return backend, out


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_decode_cuda_graph_replay(heads):
    """Capture one decode step, then replay it on other lengths, tables and inputs copied in place."""
    num_blocks = 8 * (-(-MAX_MODEL_LEN // 16)) + 8
    first = paged_case((1,) * 8, (100, 4000, 1, 2047, 513, 16, 3000, 64), *heads, 16, torch.bfloat16, 2, num_blocks)
    second = paged_case((1,) * 8, (4095, 7, 900, 31, 2500, 1024, 0, 333), *heads, 16, torch.bfloat16, 3, num_blocks)
    _, out = replayed(first, second)
    torch.testing.assert_close(out.float(), naive_attention(second), atol=2e-2, rtol=2e-2)
