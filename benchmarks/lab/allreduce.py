"""Which all-reduce is fastest at each message size on the GPUs of one host? NCCL against the
symmetric-memory one-shot kernel and, where FlashInfer imports, its TensorRT-LLM all-reduce, each
timed as a CUDA graph of back-to-back sums (how a decode step runs them).

    python -m benchmarks.lab.allreduce [--world-size 2] [--hidden 4096] [--calls 64]

Prints one row per size: microseconds per all-reduce for each, and the ratio. The sizes are
rows x hidden bf16, the activations a tensor-parallel Llama sums twice per layer. Where FlashInfer
runs, a second table compares what a decoder layer does with each sum: the symmetric-memory sum
followed by this project's residual-add-and-RMSNorm kernel, against FlashInfer's one kernel for
both (what `--all-reduce auto` chooses between). On Hopper FlashInfer's and the norm's kernels
launch as programmatic dependents unless INFER_PDL=0. NVLink multicast stays off in the ranks
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1) unless --multicast.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from infer.common import env

ROWS = (1, 4, 16, 64, 128, 256, 512, 1024)


def _rank(rank: int, world_size: int, init_file: str, hidden: int, calls: int) -> None:
    import torch.distributed as dist

    from infer.bench.ceilings import captured_seconds
    from infer.distributed.all_reduce.symm_mem import SymmetricAllReduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    fast = SymmetricAllReduce(dist.group.WORLD, device, max_bytes=max(ROWS) * hidden * 2)
    flashinfer = _flashinfer(rank, world_size, device, hidden)
    weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    rows_out = []
    for rows in ROWS:
        x = torch.full((rows, hidden), 1.0 / 1024, device=device, dtype=torch.bfloat16)
        residual = torch.zeros_like(x)
        nccl = captured_seconds(lambda _: dist.all_reduce(x), calls)
        symm = captured_seconds(lambda _: fast(x), calls)
        row = [rows, rows * hidden * 2, nccl, symm]
        if flashinfer is not None:
            from infer.kernels.layers import rms_norm

            row += [
                captured_seconds(lambda _: flashinfer(x), calls),
                captured_seconds(lambda _: rms_norm(fast(x), weight, 1e-5, residual), calls),
                captured_seconds(lambda _: flashinfer.add_rms_norm(x, residual, weight, 1e-5), calls),
            ]
        rows_out.append(row)
        dist.barrier()
    if rank == 0:
        print(
            f"all-reduce of [rows, {hidden}] bf16 over {world_size} GPUs ({torch.cuda.get_device_name(0)}), "
            f"{calls} per CUDA graph, us per all-reduce"
        )
        print(
            f"{'rows':>6} {'bytes':>9} {'nccl us':>9} {'symm-mem us':>12} {'nccl/symm':>10}"
            + (f" {'flashinfer us':>14}" if flashinfer is not None else "")
        )
        for rows, nbytes, nccl, symm, *fi in rows_out:
            print(
                f"{rows:6d} {nbytes:9d} {nccl * 1e6:9.2f} {symm * 1e6:12.2f} {nccl / symm:9.2f}x"
                + (f" {fi[0] * 1e6:14.2f}" if fi else "")
            )
        if flashinfer is not None:
            print("\nsum + residual add + RMSNorm, us per layer half:")
            print(f"{'rows':>6} {'symm-mem + norm kernel':>23} {'flashinfer fused':>17} {'ratio':>7}")
            for rows, _, _, _, _, symm_norm, fused in rows_out:
                print(f"{rows:6d} {symm_norm * 1e6:23.2f} {fused * 1e6:17.2f} {symm_norm / fused:6.2f}x")
    if flashinfer is not None:
        flashinfer.close()
    dist.destroy_process_group()


def _flashinfer(rank: int, world_size: int, device: torch.device, hidden: int):
    """FlashInfer's all-reduce for [<= max(ROWS), hidden] bf16, or None where it cannot run (said why)."""
    import types

    import torch.distributed as dist

    from infer.distributed.all_reduce import flashinfer_fused as flashinfer_all_reduce

    reason = flashinfer_all_reduce.unavailable_reason(device, world_size, torch.bfloat16)
    if reason is not None:
        if rank == 0:
            print(f"flashinfer left out: {reason}")
        return None
    control = dist.new_group(backend="gloo")
    parallel = types.SimpleNamespace(rank=rank, world_size=world_size, control_group=control)
    return flashinfer_all_reduce.FlashInferAllReduce(parallel, hidden, torch.bfloat16, max_tokens=max(ROWS))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.allreduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--multicast", action="store_true", help="leave NCCL's and torch's NVLink multicast as set")
    args = parser.parse_args(argv)
    if not args.multicast:  # for the spawned ranks
        env.export("NCCL_NVLS_ENABLE", "0")
        env.export("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank,
            args=(args.world_size, os.path.join(tmp, "init"), args.hidden, args.calls),
            nprocs=args.world_size,
            start_method="spawn",
            join=True,
        )


if __name__ == "__main__":
    main()
