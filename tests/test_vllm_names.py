"""vLLM's names (`infer.api.vllm`), row by row: each that works does, as an `LLM(...)` keyword and as a flag of
`infer run` / `infer serve`, in `SamplingParams` and as an `LLM` method; each refused one is one line saying
why; docs/vllm.md lists every row. Then the frictions a vLLM user met first, each tested where it was met."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from infer import LLM, SamplingParams
from infer.api.config import EngineConfig
from infer.api.errors import ConfigError, RequestError
from infer.api.options import field_types
from infer.api.vllm import ENGINE, LLM_METHODS, SAMPLING, SERVE, Alias, Refused, engine_options
from infer.cli.main import cli
from infer.cli.options import engine_config
from infer.cli.run import run

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
if "serve" not in cli.commands:  # `infer serve` is a plugin's command, added when `infer` starts
    from infer.cli.serve import serve

    cli.add_command(serve)
DOC = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
SAMPLES = {  # a value of each string field's own kind
    "model": "llama3-8b", "tokenizer": "smollm2-135m", "revision": "v2", "dtype": "float32", "quantization": "fp8",
    "kv_cache_dtype": "fp8", "load_format": "dummy", "model_impl": "llama", "preemption_mode": "swap",
    "chat_template": "{{ messages }}", "draft": "ngram", "all_reduce": "nccl",
}  # fmt: skip


def sample(field: str):
    kind = field_types(EngineConfig)[field].base
    if field in SAMPLES:
        return SAMPLES[field]
    return {bool: False, int: 2, float: 0.5}[kind]


def cli_args(row: Alias) -> tuple[list[str], object]:
    """The flags that give vLLM's `row.vllm` a value, and the EngineConfig value they mean."""
    flag = "--" + row.vllm.replace("_", "-")
    kind = field_types(EngineConfig)[row.infer].base
    if kind is bool or row.switch:
        return [flag], row.convert(True) if row.convert else True
    value = sample(row.infer) if row.convert is None else 2**31
    return [flag, str(value)], row.convert(value) if row.convert else value


@pytest.mark.parametrize("row", [r for r in ENGINE if isinstance(r, Alias)], ids=lambda r: r.vllm)
def test_vllms_engine_options_work_as_keywords_and_flags(row):
    value = sample(row.infer) if row.convert is None else 2**31
    want = row.convert(value) if row.convert else value
    config = EngineConfig().replace(**engine_options({row.vllm: value}, FIELDS))
    assert getattr(config, row.infer) == want
    args, want = cli_args(row)
    ctx = run.make_context("run", args)
    assert getattr(engine_config({k: v for k, v in ctx.params.items() if k in FIELDS or k.startswith("vllm_")}),
                   row.infer) == want  # fmt: skip


@pytest.mark.parametrize("row", [r for r in ENGINE if isinstance(r, Refused)], ids=lambda r: r.vllm)
def test_vllms_engine_options_infer_lacks_say_why(row):
    with pytest.raises(ConfigError, match="has no equivalent here: " + row.why[:20]):
        LLM(**{row.vllm: True})
    result = CliRunner().invoke(cli, ["run", "--" + row.vllm.replace("_", "-"), "1"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: vLLM's --{row.vllm.replace('_', '-')} has no equivalent here: {row.why}"
    ]


@pytest.mark.parametrize("row", SERVE, ids=lambda r: r.vllm)
def test_vllms_serve_flags(row):
    if isinstance(row, Refused):
        result = CliRunner().invoke(cli, ["serve", "--" + row.vllm.replace("_", "-"), "x"])
        assert result.exit_code == 2 and row.why in result.output
        return
    pytest.importorskip("fastapi")
    help_text = CliRunner().invoke(cli, ["serve", "--help"]).output
    assert row.infer.split()[0] in help_text, row


def test_served_model_name_and_the_positional_model():
    pytest.importorskip("fastapi")
    # MODEL and --model: two models, which one --served-model-name cannot name (refused before any loads)
    result = CliRunner().invoke(cli, ["serve", "smollm2-135m", "--model", "llama3-8b", "--served-model-name", "x"])
    assert result.exit_code == 2 and "names one model and 2 are served" in result.output


@pytest.mark.parametrize("row", SAMPLING, ids=lambda r: r.vllm)
def test_vllms_sampling_params(row):
    values = {"stop": ["x"], "stop_token_ids": [3], "logit_bias": {5: 1.0}, "allowed_token_ids": [1, 2], "bad_words": ["no"],
              "structured_outputs": {"choice": ["a", "b"]}, "seed": 7, "truncate_prompt_tokens": 8, "best_of": 1,
              "logprobs": 2, "prompt_logprobs": 1, "min_tokens": 2, "skip_special_tokens": True,
              "include_stop_str_in_output": True, "detokenize": True, "n": 1, "max_tokens": 4, "top_k": 5, "ignore_eos": True}  # fmt: skip
    if isinstance(row, Alias):
        value = values.get(row.vllm, 0.5)
        params = SamplingParams(**{row.vllm: value})
        if row.vllm == "structured_outputs":
            assert params.structured is not None and params.structured.choice == ["a", "b"]
        else:
            assert getattr(params, row.vllm) in (value, [value] if isinstance(value, str) else value)
        return
    with pytest.raises(RequestError, match=f"vLLM's {row.vllm} has no equivalent here"):
        SamplingParams(**{row.vllm: object()})


@pytest.mark.parametrize("row", LLM_METHODS, ids=lambda r: r.vllm)
def test_vllms_llm_methods(row):
    llm = LLM.__new__(LLM)  # the class's methods: no engine needed
    if isinstance(row, Alias):
        assert callable(getattr(llm, row.vllm))
        return
    with pytest.raises(AttributeError, match=f"vLLM's LLM.{row.vllm} has no equivalent here"):
        getattr(llm, row.vllm)


def test_the_page_lists_every_row():
    for row in (*ENGINE, *SERVE, *SAMPLING, *LLM_METHODS):
        assert f"`{row.vllm}" in DOC or f"--{row.vllm.replace('_', '-')}" in DOC or f"LLM.{row.vllm}" in DOC, row


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_sampling_outputs_as_vllm_gives_them(smollm2_dir):
    with LLM(model=str(smollm2_dir), attention="torch", max_model_len=256) as llm:
        prompt = "The capital of France is"
        greedy = dict(max_tokens=12, temperature=0)
        cut, kept = llm.generate(
            [prompt] * 2,
            [SamplingParams(**greedy, stop=["Paris"]), SamplingParams(**greedy, stop=["Paris"], include_stop_str_in_output=True)],
        )  # fmt: skip
        assert "Paris" not in cut.outputs[0].text and kept.outputs[0].text == cut.outputs[0].text + "Paris"
        ids_only = llm.generate([prompt], SamplingParams(**greedy, detokenize=False))[0].outputs[0]
        full = llm.generate([prompt], SamplingParams(**greedy))[0].outputs[0]
        assert ids_only.text == "" and ids_only.token_ids == full.token_ids
        short = llm.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=2), use_tqdm=True)[0]
        assert short.prompt_token_ids == llm.get_tokenizer().encode(prompt)[-2:]
        assert llm.get_tokenizer() is llm.tokenizer
    with pytest.raises(RequestError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens=False)
    with pytest.raises(RequestError, match="stop strings are found in the text"):
        SamplingParams(detokenize=False, stop=["x"])


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_python_dash_m_infer_and_infer_serve_are_the_commands():
    for module, words in (("infer", "Usage: infer [OPTIONS] COMMAND"), ("infer.serve", "serve [OPTIONS] [MODEL]")):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and words in done.stdout, (module, done.stdout[:300], done.stderr[-300:])
