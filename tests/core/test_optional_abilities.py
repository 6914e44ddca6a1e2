"""Optional abilities are small runtime_checkable protocols: a strategy that has one is used through
it, and a third-party strategy with none of them still runs, with the same tokens (decode pipelining
then queues no forward ahead)."""

from __future__ import annotations

import warnings

import pytest
import torch

import infer
from infer import SamplingParams
from infer.api import (
    BatchOutlook,
    Capabilities,
    FusingActivation,
    HFArchitectures,
    LinearMatmul,
    ModelPresets,
    PipeliningScheduler,
    ResettableStats,
    RotaryFusingAttention,
    RotaryTables,
    SelfDescribing,
    StatsSummary,
    TokenBudgeted,
    TokenSampler,
    VerifyingSampler,
    pushes_partial_sums,
)
from infer.api.errors import ConfigError
from infer.core.step_budget import FIRST_TOKENS
from infer.llm import LLM
from infer.plugins.sampler.vectorized import VectorizedSampler
from infer.plugins.scheduler.fcfs import FcfsScheduler

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 40)), [3] * 9]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


class BareScheduler:
    """A third-party scheduler with the `Scheduler` protocol only (fcfs inside, none of its extras)."""

    def __init__(self, config, allocator) -> None:
        self._fcfs = FcfsScheduler(config, allocator)
        self.allocator = allocator
        self.num_lookahead_tokens = 0

    def add(self, request):
        self._fcfs.num_lookahead_tokens = self.num_lookahead_tokens
        self._fcfs.add(request)

    def abort(self, request_id):
        return self._fcfs.abort(request_id)

    def finish(self, request, reason):
        self._fcfs.finish(request, reason)

    def schedule(self):
        return self._fcfs.schedule()

    def update(self, out, result):
        return self._fcfs.update(out, result)

    def has_unfinished(self):
        return self._fcfs.has_unfinished()

    def stats(self):
        return self._fcfs.stats()


class AttributeBudgetScheduler(BareScheduler):
    """A scheduler of plugin API 2.1's `TokenBudgeted`: its budget an attribute the engine wrote."""

    @property
    def max_num_batched_tokens(self) -> int:
        return self._fcfs.max_num_batched_tokens

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, tokens: int) -> None:
        self._fcfs.max_num_batched_tokens = tokens


class BareSampler:
    """A sampler with `sample` only."""

    def __init__(self, vocab_size, device) -> None:
        self._inner = VectorizedSampler(vocab_size, device)

    def sample(self, logits, requests, positions=None):
        return self._inner.sample(logits, requests, positions)


class BareDecoder:
    """A decoder with neither `describe` nor `summarize`; its steps may be pipelined."""

    capabilities = Capabilities(pipeline_safe=True)
    num_lookahead_tokens = 0

    def __init__(self, ctx) -> None:
        self.runner = ctx.runner

    def execute(self, out):
        return self.runner.execute(out)


class CountingScheduler(FcfsScheduler):
    """fcfs, counting the calls decode pipelining makes."""

    calls: dict[str, int] = {}

    def next_batch_outlook(self) -> BatchOutlook:
        self.calls["outlook"] = self.calls.get("outlook", 0) + 1
        return super().next_batch_outlook()

    def reserve_ahead(self, request, num_tokens) -> bool:
        self.calls["reserve"] = self.calls.get("reserve", 0) + 1
        return super().reserve_ahead(request, num_tokens)


class DescribedDecoder(BareDecoder):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.describe = {"flavour": "plain"}

    def summarize(self, totals):
        return {"steps_seen": 1.0}


class Plugin:
    @staticmethod
    @infer.hookimpl
    def infer_register_schedulers(register):
        register("bare", BareScheduler)
        register("counting", CountingScheduler)
        register("attribute-budget", AttributeBudgetScheduler)

    @staticmethod
    @infer.hookimpl
    def infer_register_samplers(register):
        register("bare", BareSampler)

    @staticmethod
    @infer.hookimpl
    def infer_register_decoders(register):
        register("bare", BareDecoder)
        register("described", DescribedDecoder)


def generate(model_dir, **options):
    """Tokens, the target's runner, the engine's stats and the engine, closed (after a `reset_stats`)."""
    with LLM(model=str(model_dir), device="cpu", dtype="float32", block_size=4, plugins=[Plugin], **options) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.engine.stats()
        llm.engine.reset_stats()
        return [o.outputs[0].token_ids for o in outs], llm.engine.parts.runners[0], stats, llm.engine


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return generate(tiny_llama_dir, pipeline_decode=False)[0]


def test_strategies_without_optional_abilities_still_run(tiny_llama_dir, expected):
    tokens, runner, stats, engine = generate(
        tiny_llama_dir, scheduler="bare", sampler="bare", decoding="bare", pipeline_decode=True
    )
    assert tokens == expected
    assert not isinstance(engine.scheduler, (PipeliningScheduler, ResettableStats))
    assert not isinstance(runner.sampler, (TokenSampler, VerifyingSampler))
    assert not isinstance(engine.decoder, (SelfDescribing, StatsSummary))
    assert runner.pipeline and not runner.pipeline.samples_on_device and runner.pipeline.scheduler is None
    assert stats["pipelined_steps"] == stats["pipeline_misses"] == 0 and "preemptions" in stats
    assert engine.num_steps == 0  # reset_stats ran, with no scheduler counters to reset


def test_scheduler_without_slot_reservation_queues_nothing_ahead(tiny_llama_dir, expected):
    tokens, runner, stats, _ = generate(tiny_llama_dir, scheduler="bare", pipeline_decode=True)
    assert tokens == expected
    assert runner.pipeline.samples_on_device and runner.pipeline.scheduler is None
    assert stats["pipelined_steps"] == stats["pipeline_misses"] == 0


def test_scheduler_with_slot_reservation_guides_pipelining(tiny_llama_dir, expected):
    CountingScheduler.calls = {}
    tokens, runner, stats, _ = generate(tiny_llama_dir, scheduler="counting", pipeline_decode=True)
    assert tokens == expected
    assert isinstance(runner.pipeline.scheduler, CountingScheduler)
    assert stats["pipelined_steps"] > 0 and runner.pipeline.hits == 0  # counted, then reset
    assert CountingScheduler.calls["outlook"] > 0
    assert CountingScheduler.calls["reserve"] > 0  # block_size 4: forwards queued ahead start new blocks


def test_max_step_ms_sets_a_token_budgeted_schedulers_budget(tiny_llama_dir, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        tokens, _, _, engine = generate(tiny_llama_dir, max_step_ms=60_000.0)
    assert isinstance(engine.parts.scheduler, TokenBudgeted)
    assert tokens == expected and engine.parts.scheduler.max_num_batched_tokens == FIRST_TOKENS  # not 4096


def test_a_budget_attribute_alone_is_still_set_with_a_warning(tiny_llama_dir, expected):
    with pytest.warns(DeprecationWarning, match="set_token_budget"):
        tokens, _, _, engine = generate(tiny_llama_dir, scheduler="attribute-budget", max_step_ms=60_000.0)
    assert not isinstance(engine.parts.scheduler, TokenBudgeted)
    assert tokens == expected and engine.parts.scheduler.max_num_batched_tokens == FIRST_TOKENS


def test_decoder_description_and_summary_are_used(tiny_llama_dir):
    _, _, stats, engine = generate(tiny_llama_dir, decoding="described")
    assert engine.parts.describe["flavour"] == "plain"
    assert stats["steps_seen"] == 1.0


def test_speculative_decoding_refuses_a_sampler_that_cannot_verify(tiny_llama_dir):
    with pytest.raises(ConfigError, match="probs"):
        LLM(model=str(tiny_llama_dir), sampler="bare", decoding="speculative", draft="ngram", plugins=[Plugin])


def test_built_in_strategies_declare_their_abilities():
    from infer.plugins.attention.paged_cuda import PagedCudaAttention
    from infer.plugins.attention.torch_backend import TorchAttention
    from infer.plugins.decoding.speculative import SpeculativeDecoder
    from infer.plugins.layer import fused, torch_layers
    from infer.plugins.model.llama import Llama
    from infer.plugins.sampler.naive import NaiveSampler
    from infer.plugins.scheduler.static import StaticScheduler

    vectorized, naive = VectorizedSampler(16, torch.device("cpu")), NaiveSampler(16, torch.device("cpu"))
    assert isinstance(vectorized, TokenSampler) and isinstance(vectorized, VerifyingSampler)
    assert isinstance(naive, VerifyingSampler) and not isinstance(naive, TokenSampler)
    for scheduler in (FcfsScheduler, StaticScheduler):
        assert issubclass(scheduler, PipeliningScheduler) and issubclass(scheduler, ResettableStats)
    assert issubclass(SpeculativeDecoder, StatsSummary)
    assert issubclass(PagedCudaAttention, RotaryFusingAttention)
    assert not issubclass(TorchAttention, RotaryFusingAttention)
    assert isinstance(Llama, HFArchitectures) and isinstance(Llama, ModelPresets)
    assert isinstance(fused.FusedSiluAndMul(), FusingActivation)
    assert not isinstance(torch_layers.SiluAndMul(), FusingActivation)
    assert isinstance(fused.FusedLinear, LinearMatmul) and isinstance(torch_layers.Linear, LinearMatmul)
    assert isinstance(fused.FusedRotaryEmbedding, RotaryTables) and fused.FusedRotaryEmbedding.fuses_into_attention
    assert not isinstance(torch_layers.RotaryEmbedding, RotaryTables)
    assert pushes_partial_sums(fused.FusedLinear.matmul) and pushes_partial_sums(fused.FusedSiluAndMul().down)
    assert not pushes_partial_sums(torch_layers.Linear.matmul)
    assert not pushes_partial_sums(torch.nn.functional.linear)
