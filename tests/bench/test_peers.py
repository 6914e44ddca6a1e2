"""The HF transformers peers: a static batch that does not fit is reported, not fatal."""

from __future__ import annotations

import torch

from infer.bench.peers import hf_static


class Model(torch.nn.Module):
    """A stand-in for LlamaForCausalLM.generate: runs out of memory above `fits` rows."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits = fits
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def generate(self, ids, attention_mask, max_new_tokens, **_):
        if ids.shape[0] > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 854.00 MiB.")
        return torch.cat([ids, torch.ones(ids.shape[0], max_new_tokens, dtype=ids.dtype)], dim=1)


def test_static_batch_out_of_memory_is_a_record_with_the_reason():
    prompts, max_tokens = [[1, 2, 3]] * 8, [5] * 8
    failed = hf_static(Model(fits=2), prompts, max_tokens, batch_size=4)
    assert (
        failed.error == "out of memory at batch 4" and failed.output_tokens == 0 and failed.output_tokens_per_s == 0.0
    )
    ran = hf_static(Model(fits=2), prompts, max_tokens, batch_size=2)
    assert ran.error is None and ran.output_tokens == 40 and ran.label == "hf-static-2"


def test_static_kv_bytes_is_the_largest_padded_batch():
    from types import SimpleNamespace

    from infer.bench.peers import static_kv_bytes

    # llama2-7b: 32 layers x 32 KV heads x 128 x K and V x 2 bytes = 512 KiB per token
    config = SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, hidden_size=4096)
    prompts, max_tokens = [[1] * 100, [1] * 1000, [1] * 10, [1] * 10], [900, 10, 50, 50]
    # batches of 2: rows (100, 1000) padded to 1000 + 900; rows (10, 10) to 10 + 50
    assert static_kv_bytes(config, torch.bfloat16, prompts, max_tokens, 2) == 2 * 1900 * 512 * 1024
    assert static_kv_bytes(config, torch.bfloat16, prompts, max_tokens, 1) == 1 * 1010 * 512 * 1024
