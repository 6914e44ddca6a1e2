"""4-bit weights on the GPU (issue 47): the GEMV at llama3-8b's projection shapes against the dequantized
product, and a tiny GPTQ model's greedy tokens and logprobs on the GPU against the CPU's, both in float32."""

from __future__ import annotations

import os

import pytest
import torch

from infer import LLM, SamplingParams
from infer.kernels.int4_reference import pack_nibbles, quantize_rtn, unpack_nibbles
from infer.testing.model import write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 interprets the kernels"),
]
pytest.importorskip("triton")

WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gemv_at_llama3_8b_shapes(n, k, rows, act_order):
    from infer.kernels.int4_gemv import int4_gemv

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    q, s, z = quantize_rtn(w, 128, True)
    g_idx = torch.arange(k, dtype=torch.int32) // 128
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
        cols = g_idx.long()
        q = torch.clamp(torch.round(w / s[:, cols]) + z[:, cols].float(), 0, 15).to(torch.uint8)
    qweight, s, z, g_idx = (t.cuda() for t in (pack_nibbles(q), s, z, g_idx))
    x = torch.randn(rows, k, generator=gen).cuda().to(torch.bfloat16)
    y = int4_gemv(x, qweight, s, z, g_idx, 128, act_order)
    dense = (unpack_nibbles(qweight).float() - z.float()[:, g_idx.long()]) * s[:, g_idx.long()]
    expected = x.float() @ dense.T
    error = (y.float() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"


def test_a_tiny_gptq_model_on_the_gpu_as_on_the_cpu(tmp_path):
    ckpt = write_checkpoint("LlamaForCausalLM", tmp_path / "model", WIDE)
    prompts = [[1, 17, 93, 5], [1, 4, 8, 15, 16, 23, 42], [7] * 12]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = {}
    for device in ("cpu", "cuda"):
        kwargs = dict(model=str(ckpt.folder), device=device, dtype="float32", quantization="gptq")
        with LLM(**kwargs, **({"attention": "torch"} if device == "cpu" else {})) as llm:
            outputs[device] = llm.generate(prompts, params)
    for cpu, gpu in zip(outputs["cpu"], outputs["cuda"]):
        assert gpu.outputs[0].token_ids == cpu.outputs[0].token_ids
        for a, b in zip(cpu.outputs[0].logprobs, gpu.outputs[0].logprobs):
            token = next(iter(a))
            assert abs(a[token] - b[token]) < 1e-3
