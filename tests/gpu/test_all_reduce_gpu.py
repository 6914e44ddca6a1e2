"""Tensor parallelism's all-reduces on two GPUs against NCCL's. The symmetric-memory one-shot: sums
equal (fp32 exactly for two ranks, bf16 as NCCL rounds), in place, for decode- and prefill-sized
tensors, unaligned views, and inside a CUDA graph replayed with new inputs. FlashInfer's: the sum and
the sum fused with the residual add and RMSNorm, eagerly and replayed from a graph. The GEMVs' partial
sums pushed into the ranks' exchange (`infer.distributed.all_reduce.lamport`) and summed there, likewise."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _on_two_ranks(fn, tmp_path) -> None:
    """`fn(rank, 2, init_file)` in two spawned processes, NVLink multicast off (not lent here)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.start_processes(fn, args=(2, str(tmp_path / "init")), nprocs=2, start_method="spawn", join=True)


def _rank(rank: int, world_size: int, init_file: str) -> None:
    import torch.distributed as dist

    from infer.distributed.all_reduce.symm_mem import SymmetricAllReduce, unavailable_reason

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            assert unavailable_reason(device, world_size, dtype) is None, dtype
        fast = SymmetricAllReduce(dist.group.WORLD, device, max_bytes=1 << 20)
        gen = torch.Generator(device=device).manual_seed(rank)
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 3, 64, 128):
                x = torch.randn(
                    rows, 4096 // (2 if dtype == torch.float32 else 1), device=device, dtype=dtype, generator=gen
                )
                expected = x.clone()
                dist.all_reduce(expected)
                assert fast.fits(x), (rows, dtype)
                out = fast(x)
                assert out is x
                torch.testing.assert_close(
                    x, expected, atol=0 if dtype == torch.float32 else 1e-2, rtol=0 if dtype == torch.float32 else 1e-2
                )
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
    _on_two_ranks(_rank, tmp_path)


def _flashinfer_rank(rank: int, world_size: int, init_file: str) -> None:
    import torch.distributed as dist

    from infer.distributed.all_reduce.flashinfer_fused import FlashInferAllReduce, unavailable_reason
    from infer.distributed.state import ParallelState
    from infer.plugins.layer.torch_layers import RMSNorm

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    control = dist.new_group(backend="gloo")
    try:
        hidden = 1024
        assert unavailable_reason(device, world_size, torch.bfloat16) is None
        parallel = ParallelState(rank, world_size, device, dist.group.WORLD, control)
        fast = FlashInferAllReduce(parallel, hidden, torch.bfloat16, max_tokens=256)
        norm = RMSNorm(hidden, eps=1e-5).to(device, torch.bfloat16)
        norm.weight.data.uniform_(
            0.5, 1.5, generator=torch.Generator(device=device).manual_seed(7)
        )  # same on all ranks
        gen = torch.Generator(device=device).manual_seed(100 + rank)
        for rows in (1, 5, 64, 256):
            x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, generator=gen)
            residual = torch.randn(
                rows,
                hidden,
                device=device,
                dtype=torch.bfloat16,
                generator=torch.Generator(device=device).manual_seed(rows),
            )  # same on all ranks
            total = x.clone()
            dist.all_reduce(total)
            assert fast.fits(x)
            torch.testing.assert_close(fast(x), total, atol=2e-2, rtol=2e-2)
            normed, new_residual = fast.add_rms_norm(x, residual, norm.weight, norm.eps)
            ref_normed, ref_residual = norm(total, residual)
            torch.testing.assert_close(new_residual, ref_residual, atol=3e-2, rtol=2e-2)
            torch.testing.assert_close(normed, ref_normed, atol=5e-2, rtol=3e-2)
        assert not fast.fits(torch.empty(257, hidden, device=device, dtype=torch.bfloat16))  # past the workspace: NCCL
        assert not fast.fits(torch.empty(4, hidden, device=device, dtype=torch.float32))
        # a captured (all-reduce, add-and-norm) pair replayed on new inputs
        x = torch.zeros(4, hidden, device=device, dtype=torch.bfloat16)
        residual = torch.ones(4, hidden, device=device, dtype=torch.bfloat16)
        fast.add_rms_norm(x, residual, norm.weight, norm.eps)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            normed, new_residual = fast.add_rms_norm(x, residual, norm.weight, norm.eps)
        for value in (1.0, 2.0):
            x.fill_(value * (rank + 1))
            graph.replay()
            torch.cuda.synchronize()
            expected = residual + value * sum(r + 1 for r in range(world_size))
            torch.testing.assert_close(new_residual, expected)
            torch.testing.assert_close(normed, norm(expected), atol=5e-2, rtol=3e-2)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pdl", ["0", "1"], ids=["plain", "pdl"])
def test_flashinfer_all_reduce_and_fused_norm_match_nccl(tmp_path, monkeypatch, pdl):
    pytest.importorskip("flashinfer")
    monkeypatch.setenv("INFER_PDL", pdl)  # the spawned ranks launch it as a programmatic dependent (Hopper)
    _on_two_ranks(_flashinfer_rank, tmp_path)


def _exchange_rank(rank: int, world_size: int, init_file: str) -> None:
    """The GEMVs' pushed partial sums (infer.distributed.all_reduce.lamport) against NCCL's sum of the same GEMVs'
    outputs: eagerly over alternating slots, through the gated down projection, and replayed from a
    CUDA graph on new inputs. Every rank gets the same bits."""
    import torch.distributed as dist

    from infer.distributed.all_reduce.lamport import RESET, LamportExchange
    from infer.distributed.state import ParallelState
    from infer.kernels.gemv import gemv, gemv_silu_mul
    from infer.kernels.layers import rms_norm

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    control = dist.new_group(backend="gloo")
    try:
        hidden, width = 4096, 1024
        parallel = ParallelState(rank, world_size, device, dist.group.WORLD, control)
        exchange = LamportExchange.create(parallel, hidden, torch.bfloat16)
        gen = torch.Generator(device=device).manual_seed(rank)
        w = torch.randn(hidden, width, device=device, dtype=torch.bfloat16, generator=gen) / width**0.5
        norm_w = (
            torch.rand(
                hidden, device=device, dtype=torch.bfloat16, generator=torch.Generator(device=device).manual_seed(7)
            )
            + 0.5
        )  # same on all ranks

        def expected(part, residual):
            total = part.float()
            dist.all_reduce(total)
            return rms_norm(total.to(torch.bfloat16), norm_w, 1e-5, residual)

        def same_on_every_rank(t):
            gathered = [torch.empty_like(t) for _ in range(world_size)]
            dist.all_gather(gathered, t.contiguous())
            assert all(torch.equal(g, gathered[0]) for g in gathered)

        for step in range(6):  # both slots, three times each
            x = torch.randn(1, width, device=device, dtype=torch.bfloat16, generator=gen)
            residual = torch.full((1, hidden), float(step), device=device, dtype=torch.bfloat16)
            if step == 3:  # the MLP's down projection: SiLU(gate) * up read inside the GEMV
                h = torch.randn(1, 2 * width, device=device, dtype=torch.bfloat16, generator=gen)
                plain, part = gemv_silu_mul(h, w), gemv_silu_mul(h, w, push=exchange.target())
            else:
                plain, part = gemv(x, w), gemv(x, w, push=exchange.target())
            assert torch.equal(part, plain)
            ref_out, ref_res = expected(plain, residual)
            out, res = exchange.reduce(part, residual, norm_w, 1e-5)
            torch.testing.assert_close(res, ref_res, atol=3e-2, rtol=2e-2)
            torch.testing.assert_close(out, ref_out, atol=5e-2, rtol=3e-2)
            same_on_every_rank(out)
        torch.cuda.synchronize()
        assert (exchange.slots.view(torch.int16) == RESET).all(), "every slot read is reset"
        dist.barrier()  # before any rank pushes again

        # a captured chain of four (push, reduce) pairs, replayed on new inputs
        x = torch.zeros(1, width, device=device, dtype=torch.bfloat16)
        residual = torch.zeros(1, hidden, device=device, dtype=torch.bfloat16)

        def chain():
            y, r = x, residual
            for _ in range(4):
                y, r = exchange.reduce(gemv(y[:, :width], w, push=exchange.target()), r, norm_w, 1e-5)
            return y, r

        chain()  # warm-up: compiles, tunes the GEMV's tile
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
        for trial in range(3):
            x.copy_(torch.randn(1, width, device=device, dtype=torch.bfloat16, generator=gen))
            residual.fill_(0.25 * trial)
            eager = chain()
            graph.replay()
            torch.cuda.synchronize()
            for got, want in zip(captured, eager):
                assert torch.equal(got, want), trial
            same_on_every_rank(captured[0])
        dist.barrier()
        exchange.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pdl", ["0", "1"], ids=["plain", "pdl"])
def test_gemv_pushed_partial_sums_match_nccl(tmp_path, monkeypatch, pdl):
    pytest.importorskip("flashinfer")
    monkeypatch.setenv("INFER_PDL", pdl)  # under PDL the exchange's reader starts while the GEMV runs
    _on_two_ranks(_exchange_rank, tmp_path)
