"""Speculative decoding on CUDA graphs: the verify step (a request's new token and draft as decode
rows) and the proposers' steps replay captured graphs, and greedy output is the same with graphs as
without, and autoregressive's (paged-cuda, fp32, tiny real-weight Llamas). The draft model's steps
are queued without waiting for their tokens: a draft equal to the target must still be accepted
every time (a staging buffer refilled too early would feed it wrong tokens, and only acceptance
would show it: the output stays lossless either way)."""

from __future__ import annotations

from collections import Counter

import pytest

from infer import SamplingParams
from infer.llm import LLM
from infer.testing.decoder import write_tiny_llamas

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8] * 4, [10, 11], list(range(20, 60)), [3] * 17, [100, 7, 200, 13, 99, 42], [7, 8] * 5]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (32, 5, 32, 17, 32, 2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llamas(tmp_path_factory.mktemp("spec-graphs-gpu"))


def generate(target, cuda_graphs: bool, **options):
    """Tokens, the engine's stats, and per runner the forwards it replayed (True) and ran eagerly (False)."""
    options = dict(device="cuda", dtype="float32", attention="paged-cuda", cuda_graphs=cuda_graphs, **options)
    with LLM(model=str(target), **options) as llm:
        seen = [record(runner) for runner in llm.engine.parts.runners]
        outs = llm.generate(PROMPTS, PARAMS)
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats(), seen


def record(runner) -> dict[bool, list[tuple[bool, int]]]:
    """Each forward as (decode-only, most rows one request had: > 1 in a verify step of decode rows)."""
    seen: dict[bool, list[tuple[bool, int]]] = {True: [], False: []}
    run = runner.run

    def run_and_record(step):
        decode_only = all(q == 1 for q in step.query_lens)
        seen[step.use_graphs].append((decode_only, max(Counter(map(id, step.block_tables)).values())))
        return run(step)

    runner.run = run_and_record
    return seen


@pytest.fixture(scope="module")
def expected(tiny):
    return generate(tiny[0], cuda_graphs=False)[0]


@pytest.mark.parametrize("draft", ["ngram", "self", "model"])
def test_graphs_change_no_token_and_verify_steps_replay(tiny, expected, draft):
    target, draft_dir = tiny
    options = {
        "ngram": dict(draft="ngram"),
        "self": dict(draft="self", exit_layer=1),
        "model": dict(draft=str(draft_dir)),
    }
    options = dict(decoding="speculative", **options[draft])
    eager, _, _ = generate(target, cuda_graphs=False, **options)
    graphed, stats, seen = generate(target, cuda_graphs=True, **options)
    assert eager == expected and graphed == expected
    assert stats["spec_proposed"] > 0
    assert any(per_request > 1 for _, per_request in seen[0][True]), "no verify step replayed a graph"
    eager = [per_request for decode_only, per_request in seen[0][False] if decode_only]
    assert not any(n > 1 for n in eager), "a decode-only verify step ran eagerly"
    if draft != "ngram":
        assert seen[1][True], "the draft's steps never replayed a graph"


def test_a_draft_equal_to_the_target_is_always_accepted_on_graphs(tiny, expected):
    target, _ = tiny
    got, stats, seen = generate(target, cuda_graphs=True, decoding="speculative", draft=str(target))
    assert got == expected
    assert stats["acceptance_rate"] > 0.97, stats
    assert seen[1][True], "the draft's steps never replayed a graph"
