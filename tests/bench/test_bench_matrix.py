"""`infer bench --matrix`: every valid combination in one process beside an HF baseline; skipped
combinations listed with the reason; table, JSON and PNG."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from infer.bench import charts
from infer.cli.main import cli


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([[5, 6, 7], [9, 10, 11, 12], [40, 41]]))
    return path


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bench_matrix_with_baseline_json_and_chart(tiny_llama_dir, dataset, tmp_path):
    out, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    result = invoke(
        "bench",
        "--model",
        str(tiny_llama_dir),
        "--matrix",
        "sampler=naive,vectorized",
        "scheduler=static,fcfs",
        "attention=torch,xformers",
        "--baseline",
        "hf-static-1",
        "--dataset",
        str(dataset),
        "--max-tokens",
        "4",
        "--json-out",
        str(out),
        "--chart",
        str(chart),
    )
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    labels = [r["label"] for r in record["runs"]]
    assert labels == [
        f"sampler={s},scheduler={c},attention=torch" for s in ("naive", "vectorized") for c in ("static", "fcfs")
    ] + ["hf-static-1"]
    assert all(r["output_tokens"] == 12 for r in record["runs"])  # EOS ignored: every run computes the same tokens
    assert record["speedup_against"] == "hf-static-1" and record["runs"][-1]["speedup"] == pytest.approx(1.0)
    assert len(record["skipped"]) == 4 and all("serves only prefill" in s["reason"] for s in record["skipped"])
    assert (
        "skipped sampler=naive,scheduler=static,attention=xformers: --attention xformers serves only prefill"
        in result.output
    )
    assert "speedup: total tokens/s against hf-static-1" in result.output
    if charts._pyplot() is None:
        assert result.output.splitlines()[-1] == charts.MISSING
    else:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bench_without_baseline_compares_with_the_first_combination(tiny_llama_dir, dataset, monkeypatch):
    monkeypatch.setattr(charts, "_pyplot", lambda: None)  # as if matplotlib were missing
    result = invoke(
        "bench",
        "--model",
        str(tiny_llama_dir),
        "--matrix",
        "sampler=naive,vectorized",
        "--dataset",
        str(dataset),
        "--max-tokens",
        "2",
        "--chart",
        "unused.png",
    )
    assert result.exit_code == 0, result.output
    assert "speedup: total tokens/s against sampler=naive" in result.output
    assert "1.00x" in result.output.splitlines()[-4]
    assert result.output.splitlines()[-1] == charts.MISSING


@pytest.mark.parametrize(
    "args,message",
    [
        (["--matrix", "colour=red"], "unknown engine option(s) colour: valid options are"),
        (["--matrix", "sampler=naive", "--baseline", "hf-dynamic"], "unknown --baseline hf-dynamic"),
        (["--matrix", "attention=xformers"], "no combination of --matrix runs here"),
    ],
)
def test_bench_user_errors(tiny_llama_dir, args, message):
    result = CliRunner().invoke(cli, ["bench", "--model", str(tiny_llama_dir), *args])
    assert result.exit_code == 2 and message in result.output
