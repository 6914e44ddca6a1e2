"""How long does the weight-streaming GEMV take over 1 to 8 rows of x, with bf16 and with FP8 weights?
Llama-3-8B's weight shapes, on the GPU:

    python -m benchmarks.lab.gemv_rows [--rows 1,2,4,8] [--out gemv_rows.json]

Per shape, weight dtype and row count: the tuned GEMV (`infer.kernels.gemv`) over enough distinct
weights that none is served from L2, calls captured back to back in a CUDA graph (as programmatic
dependents where PDL is on), beside cuBLAS (torch's linear) over the bf16 weights; microseconds per
call, and the weight bytes read per second against the device's copy bandwidth.
"""

from __future__ import annotations

import argparse
import json

import torch

from infer.bench.ceilings import captured_seconds, copy_bandwidth
from infer.kernels import gemv as triton_gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def weight_copies(n: int, k: int, dev: torch.device) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    """bf16 weights [N, K], and the same quantized to e4m3 with a per-row scale, enough that they
    overflow L2 three times over."""
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    copies = max(2, -(-3 * l2 // (n * k)))
    bf16 = [(torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16) for _ in range(copies)]
    fp8 = []
    for w in bf16:
        scale = w.float().abs().amax(dim=1) / 448.0
        fp8.append(((w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale))
    return bf16, fp8


def shape_rows(name: str, n: int, k: int, rows: list[int], bw: float, dev: torch.device) -> list[dict]:
    bf16, fp8 = weight_copies(n, k, dev)
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        calls = {
            "bf16": lambda i: triton_gemv.gemv(x, bf16[i % len(bf16)]),
            "fp8": lambda i: triton_gemv.gemv(x, fp8[i % len(fp8)][0], scale=fp8[i % len(fp8)][1]),
            "cublas bf16": lambda i: torch.nn.functional.linear(x, bf16[i % len(bf16)]),
        }
        for label, call in calls.items():
            call(0)  # tunes the GEMV's tile outside the graph
            seconds = captured_seconds(call, calls=2 * len(bf16), replays=10)
            nbytes = n * k * (1 if label == "fp8" else 2)
            weight = torch.float8_e4m3fn if label == "fp8" else torch.bfloat16
            tile = triton_gemv.tuned_tiles().get((n, k, weight, x.dtype, x.device, m))
            row = {"shape": name, "n": n, "k": k, "weights": label, "rows": m, "us": seconds * 1e6}
            row.update(tbps=nbytes / seconds / 1e12, of_copy=nbytes / seconds / bw)
            row["tile"] = None if label.startswith("cublas") else tile
            out.append(row)
            print(
                f"{name:8s} {n:5d}x{k:<5d} M={m} {label:11s} {row['us']:7.2f} us {row['tbps']:5.2f} TB/s "
                f"{row['of_copy']:6.1%} of copy {row['tile'] or ''}",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.gemv_rows",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rows", default="1,2,4,8", help="row counts of x, each 1 to GEMV_MAX_ROWS")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--out", default="gemv_rows.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name in args.shapes.split(","):
        results += shape_rows(name, *SHAPES[name], rows, bw, dev)  # its copies go before the next shape's
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
