"""`infer run --profile`: per-component decode-step times; nothing installed when profiling is off."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.bench import charts
from infer.bench.profiler import StepProfiler, format_profile
from infer.cli.main import cli
from infer.runtime.builder import make_engine


def hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_nothing_is_wrapped_unless_profiling_and_the_rows_add_up(tiny_llama_dir):
    engine = make_engine(EngineConfig(model=str(tiny_llama_dir), device="cpu"))
    runner = engine.decoder.runner
    try:
        assert (
            hooks(runner.model) == 0
            and "step_outputs" not in vars(engine)
            and "compute_logits" not in vars(runner.model)
        )
        scheduler, sampler = engine.scheduler, runner.sampler
        profiler = StepProfiler.install(engine)
        assert hooks(runner.model) == 2 * (1 + 3 + 1)  # embedding, 3 layers, final norm: pre and post
        assert engine.scheduler._inner is scheduler and runner.sampler._inner is sampler
        outs = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
        assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    finally:
        engine.close()
    summary = profiler.summary()
    assert summary["decode_steps"] == 5 and summary["other_steps"] == 1  # one prefill, then five decodes
    names = [name for name, _ in summary["rows"]]
    assert names == [
        "embedding",
        "layer 0 attention",
        "layer 0 rest",
        "layer 1 attention",
        "layer 1 rest",
        "layer 2 attention",
        "layer 2 rest",
        "final norm + LM head",
        "sampler",
        "detokenizer",
        "scheduler",
        "other host work",
    ]
    assert all(t >= 0 for _, t in summary["rows"]) and summary["attention_s"] > 0
    assert sum(t for _, t in summary["rows"]) == pytest.approx(summary["step_s"], rel=1e-6)
    assert 0 <= summary["device_idle_share"] < 1
    assert "timed with perf_counter on the CPU" in format_profile(summary)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_run_profile_on_smollm2_dummy_weights(tmp_path):
    data, chart, out = tmp_path / "p.json", tmp_path / "profile.png", tmp_path / "run.json"
    data.write_text(json.dumps([[5, 6, 7, 8], [9, 10]]))
    result = CliRunner().invoke(
        cli,
        [
            "run",
            "--model",
            "smollm2-135m",
            "--load-format",
            "dummy",
            "--dataset",
            str(data),
            "--max-tokens",
            "3",
            "--no-progress",
            "--profile-chart",
            str(chart),
            "--json-out",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    text = result.output
    assert "profile: 2 decode steps (prefill and mixed steps left out: 1), timed with perf_counter on the CPU" in text
    for row in (
        "embedding",
        "layers: attention (all)",
        "layer 0 attention",
        "layer 29 rest",
        "final norm + LM head",
        "sampler",
        "detokenizer",
        "scheduler",
        "other host work",
        "decode step (wall)",
        "device idle",
    ):
        assert any(line.startswith(row) for line in text.splitlines()), row
    if charts._pyplot() is None:
        assert charts.MISSING in text
    else:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text())["profile"]["decode_steps"] == 2
