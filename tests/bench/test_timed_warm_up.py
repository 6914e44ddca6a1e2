"""The warm-up before a timed run (issue 48): the measured run's shapes on prompts of its own, so that kernels
compile outside the timed part while the prefix cache and the counters stay as a cold engine's would."""

from __future__ import annotations

import json

from click.testing import CliRunner

from infer import LLM, SamplingParams
from infer.bench.report import prepare_prompts, run_workload, warm_up_shaped
from infer.bench.workloads import Workload
from infer.cli.main import cli


def _shared_prefix_workload() -> Workload:
    """Prompts that share a 32-token prefix: the measured run's own prefix-cache hits are part of its figures."""
    head = list(range(100, 132))
    prompts: list[str | list[int]] = [head + [200 + i] * (8 + i) for i in range(6)]
    return Workload("shared", prompts, [5] * 6, ignore_eos=True)


def test_the_warm_up_leaves_the_measured_run_as_a_cold_engine_runs_it(tiny_llama_dir):
    # two at a time: the later prompts find the earlier ones' shared prefix in the cache
    kwargs = dict(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=128, max_num_seqs=2)
    params = SamplingParams(temperature=0)
    workload = _shared_prefix_workload()
    with LLM(**kwargs) as llm:
        cold, cold_out = run_workload(llm.engine, workload, params, "cold")
    with LLM(**kwargs) as llm:
        seen: list[list[int]] = []
        original = llm.engine.add_request

        def spy(prompt, p=None, *args, **kw):
            seen.append(list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else prompt)
            return original(prompt, p, *args, **kw)

        llm.engine.add_request = spy
        seconds, count = warm_up_shaped(llm.engine, workload, params, num_prompts=4)
        warm_prompts = list(seen)
        llm.engine.add_request = original
        warm, warm_out = run_workload(llm.engine, workload, params, "warm")
        measured = prepare_prompts(llm.engine, workload)
    assert count == 4 and seconds > 0
    # the first four prompts' lengths, none of their tokens' runs: no measured prompt enters the cache
    assert [len(p) for p in warm_prompts] == [len(p) for p in measured[:4]]
    assert all(w[:16] != m[:16] for w in warm_prompts for m in measured)
    # the measured run: the same hits as on a cold engine, counters from zero, the same tokens
    assert warm.prefix_hit_rate == cold.prefix_hit_rate > 0
    assert warm.steps == cold.steps and warm.prompt_tokens == cold.prompt_tokens
    assert [o.outputs[0].token_ids for o in warm_out] == [o.outputs[0].token_ids for o in cold_out]


def test_infer_run_reports_its_build_and_warm_up(tiny_chat_dir, tmp_path):
    out = tmp_path / "run.json"
    args = ["run", "--model", str(tiny_chat_dir), "--num-prompts", "4", "--max-tokens", "6", "--show", "0"]
    result = CliRunner().invoke(cli, [*args, "--no-progress", "--warm-up", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())["records"][0]
    assert record["build_s"] > 0 and record["warm_up_s"] > 0
    phases = record["build_phases"]  # the build by phase, inside its total
    assert list(phases) == ["checks", "load", "kv_cache", "wiring"] and all(v >= 0 for v in phases.values())
    assert phases["load"] > 0 and sum(phases.values()) <= record["build_s"]
    assert record["num_requests"] == 4  # the warm-up's requests are not counted
    result = CliRunner().invoke(cli, [*args, "--no-progress", "--json-out", str(out)])  # on the CPU: none by default
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["records"][0]["warm_up_s"] is None
