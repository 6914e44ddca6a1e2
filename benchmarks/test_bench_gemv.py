"""Batch-1 linear layers (GEMV) of Llama-2-7B at --tp 1 and --tp 2: what one rank streams per layer.

A decode step at batch 1 is mostly these four weight streams per layer (qkv, o, gate_up, down); at
tp 2 each is half as large, and a small kernel loses more of its time to its ramp-up and tail, which
is what keeps tp 2's per-token speed-up short of 2x. Per (tp, implementation): one layer's four GEMVs
for 8 layers (distinct weights, so nothing is served from L2), captured back to back in a CUDA graph
(as a decode step runs them); the device time gives the achieved bandwidth, beside the copy
bandwidth measured here too. Implementations: this project's Triton GEMV with plain launches, the
same launched as programmatic dependents (INFER_PDL, Hopper only), and cuBLAS (`F.linear`).
Run on the GPU machine: `pytest benchmarks/test_bench_gemv.py --benchmark-enable`.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN, INTERMEDIATE, LAYERS, DTYPE = 4096, 11008, 8, torch.bfloat16
# (rows, columns) of each projection's weight at tp 1, and the dimension tp splits (0: rows, 1: columns)
PROJECTIONS = {
    "qkv": (3 * HIDDEN, HIDDEN, 0),
    "o": (HIDDEN, HIDDEN, 1),
    "gate_up": (2 * INTERMEDIATE, HIDDEN, 0),
    "down": (HIDDEN, INTERMEDIATE, 1),
}


@pytest.fixture(scope="module")
def copy_bandwidth() -> float:
    from infer.bench.ceilings import copy_bandwidth

    return copy_bandwidth(torch.device("cuda"))


@pytest.fixture
def pdl_switch():
    from infer.kernels import pdl, triton_pdl

    before = os.environ.get("INFER_PDL")

    def switch(on: bool) -> bool:
        os.environ["INFER_PDL"] = "1" if on else "0"
        pdl.reset()
        return triton_pdl.use_pdl(torch.device("cuda"))

    yield switch
    if before is None:
        os.environ.pop("INFER_PDL", None)
    else:
        os.environ["INFER_PDL"] = before
    pdl.reset()


def layer_weights(tp: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, per projection: (this rank's weight, an input of its width)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for name, (rows, cols, dim) in PROJECTIONS.items():
            rows, cols = (rows // tp, cols) if dim == 0 else (rows, cols // tp)
            w = torch.randn(rows, cols, device="cuda", generator=gen).to(DTYPE) / cols**0.5
            layer[name] = (w, torch.randn(1, cols, device="cuda", generator=gen).to(DTYPE))
        layers.append(layer)
    return layers


@pytest.mark.benchmark(group="gemv-llama2-7b-layer")
@pytest.mark.parametrize("impl", ["triton", "triton-pdl", "cublas"])
@pytest.mark.parametrize("tp", [1, 2])
def test_gemv_layers(benchmark, copy_bandwidth, pdl_switch, tp, impl):
    from infer.bench.ceilings import weight_streams
    from infer.kernels.gemv import gemv

    if not pdl_switch(impl == "triton-pdl") and impl == "triton-pdl":
        pytest.skip("no programmatic dependent launch on this GPU (compute capability < 9.0)")
    matmul = F.linear if impl == "cublas" else gemv
    layers = layer_weights(tp)
    for w, x in layers[0].values():  # against cuBLAS, before any timing
        torch.testing.assert_close(matmul(x, w).float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)

    def project(name: str, i: int) -> None:
        w, x = layers[i % LAYERS][name]
        matmul(x, w)

    layer_bytes = sum(w.nbytes for w, _ in layers[0].values())
    benchmark.extra_info.update(weight_streams(project, PROJECTIONS, LAYERS, layer_bytes, copy_bandwidth))

    def step() -> None:
        for name in PROJECTIONS:
            project(name, 0)
        torch.cuda.synchronize()

    benchmark(step)
