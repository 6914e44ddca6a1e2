"""`infer.kernels.argmax` compiled, at Llama-3's vocabulary: torch.argmax's indices for random rows
and edge rows (NaN, ties across chunks, infinities, signed zeros), at batch 1 and larger, float32 and
bfloat16; the vectorized sampler's greedy rows on a GPU take it and give the same tokens."""

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 128256


def edge_rows(v: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, v, device="cuda", generator=gen)
    x[1] = float("-inf")
    x[2, 5000], x[2, v - 5] = float("nan"), float("nan")
    x[3, 100], x[3, v - 100] = 1e4, 1e4
    x[4, 70000], x[4, 9000] = float("inf"), float("inf")
    x[5] = -1.0
    x[5, 3], x[5, 3 + 4096] = -0.0, 0.0  # equal, in two chunks: the first wins
    x[6, v - 1] = 1e4
    x[7, v - 1], x[7, 0] = float("nan"), float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 256])
def test_argmax_rows_is_torch_argmax(dtype, rows):
    from infer.kernels.argmax import argmax_rows

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, VOCAB, device="cuda", generator=gen).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    edges = edge_rows(VOCAB, dtype)
    assert torch.equal(argmax_rows(edges), edges.argmax(dim=-1))


def test_greedy_sampling_on_the_gpu_is_the_argmax():
    from infer.api.request import SamplingParams
    from infer.plugins.sampler.vectorized import VectorizedSampler
    from infer.testing.sampling import make_request

    logits = edge_rows(VOCAB, torch.float32)
    before = logits.clone()
    requests = [make_request(i, SamplingParams(temperature=0.0, max_tokens=4)) for i in range(8)]
    sampler = VectorizedSampler(VOCAB, torch.device("cuda"))
    assert sampler.sample(logits, requests).token_ids == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())
