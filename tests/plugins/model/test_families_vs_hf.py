"""Each built-in model family against HF transformers' own implementation of it (fp32, CPU): greedy
tokens identical on 8 prompts x 32 tokens (and their log-probabilities within 1e-4), at tp 1 and
tp 2 (gloo), with and without forced preemption; lossless self-drafting; early exit as HF's model
cut to its first layers."""

from __future__ import annotations

import pytest
from families import FAMILIES, PLUGINS, check_against_hf, prompts

from infer import SamplingParams
from infer.llm import LLM

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
# 24 blocks of 4 tokens for 8 requests of up to 72: later arrivals are preempted and recomputed
PREEMPTING = dict(num_kv_blocks=24, max_model_len=80, max_num_batched_tokens=64)


def generate(folder, tp: int = 1, params: SamplingParams = GREEDY, **options) -> tuple[list, dict]:
    options = dict(model=str(folder), dtype="float32", device="cpu", block_size=4, **options)
    with LLM(tensor_parallel_size=tp, plugins=PLUGINS, **options) as llm:
        outs = llm.generate(prompts(), params)
        return [o.outputs[0] for o in outs], llm.engine.stats()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identical_to_hf(checkpoints, family, preempt, tp):
    ckpt = checkpoints(family)
    outputs, stats = generate(ckpt.folder, tp, **(PREEMPTING if preempt else {}))
    assert (stats["preemptions"] > 0) == preempt
    check_against_hf(ckpt.model, prompts(), outputs)


# the quick loop keeps the family that differs most from Llama
DECODER_FAMILIES = [f if f == "gemma2" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_self_draft_is_lossless_and_early_exit_is_hf_cut_short(checkpoints, family):
    """Speculative decoding drafting with the first two layers keeps HF's tokens; early exit after two
    layers gives what HF's model gives with its third layer removed."""
    ckpt = checkpoints(family)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outputs, stats = generate(ckpt.folder, params=params, decoding="speculative", draft="self", exit_layer=2)
    check_against_hf(ckpt.model, prompts(), outputs)
    assert stats["spec_accepted"] > 0
    outputs, _ = generate(ckpt.folder, decoding="early-exit", exit_layer=2)
    model = ckpt.model.model
    layers = model.layers
    try:
        model.layers = layers[:2]
        model.config.num_hidden_layers = 2
        check_against_hf(ckpt.model, prompts(), outputs)
    finally:
        model.layers, model.config.num_hidden_layers = layers, 3
