"""The batch-1 GEMV's tile shapes one by one, at Llama-2-7B's tp1 and tp2 shards, on the GPU machine:

    python scripts/gpu_gemv_sweep.py [--out sweep.json]

Per shape and configuration: 8 distinct weights (nothing served from L2) captured back to back in a
CUDA graph, plain and as programmatic dependents; prints the best few per shape beside what the
tuner picked, in microseconds and TB/s. For choosing the tuner's candidates, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from infer.bench.ceilings import captured_seconds, copy_bandwidth
from infer.kernels import gemv as triton_gemv

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--configs", help="BLOCK_N,BLOCK_K,num_warps,num_stages;... instead of the built-in list")
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")] if args.configs else CONFIGS
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    results = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        nbytes = ws[0].nbytes
        rows = []
        for bn, bk, warps, stages in configs:
            for pdl in (False, True):
                extra = {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}

                def call(i: int) -> None:
                    triton_gemv._gemv_kernel[(triton.cdiv(n, bn),)](
                        x,
                        ws[i % COPIES],
                        y,
                        y,
                        n,
                        k,
                        k,
                        0,
                        BLOCK_N=bn,
                        BLOCK_K=bk,
                        GATED=False,
                        PEERS=0,
                        num_warps=warps,
                        num_stages=stages,
                        **extra,
                    )

                try:
                    s = captured_seconds(call, calls=2 * COPIES, replays=20)
                except Exception as exc:  # a tile this GPU cannot hold
                    print(f"  {name} {(bn, bk, warps, stages)}: {type(exc).__name__}", flush=True)
                    continue
                rows.append({"config": [bn, bk, warps, stages], "pdl": pdl, "us": s * 1e6, "tbps": nbytes / s / 1e12})
        auto = {}
        for pdl in (True, False):  # tuned on the first call, as an engine's (PDL on) tunes it
            os.environ["INFER_PDL"] = "1" if pdl else "0"
            from infer.kernels import pdl as switch

            switch.reset()
            s = captured_seconds(lambda i: triton_gemv.gemv(x, ws[i % COPIES]), calls=2 * COPIES, replays=20)
            auto[pdl] = {"us": s * 1e6, "tbps": nbytes / s / 1e12}
        print(
            f"{name} N={n} K={k} {nbytes / 1e6:.1f} MB: tuned tile plain {auto[False]['us']:.2f} us "
            f"({auto[False]['tbps']:.2f} TB/s), pdl {auto[True]['us']:.2f} us ({auto[True]['tbps']:.2f}); "
            f"tuned {[v for kk, v in triton_gemv._tiles.items() if kk[:2] == (n, k)]}",
            flush=True,
        )
        for pdl in (False, True):
            top = sorted((r for r in rows if r["pdl"] == pdl), key=lambda r: r["us"])[:4]
            print(
                f"   best {'pdl  ' if pdl else 'plain'}: "
                + "; ".join(f"{tuple(r['config'])} {r['us']:.2f} us {r['tbps']:.2f}" for r in top),
                flush=True,
            )
        if name.endswith("down"):  # SiLU-and-mul inside the GEMV against its own kernel before it
            from infer.kernels.layers import silu_and_mul

            h = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)
            for label, f in (
                ("silu kernel + gemv", lambda i: triton_gemv.gemv(silu_and_mul(h), ws[i % COPIES])),
                ("gemv_silu_mul", lambda i: triton_gemv.gemv_silu_mul(h, ws[i % COPIES])),
            ):
                s = captured_seconds(f, calls=2 * COPIES, replays=20)
                auto[label] = {"us": s * 1e6}
                print(f"   {label} (pdl): {s * 1e6:.2f} us", flush=True)
        results[name] = {"rows": rows, "auto": auto}
        ws = []  # the copies go before the next shape is allocated
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
