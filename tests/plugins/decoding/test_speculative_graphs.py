"""Speculative steps on the CUDA-graph path, checked on the CPU.

A stand-in graph runner (the real `CudaGraphRunner`: its static buffers, padding to a bucket and
null-block rows; only the replay is the captured forward run eagerly) is attached to every runner,
so the test sees which forwards would replay a graph: the target's verify steps (a request's new
token and draft as decode rows) and the self-draft's and draft model's proposal steps. Greedy output
stays autoregressive's with drafts shorter than K (ngram), requests that end mid-draft and
preemption. An attention backend that does not write a step's K/V first verifies with the extend
path instead, eagerly.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import infer
from infer import SamplingParams
from infer.llm import LLM
from infer.plugins.attention.torch_backend import TorchAttention
from infer.testing.decoder import write_tiny_llamas
from infer.testing.graphs import StandInGraphs, attach_stand_in_graphs

PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7],
    [10, 11],
    list(range(20, 60)),
    [3] * 17,
    [100, 7, 200, 13, 99, 42],
    [7, 8, 7, 8, 7, 8],
    list(range(100, 130)) + list(range(100, 110)),
    [1, 2, 3],
]
# some requests end before a full draft fits (max_draft clamps to max_tokens), one after one token
MAX_TOKENS = [16, 3, 7, 16, 1, 9, 16, 5]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
SETTINGS = {
    "batch-8": dict(block_size=4),
    "preemption": dict(block_size=4, num_kv_blocks=16, max_model_len=60),  # 64 slots for 8 requests
}
PROPOSERS = {
    "ngram": lambda draft: dict(draft="ngram"),
    "self-1": lambda draft: dict(draft="self", exit_layer=1),
    "draft-model": lambda draft: dict(draft=str(draft)),
}


@dataclasses.dataclass
class Step:
    use_graphs: bool
    decode_only: bool  # every row one token with logits
    rows_per_request: list[int]  # rows sharing one block table: > 1 for a verify step of decode rows


def stand_in_graphs(llm: LLM) -> list[list[Step]]:
    """Attach stand-in graphs to every runner, sized as the builder sizes real ones (the attention
    spec's rows), and record each forward's shape; returns the records, one list per runner."""
    records = []
    for runner in llm.engine.parts.runners:
        attach_stand_in_graphs(runner, llm.engine.parts.max_model_len)
        steps: list[Step] = []
        records.append(steps)
        runner.run = recording(runner.run, steps)
    return records


def recording(run, steps: list[Step]):
    def run_and_record(step):
        decode_only = all(q == 1 for q in step.query_lens) and len(step.logits_rows) == len(step.query_lens)
        shared = sorted(Counter(id(t) for t in step.block_tables).values())
        steps.append(Step(step.use_graphs, decode_only, shared))
        return run(step)

    return run_and_record


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A three-layer target and its one-layer draft (the target's first layer)."""
    return write_tiny_llamas(tmp_path_factory.mktemp("spec-graphs"))


@pytest.fixture(scope="module")
def expected(tiny):
    target, _ = tiny
    out = {}
    for name, settings in SETTINGS.items():
        with LLM(model=str(target), **settings) as llm:
            out[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return out


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_verify_and_proposal_steps_take_the_graph_path_and_stay_lossless(tiny, expected, proposer, setting):
    target, draft = tiny
    options = dict(decoding="speculative", **PROPOSERS[proposer](draft), **SETTINGS[setting])
    with LLM(model=str(target), **options) as llm:
        records = stand_in_graphs(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        stats = llm.engine.stats()
    assert got == expected[setting]
    assert stats["spec_proposed"] > 0
    if setting == "preemption":
        assert stats["preemptions"] > 0
    k = llm.config.num_speculative_tokens
    verify = [s for s in records[0] if max(s.rows_per_request) > 1]
    assert verify and all(s.use_graphs for s in verify if s.decode_only)  # every decode-only verify step replays
    assert all(max(s.rows_per_request) <= k + 1 for s in verify)
    if proposer == "ngram":  # prompt lookup drafts fewer than K where it finds fewer tokens
        assert any(1 < n < k + 1 for s in verify if s.use_graphs for n in s.rows_per_request)
    else:  # the draft's own runner: its proposal steps replay too
        drafting = records[1]
        assert any(s.use_graphs for s in drafting)
        assert all(s.use_graphs for s in drafting if s.decode_only)


def test_a_draft_equal_to_the_target_replays_its_catch_up_and_is_always_accepted(tiny, expected):
    """After a fully accepted step the draft model catches up two tokens (its last draft token and
    the bonus token) as two decode rows in a replayed step; its cache stays exact."""
    target, _ = tiny
    options = dict(decoding="speculative", draft=str(target), **SETTINGS["batch-8"])
    with LLM(model=str(target), **options) as llm:
        records = stand_in_graphs(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        stats = llm.engine.stats()
    assert got == expected["batch-8"]
    assert stats["acceptance_rate"] > 0.97
    assert any(s.use_graphs and 2 in s.rows_per_request for s in records[1])


class ExtendOnlyAttention(TorchAttention):  # the same kernels, not promising to write K/V first
    capabilities = dataclasses.replace(TorchAttention.capabilities, writes_kv_first=False)


class Plugin:
    @staticmethod
    @infer.hookimpl
    def infer_register_attention_backends(register):
        register("extend-only", ExtendOnlyAttention)


def test_a_backend_that_does_not_write_kv_first_verifies_with_the_extend_path(tiny, expected):
    target, _ = tiny
    options = dict(decoding="speculative", draft="self", exit_layer=1, **SETTINGS["batch-8"])
    with LLM(model=str(target), attention="extend-only", plugins=[Plugin], **options) as llm:
        records = stand_in_graphs(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == expected["batch-8"]
    assert all(max(s.rows_per_request) == 1 for r in records for s in r)  # no request split into rows
    assert any(not s.decode_only and not s.use_graphs for s in records[0])  # k + 1 query tokens, eagerly
    assert any(s.use_graphs for s in records[1])  # the self-draft's single-token steps still replay


def test_padded_rows_write_only_the_null_block_and_rows_match_the_eager_forward(tiny):
    """Three rows replayed in the bucket of four: the logits are the eager forward's, and the padded
    row writes nothing but the null block. The table holds more blocks than the graph has columns
    (blocks reserved for drafts past max_model_len's): the columns no row reads are left out."""
    target, _ = tiny
    with LLM(model=str(target), block_size=4, decoding="speculative", draft="ngram") as llm:
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        runner = llm.engine.parts.runners[0]
        null_block = runner.kv_caches[0][0].shape[0] - 1
        graphs = StandInGraphs(
            runner.model, runner.attention, runner.kv_caches, 4, 8, 64, null_block, runner.device, None
        )
        graphs.capture()
        # one request's token and two draft tokens as three rows over blocks 0 and 1
        tables, seq_lens, tokens = [[0, 1, *range(2, 20)]] * 3, [6, 7, 8], [11, 12, 13]
        assert graphs.max_blocks < len(tables[0])
        eager_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        before = [k.clone() for k, _ in runner.kv_caches]
        logits = graphs.run(tokens, seq_lens, tables).clone()
        assert graphs.replays == {4: 1}
        changed = {
            int(b) for k, k0 in zip((k for k, _ in runner.kv_caches), before) for b in torch.nonzero(k != k0)[:, 0]
        }
        assert changed <= {1, null_block}  # positions 5, 6, 7 sit in block 1
        runner.kv_caches[:] = eager_caches
        batch_runner_logits = eager_rows(runner, tokens, seq_lens, tables)
    torch.testing.assert_close(logits, batch_runner_logits, rtol=1e-5, atol=1e-5)


def eager_rows(runner, tokens, seq_lens, tables) -> torch.Tensor:
    from infer.api.runner import StepInputs

    step = StepInputs(tokens, [1] * len(tokens), seq_lens, tables, list(range(len(tokens))), None, False)
    return runner.run(step)
