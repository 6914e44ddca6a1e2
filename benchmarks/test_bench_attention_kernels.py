"""Paged decode kernels at batch 64 x 1024 tokens, 32 heads x 128, KV blocks of 16, bf16.

Peers in one process: `paged-cuda`, the `torch` reference and FlashInfer's paged decode (when it
imports); the ceiling is a device-to-device copy timed here too. Each row records the KV bytes
read, the achieved bandwidth (device time by CUDA events, see `device_time_s`) and its ratio to
the copy bandwidth. A second group times batch-1 decode (split contexts, three launches: cache
write, decode, partition reduce) against FlashInfer.
Run on the GPU machine: `pytest benchmarks/test_bench_attention_kernels.py --benchmark-enable
--benchmark-json=...` (pyproject sets --benchmark-disable for CI).
"""

import math

import pytest
import torch

from infer.api import AttentionBatch, AttentionSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BATCH, SEQ_LEN, NUM_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 64, 1024, 32, 128, 16, torch.bfloat16
HEADS = {"mha-32": 32, "gqa-32-8": 8}  # name -> num_kv_heads


def device_time_s(fn, iters: int = 20, repeats: int = 5, capture: bool = True) -> tuple[float, str]:
    """(device seconds per call of fn, how it was timed): the median over `repeats` of `iters`
    calls between two CUDA events. With `capture`, the calls are captured in one CUDA graph where
    that works, so host launch overhead (tens of microseconds per Triton launch) stays out, as it
    does in an engine that replays graphs; otherwise they are launched back to back."""
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(iters):
            fn()

    how = "stream"
    if capture:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            run, how = graph.replay, "cuda-graph"
        except RuntimeError:  # not capturable: time it on the stream
            torch.cuda.synchronize()
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return sorted(times)[len(times) // 2], how


@pytest.fixture(scope="module")
def copy_bandwidth() -> float:
    """Bytes/s of a large dst.copy_(src), counting bytes read plus bytes written. Not in a graph:
    a captured copy became a memcpy node that ran at 2.8 TB/s on an H200, against 4.2 eagerly."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB, far past L2
    dst = torch.empty_like(src)
    return 2 * src.nbytes / device_time_s(lambda: dst.copy_(src), capture=False)[0]


def decode_batch(num_kv_heads: int, batch_size: int = BATCH, seq_len: int = SEQ_LEN, num_heads: int = NUM_HEADS):
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = batch_size * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch_size)]
    spec = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        scale=1.0 / math.sqrt(HEAD_DIM),
        dtype=DTYPE,
        device=torch.device("cuda"),
        block_size=BLOCK_SIZE,
        max_num_seqs=batch_size,
        max_model_len=max(4096, seq_len),
    )
    batch = AttentionBatch.build([1] * batch_size, [seq_len] * batch_size, tables, BLOCK_SIZE, "cuda")

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(DTYPE)

    kv_cache = tuple(rand(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM) for _ in range(2))
    q, k, v = (
        rand(batch_size, num_heads, HEAD_DIM),
        rand(batch_size, num_kv_heads, HEAD_DIM),
        rand(batch_size, num_kv_heads, HEAD_DIM),
    )
    return spec, batch, kv_cache, q, k, v


def decode_fn(name: str, spec, batch, kv_cache, q, k, v):
    """A zero-argument callable running one decode step of backend `name` (planned already)."""
    if name == "flashinfer":
        flashinfer = pytest.importorskip("flashinfer")
        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        num_seqs, blocks_per_seq = batch.block_tables_t.shape
        wrapper.plan(
            torch.arange(0, num_seqs + 1, dtype=torch.int32, device="cuda") * blocks_per_seq,  # indptr
            batch.block_tables_t.flatten(),  # indices
            torch.full((num_seqs,), BLOCK_SIZE, dtype=torch.int32, device="cuda"),  # last_page_len
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            BLOCK_SIZE,
            q_data_type=DTYPE,
            kv_data_type=DTYPE,
        )
        return lambda: wrapper.run(q, kv_cache)
    if name == "paged-cuda":
        from infer.plugins.attention.paged_cuda import PagedCudaAttention

        backend = PagedCudaAttention(spec)
    else:
        from infer.plugins.attention.torch_backend import TorchAttention

        backend = TorchAttention(spec)
    backend.plan(batch)
    return lambda: backend.forward(q, k, v, kv_cache)


@pytest.mark.benchmark(group="decode-kernel")
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("backend", ["paged-cuda", "torch", "flashinfer"])
def test_decode_kernel(benchmark, copy_bandwidth, backend, heads):
    spec, batch, kv_cache, q, k, v = decode_batch(heads)
    fn = decode_fn(backend, spec, batch, kv_cache, q, k, v)
    expected = decode_fn("torch", spec, batch, kv_cache, q, k, v)()
    torch.testing.assert_close(fn().float(), expected.float(), atol=2e-2, rtol=2e-2)

    kv_bytes = 2 * BATCH * SEQ_LEN * heads * HEAD_DIM * DTYPE.itemsize  # K and V, each read once
    seconds, timing = device_time_s(fn)
    benchmark.extra_info.update(
        kv_bytes_read=kv_bytes,
        kernel_ms=seconds * 1e3,
        achieved_gbps=kv_bytes / seconds / 1e9,
        copy_gbps=copy_bandwidth / 1e9,
        ratio_to_copy=kv_bytes / seconds / copy_bandwidth,
        timing=timing,
    )

    def step():
        fn()
        torch.cuda.synchronize()

    benchmark(step)


# batch-1 decode, where the context is split into partitions: one layer of Llama-2-7B at tp 2 (16 of its
# 32 heads) in latency-1 (context ~256), and the whole model's heads at a long context
SMALL = {"b1-ctx256-16h": (1, 256, 16), "b1-ctx4096-32h": (1, 4096, 32)}


@pytest.mark.benchmark(group="decode-kernel-batch-1")
@pytest.mark.parametrize("shape", SMALL.values(), ids=SMALL.keys())
@pytest.mark.parametrize("backend", ["paged-cuda", "flashinfer"])
def test_decode_kernel_batch_1(benchmark, backend, shape):
    batch_size, seq_len, heads = shape
    spec, batch, kv_cache, q, k, v = decode_batch(heads, batch_size, seq_len, heads)
    fn = decode_fn(backend, spec, batch, kv_cache, q, k, v)
    expected = decode_fn("torch", spec, batch, kv_cache, q, k, v)()
    torch.testing.assert_close(fn().float(), expected.float(), atol=2e-2, rtol=2e-2)
    seconds, timing = device_time_s(fn)
    benchmark.extra_info.update(kernel_us=seconds * 1e6, timing=timing)

    def step():
        fn()
        torch.cuda.synchronize()

    benchmark(step)
