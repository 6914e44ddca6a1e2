"""Where a model's parts come from: `--model ""` is refused (it meant the current folder); dummy weights
keep the tokenizer that is on disk (a named model's, a folder's)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from infer import SamplingParams
from infer.cli.main import cli
from infer.core.errors import ModelLoadError
from infer.core.registry import PluginRegistry
from infer.llm import LLM
from infer.models.loader import resolve_source


@pytest.mark.parametrize("model", ["", "   "])
def test_an_empty_model_is_refused(model, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tiny_llama_dir)  # "" used to mean this folder
    with pytest.raises(ModelLoadError, match="--model is empty"):
        LLM(model=model, attention="torch")
    result = CliRunner().invoke(cli, ["run", "--model", model, "--attention", "torch", "--prompt", "hi"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--model is empty" in errors[0], result.output


@pytest.mark.slow
def test_dummy_weights_keep_the_tokenizer_on_disk(smollm2_dir):
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(smollm2_dir).encode("The capital of France is")
    for model in ("smollm2-135m", str(smollm2_dir)):  # a named model, a folder
        source = resolve_source(model, PluginRegistry.load(), "dummy")
        assert source.path is None and source.tokenizer_path == smollm2_dir
    with LLM(
        model="smollm2-135m",
        load_format="dummy",
        attention="torch",
        dtype="float32",
        num_kv_blocks=16,
        max_model_len=256,
    ) as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.error is None and out.prompt_token_ids == expected and len(out.outputs[0].token_ids) == 2
    result = CliRunner().invoke(
        cli,
        [
            "run",
            "--model",
            "smollm2-135m",
            "--load-format",
            "dummy",
            "--attention",
            "torch",
            "--num-kv-blocks",
            "16",
            "--max-model-len",
            "256",
            "--prompt",
            "Hello",
            "--max-tokens",
            "2",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
