"""The symmetric-memory all-reduce on two GPUs against NCCL's: sums equal (fp32 exactly for two ranks,
bf16 as NCCL rounds), in place, for decode- and prefill-sized tensors, unaligned views, and inside a
CUDA graph replayed with new inputs."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _rank(rank: int, world_size: int, init_file: str) -> None:
    import torch.distributed as dist

    from infer.core.symmetric_memory import SymmetricAllReduce, unavailable_reason

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        assert unavailable_reason(device, world_size) is None
        fast = SymmetricAllReduce(dist.group.WORLD, device, max_bytes=1 << 20)
        gen = torch.Generator(device=device).manual_seed(rank)
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 3, 64, 128):
                x = torch.randn(rows, 4096 // (2 if dtype == torch.float32 else 1), device=device, dtype=dtype, generator=gen)
                expected = x.clone()
                dist.all_reduce(expected)
                assert fast.fits(x), (rows, dtype)
                out = fast(x)
                assert out is x
                torch.testing.assert_close(x, expected, atol=0 if dtype == torch.float32 else 1e-2, rtol=0 if dtype == torch.float32 else 1e-2)
        big = torch.randn(1024, 4096, device=device, dtype=torch.bfloat16)
        assert not fast.fits(big)  # 8 MiB: NCCL's
        half = torch.tensor([1.0], device=device, dtype=torch.float16).expand(8).contiguous()
        assert not fast.fits(half)  # fp16: no one-shot kernel
        # an unaligned view (offset of one element) is summed correctly, in place
        base = torch.randn(4097, device=device, dtype=torch.float32, generator=gen)
        view = base[1:]
        expected = view.clone()
        dist.all_reduce(expected)
        fast(view)
        torch.testing.assert_close(view, expected, atol=0, rtol=0)
        # inside a CUDA graph: a captured chain of sums replayed on new inputs
        static = torch.zeros(4, 4096, device=device, dtype=torch.bfloat16)
        fast(static.add_(1))  # warm-up outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fast(static * 2)
            y = fast(y + 1)
        for value in (1.0, 3.0):
            static.fill_(value * (rank + 1))
            graph.replay()
            first = 2 * value * sum(r + 1 for r in range(world_size))  # sum of 2 * static over the ranks
            assert torch.equal(y.float(), torch.full_like(y.float(), world_size * (first + 1))), (value, y[0, :4])
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_symmetric_all_reduce_matches_nccl(tmp_path):
    import torch.multiprocessing as mp

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.start_processes(_rank, args=(2, str(tmp_path / "init")), nprocs=2, start_method="spawn", join=True)
