"""End to end on the GPU: every attention backend against the torch reference, CUDA graphs on/off.

Dummy weights (same seed, so every engine has the same model): fp32 greedy tokens must be identical
and logprobs close; bf16 backends (FlashInfer) are compared on logprobs within a tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer import SamplingParams
from infer.llm import LLM

pytestmark = pytest.mark.gpu

rng = random.Random(0)
PROMPTS = [[rng.randrange(10, 49000) for _ in range(n)] for n in (1, 7, 16, 33, 200, 700, 1100, 64)]
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)


def generate(**opts):
    llm = LLM(model="smollm2-135m", load_format="dummy", max_model_len=2048, max_num_batched_tokens=1024, **opts)
    outs = llm.generate(PROMPTS, PARAMS)
    llm.close()
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return toks, lps


@pytest.fixture(scope="module")
def reference_fp32():
    return generate(attention="torch", dtype="float32", cuda_graphs=False)


def _available(name):
    from infer.core.registry import PluginRegistry

    reg = PluginRegistry.load()
    if name not in reg.names("attention"):
        return False
    return reg.get("attention", name).unavailable_reason() is None


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_paged_cuda_matches_torch_fp32(reference_fp32, cuda_graphs):
    toks, lps = generate(attention="paged-cuda", dtype="float32", cuda_graphs=cuda_graphs)
    assert toks == reference_fp32[0]
    for a, b in zip(lps, reference_fp32[1]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-3, rtol=0)


def test_hybrid_xformers_prefill_paged_decode_fp32(reference_fp32):
    if not _available("xformers"):
        pytest.skip("xformers cannot run here")
    toks, _ = generate(attention="paged-cuda", prefill_attention="xformers", dtype="float16", cuda_graphs=False)
    ref16, _ = generate(attention="torch", dtype="float16", cuda_graphs=False)
    agree = sum(a == b for x, y in zip(toks, ref16) for a, b in zip(x, y)) / sum(map(len, ref16))
    assert agree > 0.9


@pytest.mark.parametrize("backend", ["paged-cuda", "flashinfer"])
def test_bf16_backends_agree_with_torch(backend):
    if not _available(backend):
        pytest.skip(f"{backend} cannot run here")
    ref_toks, ref_lps = generate(attention="torch", dtype="bfloat16", cuda_graphs=False)
    toks, lps = generate(attention=backend, dtype="bfloat16", cuda_graphs=True)
    first = [x[0] for x in toks]
    assert first == [x[0] for x in ref_toks]  # prefill logits agree on the argmax
    torch.testing.assert_close(
        torch.tensor([x[0] for x in lps]), torch.tensor([x[0] for x in ref_lps]), atol=5e-2, rtol=0
    )
    agree = sum(a == b for x, y in zip(toks, ref_toks) for a, b in zip(x, y)) / sum(map(len, ref_toks))
    assert agree > 0.8, agree


SHARED = [rng.randrange(10, 49000) for _ in range(300)]
SHARED_PROMPTS = [SHARED + [rng.randrange(10, 49000) for _ in range(n)] for n in (5, 40, 1, 77)] + PROMPTS[:4]


@pytest.mark.parametrize(
    "opts",
    [
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=64),
        dict(num_kv_blocks=40, max_model_len=640, preemption_mode="swap"),
        dict(num_kv_blocks=40, max_model_len=640, preemption_mode="recompute"),
    ],
    ids=["no-prefix-cache", "chunked-64", "swap", "recompute"],
)
def test_kv_management_does_not_change_greedy_tokens_on_gpu(opts):
    def run(**extra):
        llm = LLM(
            model="smollm2-135m",
            load_format="dummy",
            attention="paged-cuda",
            dtype="float32",
            **{"max_model_len": 2048, **extra},
        )
        outs = llm.generate(SHARED_PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        stats = llm.engine.stats()
        llm.close()
        return [o.outputs[0].token_ids for o in outs], stats

    base, _ = run()
    got, stats = run(**opts)
    assert got == base, stats


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_pipelined_decode_makes_the_same_tokens(max_num_seqs):
    """Decode pipelining (the next forward queued from the sampled ids on the device, replayed from
    a CUDA graph) against one step at a time: greedy tokens identical, requests stopping at
    different steps. The eager path is covered on the CPU (tests/core/test_pipeline_decode.py)."""

    def run(pipeline, params):
        llm = LLM(
            model="smollm2-135m",
            load_format="dummy",
            max_model_len=2048,
            attention="paged-cuda",
            dtype="float32",
            max_num_seqs=max_num_seqs,
            pipeline_decode=pipeline,
        )
        outs = llm.generate(SHARED_PROMPTS, params)
        runner = llm.engine.decoder.runner
        hits = runner.pipeline.hits if runner.pipeline is not None else 0
        llm.close()
        return [o.outputs[0].token_ids for o in outs], hits

    plain = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    base, _ = run(False, plain)
    stops = [
        SamplingParams(max_tokens=32, temperature=0, stop_token_ids=first_new_token(t, 4 + i % 7))
        for i, t in enumerate(base)
    ]
    for params in (plain, stops):
        expected, _ = run(False, params)
        got, hits = run(True, params)
        assert got == expected
        assert hits > 0


def first_new_token(tokens, start):
    """[the first token at or after `start` that has not occurred before it], or [] (then it runs to
    max_tokens): a stop token that ends the request exactly there."""
    return next(([t] for j, t in enumerate(tokens) if j >= start and t not in tokens[:j]), [])


@pytest.mark.parametrize(
    "kv", [{}, dict(num_kv_blocks=7, block_size=8, max_model_len=52, max_num_seqs=4)], ids=["roomy", "preempted"]
)
def test_speculative_draft_model_is_lossless_on_gpu(tmp_path_factory, kv):
    """A draft model's proposal steps replay its own CUDA graphs; the verified output must still be
    autoregressive's, token for token (paged-cuda, fp32, tiny real-weight Llamas; paged-cuda's
    smallest block is 8 tokens, so the preempting cache is 7 blocks of 8)."""
    from infer.testing.decoder import generate, write_tiny_llamas

    target, draft = write_tiny_llamas(tmp_path_factory.mktemp("spec-gpu"))
    cuda = torch.device("cuda")
    options = dict(attention="paged-cuda", **kv)
    expected = generate(target, cuda, "autoregressive", None, **options)
    got = generate(target, cuda, "speculative", draft, **options)
    assert got == expected
