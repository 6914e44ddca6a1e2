"""What quantizing activations inside the kernel that makes them saves, and what an FP8 product
costs against bfloat16, at Llama-3-8B's shapes (hidden 4096, intermediate 14336, qkv 6144).

For each token count: each fused quantizer of `infer.kernels.fp8` against its 16-bit kernel then
`quantize_rows` (and the 16-bit kernel alone), and `scaled_mm` against a bfloat16 matmul for the
qkv, gate_up and down projections. Times are Triton's do_bench medians (one call at a time, L2
flushed), in microseconds.

    python -m benchmarks.lab.fp8 [--tokens 16 512 4096] [--out fp8.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

HIDDEN, INTERMEDIATE = 4096, 14336
PROJECTIONS = {"qkv": (HIDDEN, 6144), "gate_up": (HIDDEN, 2 * INTERMEDIATE), "down": (INTERMEDIATE, HIDDEN)}


def time_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, rep=200) * 1e3


def quantizers(tokens: int) -> dict[str, float]:
    from infer.kernels import fp8, layers

    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual, weight = torch.randn_like(x), torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5
    h = torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    return {
        "rms_norm_fp8": time_us(lambda: fp8.rms_norm_fp8(x, weight, 1e-5, residual)),
        "rms_norm+quantize_rows": time_us(lambda: fp8.quantize_rows(layers.rms_norm(x, weight, 1e-5, residual)[0])),
        "rms_norm": time_us(lambda: layers.rms_norm(x, weight, 1e-5, residual)),
        "silu_and_mul_fp8": time_us(lambda: fp8.silu_and_mul_fp8(h)),
        "silu_and_mul+quantize_rows": time_us(lambda: fp8.quantize_rows(layers.silu_and_mul(h))),
        "silu_and_mul": time_us(lambda: layers.silu_and_mul(h)),
    }


def products(tokens: int) -> dict[str, float]:
    from infer.kernels import fp8
    from infer.kernels.fp8_reference import quantize_rows_reference

    times = {}
    for name, (k, n) in PROJECTIONS.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        q, x_scale = fp8.quantize_rows(x)
        w_q, w_scale = quantize_rows_reference(w)
        w_scale = w_scale.view(n)
        times[f"{name} fp8"] = time_us(lambda: fp8.scaled_mm(q, x_scale, w_q, w_scale, torch.bfloat16))
        times[f"{name} bf16"] = time_us(lambda: x @ w.t())
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.fp8", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 512, 4096])
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    record = {}
    for tokens in args.tokens:
        times = quantizers(tokens) | products(tokens)
        record[tokens] = times
        print(f"T={tokens}")
        for name, us in times.items():
            if name.endswith(("fp8", "bf16")) and " " in name:
                k, n = PROJECTIONS[name.split()[0]]
                print(f"  {name:28s} {us:8.1f} us  {2 * tokens * k * n / us / 1e6:6.0f} TFLOP/s")
            else:
                print(f"  {name:28s} {us:8.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
