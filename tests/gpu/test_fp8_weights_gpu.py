"""FP8 weights on the GPU: the fused layer (GEMV, per-token quantizers, cuBLAS's FP8 GEMM) against the
plain-torch `Fp8Linear` on the same stored weights, and a model run end to end against the CPU reference."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.plugins.layer import torch_layers as plain
from infer.plugins.layer.fp8 import Fp8Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROWS = [1, 2, 8, 256, 2048]


def _pair(n: int, k: int):
    from infer.plugins.layer.fp8_fused import FusedFp8Linear

    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda") * 0.02
    ref, fused = Fp8Linear(k, n).cuda(), FusedFp8Linear(k, n).cuda()
    for layer in (ref, fused):
        layer.load_rows("weight", 0, n, w)
    return ref, fused


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 outputs of float32 sums taken in another order (Hopper's FP8 tensor cores keep fewer bits in
    # their partial sums), plus what a rare activation rounded to the neighbouring e4m3 value moves
    err = (got.float() - expected.float()).norm() / expected.float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_the_fused_fp8_linear_is_the_reference_layer(rows, n, k):
    ref, fused = _pair(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    _close(fused(x), ref(x))


@pytest.mark.parametrize("rows", ROWS)
def test_the_down_projection_takes_the_gated_activation_and_the_norm_its_quantized_output(rows):
    from infer.plugins.layer.fused import FusedRMSNorm

    ref, fused = _pair(4096, 14336)
    h = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    _close(fused.gated(h), ref(plain.SiluAndMul()(h)))
    norm = FusedRMSNorm(14336, 1e-5).cuda().to(torch.bfloat16)
    norm.quantize_output = fused.takes_quantized_input
    x, r = torch.randn(rows, 14336, device="cuda", dtype=torch.bfloat16), torch.randn_like(h[:, :14336])
    normed, residual = norm(x, r)
    expected, expected_residual = plain.RMSNorm.forward(norm, x, r)
    assert torch.equal(residual, expected_residual)
    _close(fused(normed), ref(expected))


def test_an_fp8_model_on_the_gpu_runs_as_the_cpu_reference(tiny_llama_dir):
    prompts = [{"prompt_token_ids": [1, 17, 93, 5]}, {"prompt_token_ids": [1, *range(100, 139)]}]
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    kwargs = dict(quantization="fp8", num_kv_blocks=64)
    gpu = LLM(str(tiny_llama_dir), device="cuda", dtype="bf16", **kwargs).generate(prompts, sp)
    cpu = LLM(str(tiny_llama_dir), device="cpu", dtype="fp32", **kwargs).generate(prompts, sp)
    for g, c in zip(gpu, cpu):
        assert g.outputs[0].token_ids == c.outputs[0].token_ids
        for token, lp in c.outputs[0].logprobs[0].items():
            assert abs(g.outputs[0].logprobs[0][token] - lp) < 0.1, token  # bf16 activations against fp32
    bf16 = LLM(str(tiny_llama_dir), device="cuda", dtype="bf16", **kwargs)
    eager = LLM(str(tiny_llama_dir), device="cuda", dtype="bf16", cuda_graphs=False, **kwargs)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in bf16.generate(prompts, greedy)] == [
        o.outputs[0].token_ids for o in eager.generate(prompts, greedy)
    ]


def test_gptq_on_the_gpu_rounds_as_on_the_cpu(tiny_llama_dir, tmp_path):
    """`infer models quantize --device cuda`: the same weight scales as on the CPU (KV-cache scales to float32
    rounding), and the same e4m3 bits but for weights whose float64 statistics, summed in another order, tip a
    rounding (one e4m3 step at most)."""
    from safetensors.torch import load_file

    from infer.tools import quantize as fp8

    windows = [list(range(3 + i, 3 + i + 48)) for i in range(4)]
    folders = {
        device: fp8.quantize_folder(tiny_llama_dir, tmp_path / device, "gptq", windows, lambda msg: None, device)
        for device in ("cpu", "cuda")
    }
    cpu, gpu = (load_file(str(folders[d] / "model.safetensors")) for d in ("cpu", "cuda"))
    assert cpu.keys() == gpu.keys()
    weights = [name for name, t in cpu.items() if t.dtype == torch.float8_e4m3fn]
    assert weights, "the folder holds e4m3 projections"
    same = total = 0
    for name in cpu:
        if name.endswith(("k_scale", "v_scale")):
            # KV-cache scales come from the activations' amax, float32 matmuls summed in another order on each
            # device: equal to float32 rounding, not bit for bit (seen on an H100: both 0.0053, not equal)
            torch.testing.assert_close(gpu[name], cpu[name], rtol=1e-4, atol=0, msg=name)
            continue
        if cpu[name].dtype != torch.float8_e4m3fn:
            assert torch.equal(cpu[name], gpu[name]), name  # weight scales, norms, embeddings
            continue
        a, b = cpu[name].view(torch.uint8).int(), gpu[name].view(torch.uint8).int()
        apart = a != b
        # neighbours: codes one apart (same sign), or either side of zero within the smallest subnormals
        neighbours = ((a - b).abs() == 1) | ((cpu[name].float() - gpu[name].float()).abs() <= 2**-8)
        assert neighbours[apart].all(), f"{name}: a weight more than one e4m3 step from the CPU's"
        same += int((~apart).sum())
        total += a.numel()
    assert same >= 0.999 * total, f"{total - same} of {total} e4m3 weights differ"
