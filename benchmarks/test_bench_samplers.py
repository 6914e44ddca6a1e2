import random

import pytest
import torch

from infer.api.request import Request, SamplingParams
from infer.plugins.sampler.naive import NaiveSampler
from infer.plugins.sampler.vectorized import VectorizedSampler

VOCAB = 49152
SAMPLERS = {"naive": NaiveSampler, "vectorized": VectorizedSampler}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def mixed_batch(batch: int, device: str, seed: int = 0) -> tuple[torch.Tensor, list[Request], list[int]]:
    rnd = random.Random(seed)
    reqs = []
    for i in range(batch):
        params = SamplingParams(
            temperature=rnd.choice([0.0, 0.7, 1.0]),
            top_k=rnd.choice([0, 50]),
            top_p=rnd.choice([1.0, 0.9]),
            min_p=rnd.choice([0.0, 0.05]),
            repetition_penalty=rnd.choice([1.0, 1.1]),
            presence_penalty=rnd.choice([0.0, 0.5]),
            frequency_penalty=rnd.choice([0.0, 0.2]),
            logprobs=rnd.choice([None, None, 5]),
        )
        prompt = [rnd.randrange(VOCAB) for _ in range(256)]
        r = Request(request_id=f"r{i}", prompt_token_ids=prompt, params=params, arrival=i, seed=rnd.getrandbits(63))
        r.output_token_ids = [rnd.randrange(VOCAB) for _ in range(64)]
        reqs.append(r)
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    return logits.to(device), reqs, [len(r.output_token_ids) for r in reqs]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.benchmark(group="sampler")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_sampler_step(benchmark, name, batch, device):
    logits, reqs, positions = mixed_batch(batch, device)
    sampler = SAMPLERS[name](VOCAB, torch.device(device))
    out = benchmark(sampler.sample, logits, reqs, positions)
    assert len(out.token_ids) == batch
