"""LoRA on the GPU: the Triton BGMV and SGMV kernels against their torch reference at Llama-3-8B's widths in
bf16, and engines on CUDA (CUDA graphs and the kernels on) against HF transformers + PEFT merged, every
built-in family: each adapter alone and a batch mixing three adapters with the base model."""

from __future__ import annotations

import pytest
import torch

from infer.testing.lora import check_lora
from infer.testing.model import kit_overrides, write_checkpoint

pytestmark = pytest.mark.gpu

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}


@pytest.mark.parametrize("shape", [(4096, 6144, 48), (4096, 28672, 32), (14336, 4096, 16)])
@pytest.mark.parametrize("tokens", [1, 64, 700])
def test_kernels_match_the_reference_in_bf16(shape, tokens):
    from infer.kernels.lora import bgmv, group_by_slot, sgmv
    from infer.kernels.lora_reference import lora_reference, segments_of

    K, N, R = shape
    g = torch.Generator(device="cuda").manual_seed(tokens)
    dev = torch.device("cuda")
    slots = [(i // 37) % 9 - 1 for i in range(tokens)]  # runs of 37 tokens, slots -1..7
    x = torch.randn(tokens, K, device=dev, generator=g).bfloat16()
    y = torch.randn(tokens, N, device=dev, generator=g).bfloat16()
    a = (torch.randn(8, R, K, device=dev, generator=g) * 0.02).bfloat16()
    b = (torch.randn(8, N, R, device=dev, generator=g) * 0.02).bfloat16()
    want = lora_reference(x.float(), y.float(), a.float(), b.float(), segments_of(slots))
    from infer.kernels.lora import parts

    scratch = torch.zeros(parts(K), tokens, R, device=dev)
    per_token = y.clone()
    bgmv(x, per_token, a, b, torch.tensor(slots, dtype=torch.int32, device=dev), scratch)
    order, tiles = (torch.tensor(t, dtype=torch.int32, device=dev) for t in group_by_slot(slots, 8))
    per_segment = y.clone()
    sgmv(x, per_segment, a, b, order, tiles, scratch)
    for got in (per_token, per_segment):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_matches_hf_peft_on_cuda(family, tmp_path):
    pytest.importorskip("peft")
    from infer.core.registry import PluginRegistry

    architecture = FAMILIES[family]
    factory = PluginRegistry.load().get("model", family).factory
    checkpoint = write_checkpoint(architecture, tmp_path / "model", kit_overrides(factory, architecture))
    # fp32 on the GPU, CUDA graphs on (decode steps replay them, BGMV inside), prompts past the graphs' tokens
    options = dict(device="cuda", max_num_batched_tokens=64, cuda_graph_max_tokens=8)
    check_lora(checkpoint, family, tmp_path / "adapters", options=options)


@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_the_shrink_begun_beside_the_projection_gives_the_deltas_in_a_cuda_graph(tokens):
    """`begin` runs the shrink on the layer's side stream while the model's stream multiplies (here a
    matmul long enough that the two overlap), `apply` joins and expands: eager and replayed from a CUDA
    graph, the same y as the whole layer in `apply` alone, for BGMV's rows and SGMV's."""
    from infer.api.adapters import AdapterBatch, AdapterSpec, AdapterTarget
    from infer.plugins.adapter.lora import LoRAKind

    dev = torch.device("cuda")
    K, N = 4096, 6144
    target = AdapterTarget("layers.0.self_attn.qkv_proj", 0, ("q_proj", "k_proj", "v_proj"), K, (4096, 1024, 1024))
    spec = AdapterSpec((target,), max_adapters=4, max_rank=16, dtype=torch.bfloat16, device=dev, max_tokens=64)
    g = torch.Generator(device=dev).manual_seed(tokens)
    kind = LoRAKind(spec)
    kind.a[target.module].copy_(torch.randn(kind.a[target.module].shape, device=dev, generator=g) * 0.02)
    kind.b[target.module].copy_(torch.randn(kind.b[target.module].shape, device=dev, generator=g) * 0.02)
    layer = kind.layers()[target.module]
    w = torch.randn(N, K, device=dev, generator=g).bfloat16()
    x = torch.randn(tokens, K, device=dev, generator=g).bfloat16()
    seq_slots = [(i + 1) % 5 - 1 for i in range(tokens)]  # slots 0..3, then the base model (from 5 rows on)

    def forward(begin: bool) -> torch.Tensor:
        if begin:
            layer.begin(x)
        y = x @ w.T
        for _ in range(20):  # keep the model's stream busy past the shrink
            y = (y.float() * 1.0).bfloat16()
        return layer(x, y)

    batch = AdapterBatch(seq_slots, [1] * tokens, tokens)
    kind.plan(batch)
    whole = forward(begin=False).clone()
    kind.plan(batch)
    torch.testing.assert_close(forward(begin=True), whole, rtol=0, atol=0)
    kind.plan(AdapterBatch(seq_slots, [1] * tokens, tokens, capture=True))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(begin=True)  # warm-up on the capture's stream
        with torch.cuda.graph(graph, stream=stream):
            captured = forward(begin=True)
    torch.cuda.current_stream().wait_stream(stream)
    kind.plan(batch)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, whole, rtol=0, atol=0)
    assert not torch.equal(whole, x @ w.T), "no row's delta reached y"
