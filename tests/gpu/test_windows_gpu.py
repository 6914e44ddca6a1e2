"""Sliding windows and soft caps on a GPU: `paged-cuda` and `flashinfer` against the torch backend at
windows of 256 and 4096 tokens over contexts longer than both (up to 5000 tokens), in decode, extend
and mixed batches at Llama shapes (GQA 32/8, head_dim 128), with and without a soft cap; paged-cuda in
bf16 and fp32, FlashInfer in bf16 (it has no fp32 kernels); and a decode step of a windowed layer and
a full one captured in a CUDA graph, then replayed on other lengths. Run: `pytest -m gpu tests/gpu`.
FlashInfer JIT-compiles a variant per window and soft-cap flag on first use (about a minute each).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from infer.api import AttentionBatch, AttentionSpec
from infer.plugins.attention.torch_backend import TorchAttention
from infer.testing.attention import AttentionCase

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MAX_MODEL_LEN, MAX_NUM_SEQS = 5000 + 64, 8
WINDOWS = (256, 4096)  # both planned by every backend here, as a model with two windows would
# Scores of these random heads are a few units (queries are scaled by Q_SCALE to make attention peaked
# enough that a missed window shows): a cap of 3 bends them. Gemma 2's own cap is 50.
SOFT_CAP, Q_SCALE = 3.0, 2.0
# on each sequence's relative error (Frobenius, over its tokens): one that ignores a window is off by > 0.1
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
BATCHES = {  # name -> (query_lens, context_lens); decodes first, as the runner orders them
    "decode": ((1,) * 8, (4999, 4500, 4096, 4095, 300, 256, 255, 17)),
    "extend": ((512, 7, 300), (4400, 4990, 100)),
    "mixed": ((1,) * 4 + (200, 64), (4999, 3000, 255, 0, 4700, 130)),
}
WINDOW_IDS = {256: "w256", 4096: "w4096", None: "full"}
CAPS = pytest.mark.parametrize("soft_cap", [None, SOFT_CAP], ids=["uncapped", "capped"])


def windowed_case(
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    dtype: torch.dtype,
    soft_cap: float | None,
    seed: int = 0,
    num_blocks: int | None = None,
) -> AttentionCase:
    """A batch over a paged cache with its contexts at permuted blocks, the cache filled by one scatter;
    block tables as wide as MAX_MODEL_LEN, so two cases of as many sequences share graph buffers."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = num_blocks or sum(blocks_per_seq) + 8
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(perm[start : start + n])
        start += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    k_cache = rand(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)  # garbage where unused
    v_cache = rand(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    dense_k = [rand(s, NUM_KV_HEADS, HEAD_DIM) for s in seq_lens]
    dense_v = [rand(s, NUM_KV_HEADS, HEAD_DIM) for s in seq_lens]
    for table, c_len, seq_k, seq_v in zip(tables, context_lens, dense_k, dense_v):
        pos = torch.arange(c_len, device=DEVICE)
        slots = torch.tensor(table, device=DEVICE)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM).index_copy_(0, slots, seq_k[:c_len])
        v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM).index_copy_(0, slots, seq_v[:c_len])
    spec = AttentionSpec(
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        scale=1.0 / math.sqrt(HEAD_DIM),
        dtype=dtype,
        device=torch.device(DEVICE),
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        sliding_windows=WINDOWS,
        soft_cap=soft_cap,
    )
    max_blocks = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    batch = AttentionBatch.build(list(query_lens), seq_lens, tables, BLOCK_SIZE, DEVICE, max_blocks=max_blocks)
    return AttentionCase(
        spec=spec,
        batch=batch,
        kv_cache=(k_cache, v_cache),
        q=rand(sum(query_lens), NUM_HEADS, HEAD_DIM) * Q_SCALE,
        k=torch.cat([k[c:] for k, c in zip(dense_k, context_lens)]),
        v=torch.cat([v[c:] for v, c in zip(dense_v, context_lens)]),
        dense_k=dense_k,
        dense_v=dense_v,
    )


def attend(backend, case: AttentionCase, window: int | None) -> torch.Tensor:
    backend.plan(case.batch)
    return backend.forward(case.q, case.k, case.v, case.kv_cache, **({} if window is None else {"window": window}))


def relative_error(out: torch.Tensor, expected: torch.Tensor, query_lens: list[int]) -> float:
    """The largest over the sequences of ||out - expected|| / ||expected|| over their tokens' outputs."""
    pairs = zip(out.float().split(query_lens), expected.float().split(query_lens))
    return max(((o - e).norm() / e.norm()).item() for o, e in pairs)


def torch_attention(case: AttentionCase, window: int | None) -> torch.Tensor:
    """The reference. It writes the new K/V too: the same values into the same slots as the backend."""
    return attend(TorchAttention(case.spec), case, window)


def assert_matches_torch(out: torch.Tensor, case: AttentionCase, window: int | None) -> None:
    expected = torch_attention(case, window)
    error = relative_error(out, expected, case.batch.query_lens)
    assert error < TOLERANCE[case.spec.dtype], f"relative error {error:.2e} against the torch backend"


def poison_outside_windows(case: AttentionCase, window: int) -> int:
    """NaN into the cached blocks wholly before each sequence's first new token's window (a kernel that
    reads one and masks it gets 0 * NaN = NaN); returns how many."""
    poisoned = 0
    for q_len, seq_len, table in zip(case.batch.query_lens, case.batch.seq_lens, case.batch.block_tables):
        oldest_seen = max(seq_len - q_len - window + 1, 0)
        for block in table[: oldest_seen // BLOCK_SIZE]:
            for cache in case.kv_cache:
                cache[block] = float("nan")
            poisoned += 1
    return poisoned


@pytest.mark.parametrize("batch_name", BATCHES)
def test_the_windows_and_the_cap_change_these_cases(batch_name):
    """Each batch holds contexts longer than both windows, so the torch backend's output under each
    window, and capped, is further than 5 x the tolerance from its plain one: a backend that ignored
    a window or the cap could not pass the tests below."""
    plain = windowed_case(*BATCHES[batch_name], torch.float32, None)
    capped = windowed_case(*BATCHES[batch_name], torch.float32, SOFT_CAP)  # the same seed: the same data
    full, lens, far = torch_attention(plain, None), plain.batch.query_lens, 5 * max(TOLERANCE.values())
    for window in WINDOWS:
        assert relative_error(torch_attention(plain, window), full, lens) > far
    assert relative_error(torch_attention(capped, None), full, lens) > far


# --------------------------------------------------------------------------------------------- paged-cuda


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("window", [*WINDOWS, None], ids=WINDOW_IDS.get)
@CAPS
@pytest.mark.parametrize("dtype", TOLERANCE, ids=lambda d: str(d).removeprefix("torch."))
def test_paged_cuda_matches_torch(batch_name, window, soft_cap, dtype):
    """Split decode (8 x 8 programs are few), prefill and mixed; the blocks outside every window hold
    NaN for the kernels, which must never read them."""
    from infer.plugins.attention.paged_cuda import PagedCudaAttention

    case = windowed_case(*BATCHES[batch_name], dtype, soft_cap, seed=1)
    expected = torch_attention(case, window)
    if window is not None:
        assert poison_outside_windows(case, window) > 0
    out = attend(PagedCudaAttention(case.spec), case, window)
    error = relative_error(out, expected, case.batch.query_lens)
    assert error < TOLERANCE[dtype], f"relative error {error:.2e} against the torch backend"


@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS.get)
def test_paged_cuda_unsplit_decode_matches_torch(window):
    from infer.plugins.attention.paged_cuda import PagedCudaAttention

    case = windowed_case(*BATCHES["decode"], torch.bfloat16, SOFT_CAP, seed=2)
    backend = PagedCudaAttention(case.spec, split_below_programs=1)
    out = attend(backend, case, window)
    assert not backend._plan.split
    assert_matches_torch(out, case, window)


def test_paged_cuda_cuda_graph_replay_with_a_window():
    """One decode step of a windowed layer and a full one captured; replayed on other lengths, tables
    and inputs copied in place, both outputs match the torch backend's on the new step."""
    from infer.plugins.attention.paged_cuda import PagedCudaAttention

    num_blocks = MAX_NUM_SEQS * (-(-MAX_MODEL_LEN // BLOCK_SIZE)) + 8
    first = windowed_case((1,) * 8, (100, 4999, 1, 2047, 513, 16, 3000, 64), torch.bfloat16, SOFT_CAP, 3, num_blocks)
    second = windowed_case((1,) * 8, (4600, 7, 900, 31, 4999, 1024, 0, 333), torch.bfloat16, SOFT_CAP, 4, num_blocks)
    backend = PagedCudaAttention(first.spec)
    backend.plan(first.batch)  # graph-shaped: the same batch tensors are refilled before each replay

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        windowed = backend.forward(first.q, first.k, first.v, first.kv_cache, window=256)
        return windowed, backend.forward(first.q, first.k, first.v, first.kv_cache)

    step()  # compile both variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        windowed, full = step()
    for name in ("seq_lens_t", "block_tables_t", "slot_mapping", "positions"):
        getattr(first.batch, name).copy_(getattr(second.batch, name))
    for dst, src in zip((first.q, first.k, first.v, *first.kv_cache), (second.q, second.k, second.v, *second.kv_cache)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_torch(windowed, second, 256)
    assert_matches_torch(full, second, None)


# --------------------------------------------------------------------------------------------- flashinfer


@pytest.fixture(scope="module")
def flashinfer_cls():
    pytest.importorskip("flashinfer")
    module = importlib.import_module("infer.plugins.attention.flashinfer_backend")
    if reason := module._available():
        pytest.skip(reason)
    return module.FlashInferAttention


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("window", [*WINDOWS, None], ids=WINDOW_IDS.get)
@CAPS
def test_flashinfer_matches_torch(flashinfer_cls, batch_name, window, soft_cap):
    """bf16; the decode batch (8 sequences, a graph size) runs through a graph-mode wrapper, eagerly."""
    case = windowed_case(*BATCHES[batch_name], torch.bfloat16, soft_cap, seed=5)
    assert_matches_torch(attend(flashinfer_cls(case.spec), case, window), case, window)


@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS.get)
def test_flashinfer_eager_decode_matches_torch(flashinfer_cls, window):
    case = windowed_case(*BATCHES["decode"], torch.bfloat16, SOFT_CAP, seed=6)
    assert_matches_torch(attend(flashinfer_cls(case.spec, cuda_graph=False), case, window), case, window)


def test_flashinfer_cuda_graph_replay_with_a_window(flashinfer_cls):
    """As paged-cuda's: the next step's batch is planned (refilling every window's graph-mode page
    tables in place) before the replay, as CudaGraphRunner does."""
    num_blocks = MAX_NUM_SEQS * (-(-MAX_MODEL_LEN // BLOCK_SIZE)) + 8
    first = windowed_case((1,) * 8, (300, 3, 4999, 47, 0, 200, 4200, 16), torch.bfloat16, SOFT_CAP, 7, num_blocks)
    second = windowed_case((1,) * 8, (5, 4999, 31, 4096, 64, 17, 250, 3000), torch.bfloat16, SOFT_CAP, 8, num_blocks)
    backend = flashinfer_cls(first.spec)
    backend.plan(first.batch)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        windowed = backend.forward(first.q, first.k, first.v, first.kv_cache, window=256)
        return windowed, backend.forward(first.q, first.k, first.v, first.kv_cache)

    step()  # JIT and warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        windowed, full = step()
    for dst, src in zip((first.q, first.k, first.v, *first.kv_cache), (second.q, second.k, second.v, *second.kv_cache)):
        dst.copy_(src)
    first.batch.slot_mapping.copy_(second.batch.slot_mapping)  # what the captured cache write reads
    backend.plan(second.batch)
    graph.replay()
    torch.cuda.synchronize()
    assert all(list(w.graph_decoders) == [8] for w in backend.windows.values())
    assert_matches_torch(windowed, second, 256)
    assert_matches_torch(full, second, None)
