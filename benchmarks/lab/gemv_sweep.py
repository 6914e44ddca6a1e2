"""Which tile serves the batch-1 GEMV best? Each candidate tile shape one by one, at Llama-2-7B's tp1
and tp2 shards, on the GPU:

    python -m benchmarks.lab.gemv_sweep [--out sweep.json]

Per shape and configuration: 8 distinct weights (nothing served from L2) captured back to back in a
CUDA graph, plain and as programmatic dependents; prints the best few per shape beside what the
tuner picked, in microseconds and TB/s. For choosing the tuner's candidates, not a benchmark.
"""

from __future__ import annotations

import argparse
import json

import torch

from infer.bench.ceilings import captured_seconds, copy_bandwidth
from infer.common import env
from infer.kernels import gemv as triton_gemv
from infer.kernels import pdl as pdl_switch

HIDDEN, INTERMEDIATE, COPIES = 4096, 11008, 8
SHAPES = {  # (N, K) of each rank's weight
    "tp1 qkv": (3 * HIDDEN, HIDDEN),
    "tp1 o": (HIDDEN, HIDDEN),
    "tp1 gate_up": (2 * INTERMEDIATE, HIDDEN),
    "tp1 down": (HIDDEN, INTERMEDIATE),
    "tp2 qkv": (3 * HIDDEN // 2, HIDDEN),
    "tp2 o": (HIDDEN, HIDDEN // 2),
    "tp2 gate_up": (INTERMEDIATE, HIDDEN),
    "tp2 down": (HIDDEN, INTERMEDIATE // 2),
    "tp2 lm_head": (16000, HIDDEN),
}
CONFIGS = [
    (n, k, w, s)
    for n, k, w in [
        (1, 1024, 4),
        (2, 512, 2),
        (2, 1024, 4),
        (4, 256, 2),
        (4, 512, 4),
        (4, 1024, 8),
        (8, 128, 2),
        (8, 256, 4),
        (8, 512, 4),
        (8, 512, 8),
        (16, 128, 4),
        (16, 256, 4),
        (16, 512, 8),
        (32, 128, 4),
        (32, 256, 8),
    ]
    for s in (1, 2, 3)
]


def tile_rows(
    x: torch.Tensor, ws: list[torch.Tensor], y: torch.Tensor, name: str, configs: list[tuple[int, ...]]
) -> list[dict]:
    """Each configuration's time per call, plain and as programmatic dependents."""
    nbytes = ws[0].nbytes
    rows = []
    for bn, bk, warps, stages in configs:
        for pdl in (False, True):

            def call(i: int) -> None:
                triton_gemv.run_tile(x, ws[i % COPIES], y, (bn, bk, warps), num_stages=stages, pdl=pdl)

            try:
                s = captured_seconds(call, calls=2 * COPIES, replays=20)
            except Exception as exc:  # a tile this GPU cannot hold
                print(f"  {name} {(bn, bk, warps, stages)}: {type(exc).__name__}", flush=True)
                continue
            rows.append({"config": [bn, bk, warps, stages], "pdl": pdl, "us": s * 1e6, "tbps": nbytes / s / 1e12})
    return rows


def tuned_times(x: torch.Tensor, ws: list[torch.Tensor]) -> dict:
    """The tuner's own pick, with PDL on then off (tuned on the first call, as an engine's, PDL on, tunes it)."""
    nbytes = ws[0].nbytes
    auto = {}
    for pdl in (True, False):
        env.export("INFER_PDL", "1" if pdl else "0")  # read again at the next launch
        pdl_switch.reset()
        s = captured_seconds(lambda i: triton_gemv.gemv(x, ws[i % COPIES]), calls=2 * COPIES, replays=20)
        auto[pdl] = {"us": s * 1e6, "tbps": nbytes / s / 1e12}
    return auto


def fused_silu_times(k: int, ws: list[torch.Tensor], dev: torch.device) -> dict:
    """SiLU-and-mul inside the down projection's GEMV against its own kernel before it."""
    from infer.kernels.layers import silu_and_mul

    h = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)
    out = {}
    for label, f in (
        ("silu kernel + gemv", lambda i: triton_gemv.gemv(silu_and_mul(h), ws[i % COPIES])),
        ("gemv_silu_mul", lambda i: triton_gemv.gemv_silu_mul(h, ws[i % COPIES])),
    ):
        s = captured_seconds(f, calls=2 * COPIES, replays=20)
        out[label] = {"us": s * 1e6}
        print(f"   {label} (pdl): {s * 1e6:.2f} us", flush=True)
    return out


def sweep_shape(name: str, n: int, k: int, configs: list[tuple[int, ...]], dev: torch.device) -> dict:
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    nbytes = ws[0].nbytes
    rows = tile_rows(x, ws, y, name, configs)
    auto = tuned_times(x, ws)
    print(
        f"{name} N={n} K={k} {nbytes / 1e6:.1f} MB: tuned tile plain {auto[False]['us']:.2f} us "
        f"({auto[False]['tbps']:.2f} TB/s), pdl {auto[True]['us']:.2f} us ({auto[True]['tbps']:.2f}); "
        f"tuned {[v for kk, v in triton_gemv.tuned_tiles().items() if kk[:2] == (n, k)]}",
        flush=True,
    )
    for pdl in (False, True):
        top = sorted((r for r in rows if r["pdl"] == pdl), key=lambda r: r["us"])[:4]
        print(
            f"   best {'pdl  ' if pdl else 'plain'}: "
            + "; ".join(f"{tuple(r['config'])} {r['us']:.2f} us {r['tbps']:.2f}" for r in top),
            flush=True,
        )
    if name.endswith("down"):
        auto.update(fused_silu_times(k, ws, dev))
    return {"rows": rows, "auto": auto}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.gemv_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--configs", help="BLOCK_N,BLOCK_K,num_warps,num_stages;... instead of the built-in list")
    args = ap.parse_args(argv)
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")] if args.configs else CONFIGS
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    results = {}
    for name, (n, k) in SHAPES.items():
        results[name] = sweep_shape(name, n, k, configs, dev)  # its weight copies go before the next shape's
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
