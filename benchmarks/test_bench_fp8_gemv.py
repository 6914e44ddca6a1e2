"""Batch-1 FP8 linear layers (one-row GEMVs) of Llama-3-8B: what `--quantization fp8` streams per layer
at one token, against bf16 and the copy bandwidth.

Per implementation: one layer's four projections (qkv, o, gate_up, down) for 8 layers of distinct
weights (nothing served from L2), captured back to back in a CUDA graph as a decode step runs them,
launched as programmatic dependents where the GPU has them (as the engine does). The device time gives
the achieved bandwidth, beside the copy bandwidth measured in the same run (the ceiling). Implementations:
e4m3 weights and x (the FP8 layers' one-row path) on the best tile of the FMA kernel (every weight widened
to fp32), on the best tile of the f16-pair kernel (`infer.kernels.gemv_e4m3`), and on whichever the
engine's tuner picks from both; and bf16 weights and x on the bf16 GEMV (the baseline the FP8 speed-up
is taken against). Before any timing each is checked against the float64 product of its own operands.
Run on the GPU machine: `pytest benchmarks/test_bench_fp8_gemv.py --benchmark-enable`.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device of compute capability 8.9 or newer (e4m3)",
)

HIDDEN, INTERMEDIATE, LAYERS = 4096, 14336, 8
PROJECTIONS = {
    "qkv": (6144, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}


@pytest.fixture(scope="module")
def copy_bandwidth() -> float:
    from infer.bench.ceilings import copy_bandwidth

    return copy_bandwidth(torch.device("cuda"))


def layer_operands(fp8: bool) -> list[dict[str, tuple]]:
    """Per layer, per projection: (weight [N, K], its scale, x [1, K], x's scale); e4m3 with per-row
    scales as the FP8 layers hold them, or bf16 with no scales."""
    from infer.kernels.fp8 import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for name, (n, k) in PROJECTIONS.items():
            w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
            x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            if fp8:
                (w8, scale), (q, x_scale) = quantize_rows(w), quantize_rows(x)
                layer[name] = (w8, scale.view(n), q, x_scale)
            else:
                layer[name] = (w.to(torch.bfloat16), None, x, None)
        layers.append(layer)
    return layers


def best_tile(weight, scale, x, x_scale, kind: str):
    """The tuner's pick among the FMA tiles ("fma") or the f16-pair tiles ("f16-sums") for one
    projection, timed as the engine's tuner times them."""
    from infer.kernels import gemv, gemv_tiles, triton_pdl

    tiles = [t for t in gemv_tiles.candidates(x, weight) if not t.mma and t.f16_sums == (kind == "f16-sums")]
    y = torch.empty(1, weight.shape[0], device="cuda", dtype=torch.bfloat16)
    pdl = triton_pdl.use_pdl(x.device)
    return gemv_tiles.tune(
        tiles, weight, lambda tile, w: gemv.run_tile(x, w, y, tile, pdl=pdl, scale=scale, x_scale=x_scale)
    )


@pytest.mark.benchmark(group="gemv-llama3-8b-fp8-layer")
@pytest.mark.parametrize("impl", ["fp8-fma", "fp8-f16-sums", "fp8-tuned", "bf16"])
def test_fp8_gemv_layers(benchmark, copy_bandwidth, impl):
    from infer.bench.ceilings import weight_streams
    from infer.kernels import gemv, triton_pdl

    layers = layer_operands(fp8=impl != "bf16")
    pdl = triton_pdl.use_pdl(torch.device("cuda"))
    tiles = {}
    if impl in ("fp8-fma", "fp8-f16-sums"):
        tiles = {name: best_tile(*ops, impl.removeprefix("fp8-")) for name, ops in layers[0].items()}
    outputs = {name: torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for name, (n, _) in PROJECTIONS.items()}

    def project(name: str, i: int) -> None:
        w, scale, x, x_scale = layers[i % LAYERS][name]
        if name in tiles:
            gemv.run_tile(x, w, outputs[name], tiles[name], pdl=pdl, scale=scale, x_scale=x_scale)
        elif x_scale is not None:
            outputs[name] = gemv.gemv(x, w, scale=scale, x_scale=x_scale, out_dtype=torch.bfloat16)
        else:
            outputs[name] = gemv.gemv(x, w)

    for name, (w, scale, x, x_scale) in layers[0].items():  # the float64 product of these operands
        project(name, 0)
        weights = w.double() * (1.0 if scale is None else scale.double()[:, None])
        xs = x.double() * (1.0 if x_scale is None else x_scale.double())
        exact = (weights @ xs.T)[:, 0]
        magnitude = (weights.abs() @ xs.abs().T)[:, 0]
        error = ((outputs[name][0].double() - exact).abs() / magnitude).max().item()
        assert error <= 2**-7, f"{impl} {name}: error {error:.2e} of the sum of |terms|"

    layer_bytes = sum(ops[0].nbytes for ops in layers[0].values())
    benchmark.extra_info.update(weight_streams(project, PROJECTIONS, LAYERS, layer_bytes, copy_bandwidth))
    benchmark.extra_info["tiles"] = {name: tuple(tile) for name, tile in tiles.items()}

    def step() -> None:
        for name in PROJECTIONS:
            project(name, 0)
        torch.cuda.synchronize()

    benchmark(step)
