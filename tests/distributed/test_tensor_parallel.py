"""Tensor parallelism over torch.distributed, on the CPU (gloo, ranks spawned by the engine):
tp = N gives tp = 1's greedy tokens and (within float tolerance) its logprobs, for real and dummy
weights, with replicated KV heads, block copies and swaps; failures are clear errors, not hangs;
no rank outlives its engine."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from launchers import torchrun  # tests/, on sys.path

from infer import SamplingParams
from infer.api import BlockOps
from infer.api.errors import ConfigError, IncompatiblePluginsError, WorkerError
from infer.api.runner import StepInputs
from infer.distributed.state import ParallelState, check_tensor_parallel
from infer.distributed.step_channel import Forward, StepChannel
from infer.llm import LLM
from infer.runtime.builder import make_engine
from infer.testing.prompts import SMOLLM2_PROMPTS

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 60)), [3] * 17, [100, 7, 200, 13, 99, 42]]
LOGPROBS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)


def ranks_alive() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("infer-tp-rank")]


@pytest.fixture(autouse=True)
def no_rank_left_behind():
    yield
    deadline = time.monotonic() + 5
    while ranks_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ranks_alive(), "a tensor-parallel rank outlived its engine"
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def one_kv_head_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama's shape with a single KV head: at tp = 2 both ranks hold a copy of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-1kv")
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.num_key_value_heads = 1
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    return folder


def generate(tp: int, prompts, params, **options):
    with LLM(tensor_parallel_size=tp, **options) as llm:
        return llm.generate(prompts, params)


def assert_close_logprobs(expected, actual, atol=1e-4):
    for e, a in zip(expected, actual):
        for ec, ac in zip(e.outputs, a.outputs):
            assert ec.token_ids == ac.token_ids
            for step_e, step_a in zip(ec.logprobs, ac.logprobs):
                assert step_e.keys() == step_a.keys()
                assert max(abs(step_e[t] - step_a[t]) for t in step_e) < atol


@pytest.mark.slow
def test_smollm2_tp3_greedy_identical_to_tp1(smollm2_dir):
    # 9 query heads, 3 KV heads: each rank computes 3 query heads over its one KV head
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    options = dict(model=str(smollm2_dir), dtype="float32")
    expected = [o.outputs[0].token_ids for o in generate(1, SMOLLM2_PROMPTS, params, **options)]
    assert [o.outputs[0].token_ids for o in generate(3, SMOLLM2_PROMPTS, params, **options)] == expected


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_tiny_tp2_logprobs_match_tp1_under_swaps_and_shared_blocks(tiny_llama_dir):
    # 16 blocks of 4 tokens force preemption by swap; n=2 shares prompt blocks (copy-on-write):
    # every rank's cache must see the same block copies
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5, n=1 + i % 2) for i in range(5)]
    options = dict(
        model=str(tiny_llama_dir),
        block_size=4,
        num_kv_blocks=16,
        max_model_len=64,
        preemption_mode="swap",
        max_num_batched_tokens=64,
    )
    expected = generate(1, PROMPTS, params, **options)
    with LLM(tensor_parallel_size=2, **options) as llm:
        actual = llm.generate(PROMPTS, params)
        assert llm.engine.stats()["preemptions_swap"] > 0
    assert_close_logprobs(expected, actual)


@pytest.mark.slow
def test_replicated_kv_head_tp2_matches_tp1(one_kv_head_dir):
    options = dict(model=str(one_kv_head_dir), block_size=4)
    assert_close_logprobs(generate(1, PROMPTS, LOGPROBS, **options), generate(2, PROMPTS, LOGPROBS, **options))


@pytest.mark.slow
def test_dummy_weights_are_the_same_model_at_any_tp(tiny_llama_dir):
    options = dict(model=str(tiny_llama_dir), load_format="dummy", block_size=4, seed=3)
    assert_close_logprobs(
        generate(1, PROMPTS, LOGPROBS, **options), generate(2, PROMPTS, LOGPROBS, **options), atol=1e-5
    )


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["self", "model"])
def test_speculative_under_tp(tiny_llama_dir, draft):
    # a self-draft's runner is a model of its own (its id, its graphs) on every rank; a draft model's
    # steps and the verify step take their ids from rank 0's device (the drafts are not on the host)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    drafts = dict(self=dict(draft="self", exit_layer=2), model=dict(draft=str(tiny_llama_dir)))
    options = dict(model=str(tiny_llama_dir), block_size=4, decoding="speculative", **drafts[draft])
    expected = [o.outputs[0].token_ids for o in generate(1, PROMPTS, params, **options)]
    assert [o.outputs[0].token_ids for o in generate(2, PROMPTS, params, **options)] == expected


@pytest.mark.slow
def test_pipelined_decode_under_tp(tiny_llama_dir):
    # the forward queued ahead takes its ids from rank 0's sampled tensor: rank 1 receives them by a broadcast
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = dict(model=str(tiny_llama_dir), block_size=4)
    expected = [o.outputs[0].token_ids for o in generate(1, PROMPTS, params, pipeline_decode=False, **options)]
    with LLM(tensor_parallel_size=2, pipeline_decode=True, **options) as llm:
        actual = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.engine.decoder.runner.pipeline.hits > 0
    assert actual == expected


TORCHRUN_SCRIPT = """
import json, sys
from infer import LLM, SamplingParams
llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)  # ranks > 0 serve in here, then exit
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.close()
"""


@pytest.mark.slow
def test_ranks_started_by_torchrun(tiny_llama_dir, tmp_path):
    # every process runs the same program; rank 0 returns from LLM(...) and drives, rank 1 serves inside it
    import json

    script = tmp_path / "run_tp.py"
    script.write_text(TORCHRUN_SCRIPT)
    output = torchrun(script, [str(tiny_llama_dir), json.dumps(PROMPTS)], hosts=1, per_host=2)
    lines = [line for line in output if line.startswith("TOKENS ")]
    assert len(lines) == 1, output  # rank 0 alone prints
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in generate(1, PROMPTS, params, model=str(tiny_llama_dir), dtype="float32")
    ]
    assert json.loads(lines[0].removeprefix("TOKENS ")) == expected


@pytest.mark.slow
def test_killed_rank_is_a_clear_error_not_a_hang(tiny_llama_dir):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(model=str(tiny_llama_dir), block_size=4, tensor_parallel_size=2)
    try:
        assert len(llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 4
        (rank,) = ranks_alive()
        os.kill(rank.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1 exited with signal 9"):
            llm.generate([[1, 2, 3]], params)
        assert time.monotonic() - started < 30
        with pytest.raises(WorkerError, match="close this engine"):
            llm.generate([[1, 2, 3]], params)
    finally:
        llm.close()


@pytest.mark.slow
def test_cli_runs_with_tp(tiny_llama_dir):
    from click.testing import CliRunner

    from infer.cli.main import cli

    args = [
        "run",
        "--model",
        str(tiny_llama_dir),
        "--tp",
        "2",
        "--device",
        "cpu",
        "--dataset",
        "random-256x256",
        "--num-prompts",
        "2",
        "--max-tokens",
        "4",
        "--no-progress",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "tensor_parallel_size=2" in result.output and "tok/s" in result.output


# ------------------------------------------------------------------ refusals (no rank starts)


def test_tp_that_does_not_split_the_heads_is_refused(tiny_llama_dir, smollm2_dir):
    with pytest.raises(ConfigError, match="does not divide the 9 query heads of .*use --tp 1 or 3"):
        LLM(model=str(smollm2_dir), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="does not divide the 4 query heads"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="does not divide the 6 KV heads"):
        check_tensor_parallel("m", 12, 6, 64, 4)
    with pytest.raises(ConfigError, match="not a multiple of the 4 KV heads"):
        check_tensor_parallel("m", 12, 4, 72, 6)
    check_tensor_parallel("llama2-70b", 64, 8, 28672, 16)  # two ranks per KV head


def test_cli_refusal_exits_2(tiny_llama_dir):
    from click.testing import CliRunner

    from infer.cli.main import cli

    result = CliRunner().invoke(cli, ["run", "--model", str(tiny_llama_dir), "--tp", "3", "--device", "cpu"])
    assert result.exit_code == 2 and "does not divide the 4 query heads" in result.output


def test_tp_without_a_launcher_is_refused(tiny_llama_dir):
    from infer.api.config import EngineConfig

    with pytest.raises(ConfigError, match="--tp 2 needs a launcher .*launch=infer.distributed.launch.launch"):
        make_engine(EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=2))


def test_more_ranks_than_gpus_is_refused(tiny_llama_dir, monkeypatch):
    from infer.api.config import EngineConfig
    from infer.distributed.launch import _start_ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="--tp 2 needs 2 CUDA devices .* but 1 are visible"):
        _start_ranks(EngineConfig(tensor_parallel_size=2), [], torch.device("cuda"))


@pytest.mark.slow
def test_symmetric_memory_all_reduce_is_refused_on_the_cpu(tiny_llama_dir):
    # every rank finds it cannot run and says so before any collective set-up: a clear error, no hang
    with pytest.raises(
        ConfigError, match="--all-reduce symm-mem cannot run: it needs CUDA devices .*use --all-reduce nccl"
    ):
        LLM(model=str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, all_reduce="symm-mem")
    with pytest.raises(ConfigError, match="--all-reduce flashinfer cannot run: it needs CUDA devices"):
        LLM(model=str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, all_reduce="flashinfer")
    with LLM(model=str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, all_reduce="auto") as llm:
        assert llm.engine.parts.describe["all_reduce"].startswith("gloo")


def test_backend_without_distributed_support_is_refused(tiny_llama_dir):
    import infer
    from infer.api import Capabilities
    from infer.plugins.attention.torch_backend import TorchAttention

    class SingleRank(TorchAttention):
        capabilities = Capabilities(distributed=False)

    class Plugin:
        @infer.hookimpl
        def infer_register_attention_backends(self, register):
            register("single-rank", SingleRank)

    with pytest.raises(IncompatiblePluginsError, match="cannot run with --tp 2"):
        LLM(model=str(tiny_llama_dir), attention="single-rank", tensor_parallel_size=2, plugins=[Plugin()])


# ------------------------------------------------------------------ the step message, without processes


class Loopback:
    """A ParallelState stand-in: what rank 0 broadcasts comes back to the receiver, in order."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        if self.receiving:
            return x.copy_(self.sent.pop(0))
        self.sent.append(x.clone())
        return x


def test_step_message_round_trip():
    wire = Loopback()
    channel = StepChannel(wire)  # type: ignore[arg-type]
    step = StepInputs([7, 8, 9, 4], [3, 1], [3, 21], [[5], [1, 2]], [2, 3], 2, False)
    prefill = StepInputs(list(range(300)), [300], [300], [list(range(19))], [299], None, False)  # two broadcasts
    prefill.hidden_rows = [297, 298, 299]  # an embedding's rows: a pipeline's last stage sends them back
    ops = BlockOps(swap_out=[(1, 0)], copies=[(3, 4), (5, 6)])
    wire.receiving = False
    channel.send_forward(1, step)
    channel.send_forward(0, prefill)
    channel.send_block_ops(ops)
    channel.send_stop()
    assert len(wire.sent) == 5
    wire.receiving = True
    assert channel.receive() == Forward(1, step)
    assert channel.receive() == Forward(0, prefill)
    assert channel.receive() == ops
    assert channel.receive() is None
    assert not wire.sent
    wire.receiving = False
    pipelined = StepInputs(
        [0, 0], [1, 1], [9, 4], [[5, 6, 7], [1]], [0, 1], None, True, input_ids_t=torch.tensor([3, 4])
    )
    channel.send_forward(0, pipelined)
    wire.receiving = True
    got = channel.receive()
    assert got.ids_from_rank0 and got.step.use_graphs and got.step.input_ids_t is None
    assert (got.step.seq_lens, got.step.block_tables) == (pipelined.seq_lens, pipelined.block_tables)


def test_head_layout_replicates_kv_heads():
    layouts = [ParallelState(rank=r, world_size=4).heads(8, 2) for r in range(4)]
    assert [(h.num_heads, h.num_kv_heads, h.q_start, h.kv_start) for h in layouts] == [
        (2, 1, 0, 0),
        (2, 1, 2, 0),
        (2, 1, 4, 1),
        (2, 1, 6, 1),
    ]


class Doubling:
    """A fast all-reduce stand-in for two ranks holding the same partial sum."""

    exchange = None
    add_rms_norm = None

    def __init__(self, fused: bool) -> None:
        self.fused_calls = 0
        if fused:
            self.add_rms_norm = self._add_rms_norm

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def _add_rms_norm(self, x, residual, weight, eps):
        self.fused_calls += 1
        h = x * 2 + residual
        return weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), h


def test_reduce_add_norm_fuses_only_a_plain_rms_norm():
    from infer.distributed.layers import reduce_add_norm
    from infer.distributed.state import ParallelState
    from infer.plugins.layer.torch_layers import RMSNorm

    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    expected = norm(x * 2, residual)

    fused = Doubling(fused=True)
    got = reduce_add_norm(ParallelState(world_size=2, fast_all_reduce=fused), x, residual, norm)
    assert fused.fused_calls == 1
    torch.testing.assert_close(got, expected)

    class ScaledNorm(RMSNorm):  # another formula: must not be computed by the fused kernel
        plain_rms_norm = False

    other = ScaledNorm(8, eps=1e-5)
    got = reduce_add_norm(ParallelState(world_size=2, fast_all_reduce=fused), x, residual, other)
    assert fused.fused_calls == 1
    torch.testing.assert_close(got, other(x * 2, residual))

    plain = Doubling(fused=False)  # no fused kernel: all-reduce, then the norm adds
    torch.testing.assert_close(
        reduce_add_norm(ParallelState(world_size=2, fast_all_reduce=plain), x, residual, norm), expected
    )


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_ranks_meet_before_taking_their_groups_down():
    """NCCL's teardown is collective: each rank destroys its groups only once every rank has finished
    its collectives and arrived, and a rank that never comes is reported (False), not waited for."""
    import threading

    from infer.distributed.teardown import meet_for_teardown

    store = torch.distributed.HashStore()
    alone = ParallelState(rank=0, world_size=2, device=torch.device("cpu"), store=store)
    started = time.monotonic()
    assert meet_for_teardown(alone, wait_s=0.2) is False  # rank 1 never came
    assert time.monotonic() - started < 5

    store = torch.distributed.HashStore()
    ranks = [ParallelState(rank=r, world_size=3, device=torch.device("cpu"), store=store) for r in range(3)]
    met: dict[int, bool] = {}
    threads = [
        threading.Thread(target=lambda p=p: met.__setitem__(p.rank, meet_for_teardown(p, wait_s=30))) for p in ranks[1:]
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert not met, "a rank went on before every rank arrived"
    assert meet_for_teardown(ranks[0], wait_s=30) is True
    for t in threads:
        t.join(5)
    assert met == {1: True, 2: True}


def test_graphs_are_released_before_the_groups_go():
    """A CUDA graph that captured an NCCL collective keeps its communicator from being destroyed:
    closing releases every runner's graphs (here stand-ins, on the CPU) and steps then run eagerly."""
    from types import SimpleNamespace

    from infer.distributed.teardown import release_graphs
    from infer.runtime.cuda_graphs import CudaGraphRunner

    class Graph:
        released = 0

        def reset(self):
            Graph.released += 1

    graphs = object.__new__(CudaGraphRunner)
    graphs.graphs, graphs.pool, graphs.max_rows = {1: (Graph(), None), 2: (Graph(), None)}, object(), 2
    assert graphs.can_run(1)
    release_graphs([SimpleNamespace(graphs=graphs), SimpleNamespace(graphs=None)], torch.device("cpu"))
    assert Graph.released == 2 and graphs.graphs == {} and graphs.pool is None
    assert not graphs.can_run(1)


def test_collective_clean_ups_run_only_when_the_ranks_take_down_together():
    """Freeing shared buffers (FlashInfer's all-reduce workspace) is collective: run at a teardown every
    rank joins, skipped when a rank failed or did not come (it would wait for that rank forever)."""
    import dataclasses

    from infer.distributed.teardown import take_down_groups

    for together, runs in ((True, ["first", "second"]), (False, [])):
        ran: list[str] = []
        state = ParallelState(rank=0, world_size=2)
        state.teardown.extend([lambda: ran.append("first"), lambda: 1 / 0, lambda: ran.append("second")])
        copy = dataclasses.replace(state, fast_all_reduce=object())  # the model's copy shares the list
        take_down_groups(copy, together)
        assert ran == runs and state.teardown == []
