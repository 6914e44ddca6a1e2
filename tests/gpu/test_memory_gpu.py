"""Three engines at the default KV budget, built, used and closed in turn in one process: the device
memory comes back within 1 GiB of the start each time, also while the closed engines are still
referenced, and each engine gets the same KV budget as the first."""

from __future__ import annotations

import gc

import pytest
import torch

from infer import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


@pytest.mark.parametrize("keep", [False, True], ids=["deleted", "still-referenced"])
def test_three_engines_in_turn_give_their_memory_back(keep):
    gc.collect()
    torch.cuda.empty_cache()
    start = _used_gib()
    kept, blocks = [], []
    mix = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=24, n=2, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=12, use_beam_search=True, best_of=3),
    ]
    for i in range(3):
        llm = LLM(model="llama2-7b", load_format="dummy")
        built = _used_gib()
        prompts = [[(11 * j + k) % 31000 + 10 for k in range(30 + 7 * j)] for j in range(len(mix))]
        outs = llm.generate(prompts, mix)
        assert [o.error for o in outs] == [None] * len(mix)
        blocks.append(llm.engine.parts.describe["kv_blocks"])
        llm.close()
        if keep:
            kept.append(llm)
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
        after = _used_gib()
        print(
            f"engine {i}: {blocks[-1]} KV blocks, {built:.2f} GiB used when built, {after:.2f} GiB after close "
            f"(start {start:.2f}, +{after - start:.2f})"
        )
        assert after - start < 1.0
    assert min(blocks) >= 0.98 * blocks[0]
