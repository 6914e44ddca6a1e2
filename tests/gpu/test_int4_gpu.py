"""4-bit weights on the GPU (issue 47): the GEMV at llama3-8b's projection shapes against the dequantized
product, and a tiny GPTQ model's greedy tokens and logprobs on the GPU against the CPU's, both in float32."""

from __future__ import annotations

import os

import pytest
import torch

from infer import LLM, SamplingParams
from infer.testing.model import write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 interprets the kernels"),
]
pytest.importorskip("triton")

WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("rows", [1, 4, 8, 16, 64, 256, 2048])
@pytest.mark.parametrize("act_order", [False, True])
def test_products_at_llama3_8b_shapes(n, k, rows, act_order):
    """The GEMV (up to 8 rows), or the dequantized weight times x (more), as `Int4Linear` picks, against the
    dequantized product."""
    from infer.kernels.int4_dequant import int4_dequantize
    from infer.kernels.int4_gemv import INT4_GEMV_MAX_ROWS, int4_gemv
    from infer.testing.int4_layers import dequantized_product, random_int4_layer

    (qweight, s, z, g_idx), width = random_int4_layer(n, k, 128, True, act_order, "cuda")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).cuda().to(torch.bfloat16)
    if rows <= INT4_GEMV_MAX_ROWS:
        y = int4_gemv(x, qweight, s, z, g_idx, width, act_order)
    else:
        y = x @ int4_dequantize(qweight, s, z, g_idx, width, act_order, torch.bfloat16).T
    expected = dequantized_product(x, qweight, s, z, g_idx, None)
    error = (y.float() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"


def test_a_tiny_gptq_model_on_the_gpu_as_on_the_cpu(tmp_path):
    ckpt = write_checkpoint("LlamaForCausalLM", tmp_path / "model", WIDE)
    prompts = [[1, 17, 93, 5], [1, 4, 8, 15, 16, 23, 42], [7] * 12]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = {}
    for device in ("cpu", "cuda"):
        kwargs = dict(model=str(ckpt.folder), device=device, dtype="float32", quantization="gptq")
        with LLM(**kwargs, **({"attention": "torch"} if device == "cpu" else {})) as llm:
            outputs[device] = llm.generate(prompts, params)
    for cpu, gpu in zip(outputs["cpu"], outputs["cuda"]):
        c, g = cpu.outputs[0], gpu.outputs[0]
        for i, (a, b) in enumerate(zip(c.logprobs, g.logprobs)):
            mine, theirs = c.token_ids[i], g.token_ids[i]
            if mine != theirs:  # greedy parts only at a near tie (the sums' order differs): then the texts differ
                assert theirs in a and abs(a[mine] - a[theirs]) < 1e-3, (i, mine, theirs, a, b)
                break
            assert abs(a[mine] - b[theirs]) < 1e-3, (i, a, b)


def test_the_gemv_tunes_its_tile_while_warming_up_and_keeps_the_product():
    """At llama3-8b's gate_up shape: the first one-row call under `warming_up()` times the candidates and
    keeps one; the product with it, and with every candidate, is the dequantized product's."""
    from infer.kernels import int4_gemv as module
    from infer.kernels.warmup import warming_up
    from infer.testing.int4_layers import dequantized_product, random_int4_layer

    (qweight, s, z, g_idx), width = random_int4_layer(28672, 4096, 128, True, False, "cuda")
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(2)).cuda().to(torch.bfloat16)
    expected = dequantized_product(x, qweight, s, z, g_idx, None)
    with warming_up():
        y = module.int4_gemv(x, qweight, s, z, g_idx, width, False)
    tuned = [t for key, t in module.tuned_tiles().items() if key[:2] == (28672, 2048)]
    assert len(tuned) == 1 and tuned[0] in module.candidates(1, width)
    for tile in module.candidates(1, width):
        got = module.int4_gemv(x, qweight, s, z, g_idx, width, False, tile=tile)
        assert (got.float() - expected).norm() / expected.norm() < 1e-2, tile
    assert (y.float() - expected).norm() / expected.norm() < 1e-2
