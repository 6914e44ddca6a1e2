"""Decode pipelining (the next decode forward queued before this step's tokens reach the host) makes
the same tokens as stepping one forward at a time: greedy and seeded sampling, requests stopping
mid-batch (only some rows of the forward run ahead are used), preemption, prefix caching and n > 1.
On the CPU the forward run ahead is computed at once, so these tests check the bookkeeping; the GPU
suite checks the overlap."""

from __future__ import annotations

import random

import pytest
import torch

import infer
from infer import LLM, SamplingParams
from infer.api import Capabilities
from infer.runtime.runner import ModelRunner

rng = random.Random(0)
PROMPTS = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 9, 33, 2, 12, 24, 7)]


def run(model_dir, prompts, params, **options):
    with LLM(model=str(model_dir), device="cpu", dtype="float32", **options) as llm:
        outs = llm.generate(prompts, params)
        runner: ModelRunner = llm.engine.decoder.runner
        hits, misses = (runner.pipeline.hits, runner.pipeline.misses) if runner.pipeline is not None else (0, 0)
        return [o.outputs[0].token_ids for o in outs], hits, misses


def stop_tokens_mid_run(model_dir, params):
    """Per prompt, a token its greedy continuation emits part-way: requests then stop at different steps."""
    tokens, _, _ = run(model_dir, PROMPTS, params, pipeline_decode=False)

    def first_new(t, start):  # a token first emitted at or after `start`: the request stops exactly there
        return next(([x] for j, x in enumerate(t) if j >= start and x not in t[:j]), [])

    return [
        SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            seed=params.seed,
            stop_token_ids=first_new(t, 3 + i % 5),
        )
        for i, t in enumerate(tokens)
    ]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_seqs": 1},
        {"num_kv_blocks": 12, "block_size": 4, "max_model_len": 48, "max_num_seqs": 4},  # preemption
        {"num_kv_blocks": 12, "block_size": 4, "max_model_len": 48, "max_num_seqs": 4, "preemption_mode": "swap"},
        {"enable_prefix_caching": False, "max_num_batched_tokens": 16},  # chunked prefill
    ],
    ids=["batch", "batch-1", "recompute", "swap", "chunked"],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_greedy_tokens_identical_with_and_without_pipelining(tiny_llama_dir, options):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected, hits0, _ = run(tiny_llama_dir, PROMPTS, params, pipeline_decode=False, **options)
    got, hits, misses = run(tiny_llama_dir, PROMPTS, params, pipeline_decode=True, **options)
    assert got == expected
    assert hits0 == 0 and hits > 0, "no step was served by a forward queued ahead"


def test_engine_stats_report_pipelined_steps(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", pipeline_decode=True) as llm:
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        stats = llm.engine.stats()
        assert stats["pipelined_steps"] == 8 and stats["pipeline_misses"] == 0  # steps 2..9 of 10 new tokens
        llm.engine.reset_stats()  # what a benchmark does after its warm-up
        stats = llm.engine.stats()
    assert stats["steps"] == 0 and stats["pipelined_steps"] == 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_requests_stopping_mid_batch(tiny_llama_dir):
    base = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    params = stop_tokens_mid_run(tiny_llama_dir, base)
    expected, _, _ = run(tiny_llama_dir, PROMPTS, params, pipeline_decode=False)
    got, hits, _ = run(tiny_llama_dir, PROMPTS, params, pipeline_decode=True)
    assert got == expected
    assert len({len(t) for t in got}) > 1, "requests should stop at different steps"
    assert hits > 0


def test_seeded_sampling_and_parallel_samples(tiny_llama_dir):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, n=3)

    def all_samples(**options):
        with LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", **options) as llm:
            return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:4], params)]

    assert all_samples(pipeline_decode=True) == all_samples(pipeline_decode=False)


def test_logprobs_turn_pipelining_off_for_that_step(tiny_llama_dir):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    expected, _, _ = run(tiny_llama_dir, PROMPTS[:3], params, pipeline_decode=False)
    got, hits, _ = run(tiny_llama_dir, PROMPTS[:3], params, pipeline_decode=True)
    assert got == expected and hits == 0


def test_pipelining_is_off_by_default_on_the_cpu(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32") as llm:
        assert llm.engine.decoder.runner.pipeline is None
    with LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", pipeline_decode=True, sampler="naive") as llm:
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0))
        assert llm.engine.decoder.runner.pipeline.hits == 0  # the naive sampler cannot leave tokens on the device
    assert torch.get_num_threads() >= 1


def test_beam_search_beside_plain_requests(tiny_llama_dir):
    # beams are never run ahead (their tables are rewritten every step); the plain requests beside them may be
    params = [
        SamplingParams(max_tokens=10, use_beam_search=True, best_of=3, temperature=0)
        if i % 2
        else SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        for i in range(4)
    ]

    def outputs(**options):
        with LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", **options) as llm:
            return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:4], params)]

    assert outputs(pipeline_decode=True) == outputs(pipeline_decode=False)


class UndeclaredDecoder:
    """Steps through the runner, one token a step, but does not declare `pipeline_safe`."""

    capabilities = Capabilities()
    num_lookahead_tokens = 0

    def __init__(self, ctx) -> None:
        self.runner = ctx.runner

    def execute(self, out):
        return self.runner.execute(out)


class UndeclaredPlugin:
    @staticmethod
    @infer.hookimpl
    def infer_register_decoders(register):
        register("undeclared", UndeclaredDecoder)


def test_only_decoders_that_declare_it_are_pipelined(tiny_llama_dir):
    options = dict(device="cpu", dtype="float32", pipeline_decode=True)
    with LLM(model=str(tiny_llama_dir), decoding="undeclared", plugins=[UndeclaredPlugin], **options) as llm:
        assert llm.engine.decoder.runner.pipeline is None
    with LLM(model=str(tiny_llama_dir), decoding="early-exit", exit_layer=1, **options) as llm:
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert llm.engine.decoder.runner.pipeline.hits > 0
    # speculative decoding's steps that draft nothing are plain steps: tests/plugins/decoding/test_speculative.py


def test_full_batch_with_requests_waiting(tiny_llama_dir):
    # the batch is full and others wait: a request that stops lets one in, which the forward queued
    # ahead did not include (a miss); after a miss the runner backs off before guessing again
    params = [SamplingParams(max_tokens=6 + 5 * (i % 4), temperature=0, ignore_eos=True) for i in range(8)]
    expected, _, _ = run(tiny_llama_dir, PROMPTS, params, pipeline_decode=False, max_num_seqs=2)
    got, hits, misses = run(tiny_llama_dir, PROMPTS, params, pipeline_decode=True, max_num_seqs=2)
    assert got == expected
    assert hits > 4 * misses > 0


def test_backoff_doubles_after_misses_and_resets_on_a_hit():
    from types import SimpleNamespace

    from infer.api import BatchOutlook
    from infer.runtime.pipeline import Pipeline

    pipeline = Pipeline(SimpleNamespace(sampler=None), scheduler=None)
    pipeline.scheduler = SimpleNamespace(next_batch_outlook=lambda: BatchOutlook.LIKELY)
    pipeline._count(hit=False)
    pipeline._count(hit=False)
    assert pipeline._backoff == 2
    assert [pipeline._should_queue_ahead() for _ in range(3)] == [False, False, True]
    pipeline._count(hit=True)
    assert pipeline._backoff == 0 and pipeline._should_queue_ahead()
