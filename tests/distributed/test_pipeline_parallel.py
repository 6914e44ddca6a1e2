"""Pipeline parallelism over torch.distributed, on the CPU (gloo, stages spawned by the engine): pp = N
gives tp = 1's greedy tokens and (within float tolerance) its logprobs, prompt logprobs and embeddings,
with prompts cut between micro-batches, block copies and swaps, a draft model and dummy weights; what
stages cannot run is refused before anything starts. (The model kit runs every family at pp 2 against
HF transformers: `infer.testing.model.SETTINGS`.)"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from launchers import torchrun  # tests/, on sys.path

from infer import SamplingParams
from infer.api import PipelineStage
from infer.api.config import EngineConfig
from infer.api.errors import ConfigError
from infer.api.pooling import PoolingParams
from infer.api.runner import StepInputs
from infer.llm import LLM
from infer.runtime.builder import make_engine
from infer.runtime.runner import micro_batches
from infer.testing.prompts import SMOLLM2_PROMPTS

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 60)), [3] * 17, [100, 7, 200, 13, 99, 42]]


def ranks_alive() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("infer-tp-rank")]


@pytest.fixture(autouse=True)
def no_rank_left_behind():
    yield
    deadline = time.monotonic() + 5
    while ranks_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ranks_alive(), "a pipeline stage outlived its engine"
    assert not torch.distributed.is_initialized()


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_close_logprobs(expected, actual, atol=1e-4):
    for e, a in zip(expected, actual):
        for ec, ac in zip(e.outputs, a.outputs):
            assert ec.token_ids == ac.token_ids
            for step_e, step_a in zip(ec.logprobs, ac.logprobs):
                assert step_e.keys() == step_a.keys()
                assert max(abs(step_e[t] - step_a[t]) for t in step_e) < atol


# ------------------------------------------------------------------ micro-batches (no process starts)


def test_micro_batches_cut_the_tokens_evenly_and_keep_every_row():
    # two decodes, a 7-token prompt chunk starting at position 5 (logits on its last), a 3-token one (none)
    step = StepInputs(
        input_ids=[1, 2, *range(10, 17), 20, 21, 22],
        query_lens=[1, 1, 7, 3],
        seq_lens=[9, 4, 12, 3],
        block_tables=[[0, 1], [2], [3, 4, 5], [6]],
        logits_rows=[0, 1, 8],
        num_layers=None,
        use_graphs=False,
        hidden_rows=[10, 11],
    )
    parts = micro_batches(step, 3)
    assert [len(p.input_ids) for p in parts] == [4, 4, 4]
    assert [p.input_ids for p in parts] == [[1, 2, 10, 11], [12, 13, 14, 15], [16, 20, 21, 22]]
    # the prompt is three chunks: positions 5-6, 7-10, 11; each chunk's sequence ends where it ends
    assert [p.query_lens for p in parts] == [[1, 1, 2], [4], [1, 3]]
    assert [p.seq_lens for p in parts] == [[9, 4, 7], [11], [12, 3]]
    assert [p.block_tables for p in parts] == [[[0, 1], [2], [3, 4, 5]], [[3, 4, 5]], [[3, 4, 5], [6]]]
    assert [p.logits_rows for p in parts] == [[0, 1], [], [0]]
    assert [p.hidden_rows for p in parts] == [[], [], [2, 3]]
    # more micro-batches than tokens: one token each
    assert [p.query_lens for p in micro_batches(step, 99)][:3] == [[1], [1], [1]]
    assert len(micro_batches(step, 99)) == 12
    assert [p.seq_lens for p in micro_batches(step, 1)] == [step.seq_lens]


def test_stages_split_the_layers_contiguously():
    stages = [PipelineStage.split(30, 4, i) for i in range(4)]
    assert [(s.start, s.end) for s in stages] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stages[0].is_first and stages[-1].is_last and not stages[1].is_first and not stages[1].is_last
    assert 7 in stages[0] and 8 not in stages[0] and 8 in stages[1]


# ------------------------------------------------------------------ pp > 1 against tp 1


@pytest.mark.slow
def test_smollm2_pp2_greedy_identical_to_tp1(smollm2_dir):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    options = dict(model=str(smollm2_dir), dtype="float32")
    with LLM(**options) as llm:
        expected = tokens(llm.generate(SMOLLM2_PROMPTS, params))
    with LLM(pipeline_parallel_size=2, **options) as llm:
        assert llm.engine.parts.describe["pipeline_parallel_size"] == 2
        assert tokens(llm.generate(SMOLLM2_PROMPTS, params)) == expected


@pytest.mark.slow
def test_tiny_pp3_matches_tp1_under_swaps_shared_blocks_prompt_logprobs_and_embeddings(tiny_llama_dir):
    # one layer a stage; 16 blocks of 4 tokens force preemption by swap; n=2 shares prompt blocks
    # (copy-on-write): every stage's cache must see the same block copies. 4 micro-batches a step cut
    # the 40-token prompt; its prompt logprobs and an embedding come back from the last stage.
    params = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5, n=1 + i % 2, prompt_logprobs=2)
        for i in range(5)
    ]
    options = dict(
        model=str(tiny_llama_dir),
        block_size=4,
        num_kv_blocks=16,
        max_model_len=64,
        preemption_mode="swap",
        max_num_batched_tokens=64,
    )
    pooling = PoolingParams("mean", normalize=False)
    with LLM(**options) as llm:
        expected = llm.generate(PROMPTS, params)
        expected_embedding = llm.embed([PROMPTS[2]], pooling)[0].outputs.embedding
    with LLM(pipeline_parallel_size=3, pipeline_micro_batches=4, **options) as llm:
        actual = llm.generate(PROMPTS, params)
        assert llm.engine.stats()["preemptions_swap"] > 0
        embedding = llm.embed([PROMPTS[2]], pooling)[0].outputs.embedding
    assert_close_logprobs(expected, actual)
    for e, a in zip(expected, actual):
        for step_e, step_a in zip(e.prompt_logprobs[1:], a.prompt_logprobs[1:]):
            assert step_e.keys() == step_a.keys()
            assert max(abs(step_e[t] - step_a[t]) for t in step_e) < 1e-4
    torch.testing.assert_close(torch.tensor(embedding), torch.tensor(expected_embedding), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tp2_pp2_matches_tp1(tiny_llama_dir):
    # four processes: two stages (layers 0-1, then 2) of two tensor-parallel ranks each; rank i of a stage
    # hands its activations to rank i of the next, and the last stage's rank 0 alone returns the logits
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    options = dict(model=str(tiny_llama_dir), block_size=4, max_num_batched_tokens=16)
    with LLM(**options) as llm:
        expected = llm.generate(PROMPTS, params)
    with LLM(tensor_parallel_size=2, pipeline_parallel_size=2, **options) as llm:
        describe = llm.engine.parts.describe
        assert (describe["tensor_parallel_size"], describe["pipeline_parallel_size"]) == (2, 2)
        actual = llm.generate(PROMPTS, params)
    assert_close_logprobs(expected, actual)


TORCHRUN_SCRIPT = """
import json, sys
from infer import LLM, SamplingParams
llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.close()
"""


@pytest.mark.slow
def test_two_hosts_by_torchrun_each_a_stage_of_two_ranks(tiny_llama_dir, tmp_path):
    # two torchrun launches on loopback, as two hosts would start them: host i runs stage i's two ranks
    import json

    script = tmp_path / "run_pp.py"
    script.write_text(TORCHRUN_SCRIPT)
    output = torchrun(script, [str(tiny_llama_dir), json.dumps(PROMPTS)], hosts=2, per_host=2)
    lines = [line for line in output if line.startswith("TOKENS ")]
    assert len(lines) == 1, output  # process 0 alone prints
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(model=str(tiny_llama_dir), dtype="float32") as llm:
        expected = tokens(llm.generate(PROMPTS, params))
    assert json.loads(lines[0].removeprefix("TOKENS ")) == expected


@pytest.mark.slow
def test_speculative_with_a_draft_model_and_dummy_weights_under_pp(tiny_llama_dir):
    # the draft model is split over the stages too; dummy weights are the same model on any stage
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = dict(model=str(tiny_llama_dir), load_format="dummy", seed=3, block_size=4)
    with LLM(**options) as llm:
        expected = tokens(llm.generate(PROMPTS, params))
    speculative = dict(decoding="speculative", draft=str(tiny_llama_dir), num_speculative_tokens=3)
    with LLM(pipeline_parallel_size=2, **speculative, **options) as llm:
        assert tokens(llm.generate(PROMPTS, params)) == expected
        assert llm.engine.stats()["acceptance_rate"] > 0  # the draft is the same model: it proposed and was kept


@pytest.mark.slow
def test_killed_stage_is_a_clear_error_not_a_hang(tiny_llama_dir):
    import os
    import signal

    from infer.api.errors import WorkerError

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(model=str(tiny_llama_dir), block_size=4, pipeline_parallel_size=2)
    try:
        assert len(llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 4
        (stage,) = ranks_alive()
        os.kill(stage.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerError, match="pipeline-parallel rank 1 exited with signal 9"):
            llm.generate([[1, 2, 3]], params)
        assert time.monotonic() - started < 30
    finally:
        llm.close()


@pytest.mark.slow
def test_cli_runs_with_pp(tiny_llama_dir):
    from click.testing import CliRunner

    from infer.cli.main import cli

    args = ["run", "--model", str(tiny_llama_dir), "--pp", "3", "--device", "cpu", "--dataset", "random-256x256"]
    result = CliRunner().invoke(cli, [*args, "--num-prompts", "2", "--max-tokens", "4", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "pipeline_parallel_size=3" in result.output and "tok/s" in result.output


# ------------------------------------------------------------------ refusals (no process starts)


def test_what_stages_cannot_run_is_refused_before_anything_starts(tiny_llama_dir):
    model = str(tiny_llama_dir)
    with pytest.raises(ConfigError, match="--pp 4 splits the 3 layers of .*use --pp 3 or fewer"):
        LLM(model=model, pipeline_parallel_size=4)
    with pytest.raises(ConfigError, match="does not divide the 4 query heads"):
        LLM(model=model, pipeline_parallel_size=2, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="--exit-layer with --pp 2"):
        LLM(model=model, pipeline_parallel_size=2, decoding="speculative", draft="self", exit_layer=1)
    with pytest.raises(ConfigError, match="--enable-lora with --pp 2"):
        LLM(model=model, pipeline_parallel_size=2, enable_lora=True)
    with pytest.raises(ConfigError, match="--pp 2 needs a launcher"):
        make_engine(EngineConfig(model=model, pipeline_parallel_size=2))
    assert not ranks_alive()


def test_cli_pp_refusal_exits_2(tiny_llama_dir):
    from click.testing import CliRunner

    from infer.cli.main import cli

    result = CliRunner().invoke(cli, ["run", "--model", str(tiny_llama_dir), "--pp", "5", "--device", "cpu"])
    assert result.exit_code == 2 and "--pp 5 splits the 3 layers" in result.output
