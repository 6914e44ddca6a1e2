"""The CLI, through click's CliRunner: happy paths and every bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from infer.cli.main import cli


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def tiny_args(folder) -> list[str]:
    return ["run", "--model", str(folder), "--no-progress", "--show", "1"]


def test_run_prints_table_and_writes_json(tiny_llama_dir, tmp_path):
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([[5, 6, 7], {"prompt": [9, 10, 11, 12], "max_tokens": 3}]))
    out = tmp_path / "run.json"
    result = invoke(
        *tiny_args(tiny_llama_dir),
        "--dataset",
        str(data),
        "--max-tokens",
        "5",
        "--baseline",
        "scheduler=static,sampler=naive",
        "--json-out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert "req/s" in result.output and "speedup" in result.output
    records = json.loads(out.read_text())["records"]
    assert [r["label"] for r in records] == ["baseline: scheduler=static,sampler=naive", "infer"]
    assert all(r["output_tokens"] == 10 and r["prompt_tokens"] == 7 for r in records)
    assert records[1]["speedup"] > 0


def test_plugins_lists_every_slot():
    result = invoke("plugins")
    assert result.exit_code == 0
    for slot, name in [
        ("attention", "torch"),
        ("scheduler", "fcfs"),
        ("scheduler", "static"),
        ("sampler", "naive"),
        ("sampler", "vectorized"),
        ("detokenizer", "parallel"),
        ("kv_allocator", "paged"),
        ("model", "llama"),
    ]:
        assert any(line.split()[:2] == [slot, name] for line in result.output.splitlines()), (slot, name)


def test_models_lists_named_shapes():
    result = invoke("models")
    assert result.exit_code == 0
    for name in ["llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "smollm2-135m"]:
        assert name in result.output


def _corrupt_copy(src, tmp_path):
    dst = tmp_path / "corrupt"
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return dst


BAD_INPUTS = {
    "empty prompt": (["--prompt", ""], "empty prompt"),
    "max tokens 0": (["--max-tokens", "0"], "--max-tokens"),
    "top-p 1.5": (["--top-p", "1.5"], "--top-p"),
    "negative temperature": (["--temperature", "-0.5"], "--temperature"),
    "unknown plugin": (["--scheduler", "lifo"], "valid names are"),
    "impossible combination": (["--attention", "torch", "--prefill-attention", "nope"], "valid names are"),
    "CUDA-only backend on the CPU": (["--device", "cpu", "--attention", "paged-cuda"], "runs only on cuda"),
    "block size": (["--block-size", "12"], "power of two"),
    "context too long": (["--max-model-len", "8", "--dataset", "{long}"], "shorten"),
    "malformed dataset": (["--dataset", "{bad}"], "not valid JSON"),
    "missing dataset": (["--dataset", "nope.jsonl"], "cannot read"),
    "missing model folder": (["--model", "./no/such/folder"], "does not exist"),
    "corrupt safetensors": (["--model", "{corrupt}"], "corrupt weight file"),
    "unknown model": (["--model", "llama9-1b"], "unknown model"),
    "no weights for a shape": (["--model", "llama2-7b"], "--load-format dummy"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, tiny_llama_dir, tmp_path):
    extra, expected = BAD_INPUTS[case]
    long = tmp_path / "long.json"
    long.write_text(json.dumps([list(range(3, 40))]))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": "hi",]')
    subs = {"{long}": str(long), "{bad}": str(bad)}
    if "{corrupt}" in extra:
        subs["{corrupt}"] = str(_corrupt_copy(tiny_llama_dir, tmp_path))
    extra = [subs.get(a, a) for a in extra]
    args = tiny_args(tiny_llama_dir) + extra
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], result.output


def test_every_engine_config_field_is_an_option_with_help():
    import dataclasses

    from infer.api.config import EngineConfig
    from infer.cli.options import HELP

    assert set(HELP) == {f.name for f in dataclasses.fields(EngineConfig)}
    params = {p.name: p for p in cli.commands["run"].params}
    for f in dataclasses.fields(EngineConfig):
        assert params[f.name].default == f.default, f.name
