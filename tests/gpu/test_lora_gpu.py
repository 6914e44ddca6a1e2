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
    order, starts = (torch.tensor(t, dtype=torch.int32, device=dev) for t in group_by_slot(slots, 8))
    per_segment = y.clone()
    sgmv(x, per_segment, a, b, order, starts, scratch)
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
