"""Where a model's parts come from: `--model ""` is refused (it meant the current folder); dummy weights
keep the tokenizer that is on disk (a named model's, a folder's); `--model-impl` names the model plugin
that runs a checkpoint when several claim its architecture."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import infer
from infer import SamplingParams
from infer.api.errors import ModelLoadError, PluginNotFoundError
from infer.cli.main import cli
from infer.core.registry import PluginRegistry
from infer.llm import LLM
from infer.loading.loader import resolve_source
from infer.plugins.model.llama import Llama


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


class SecondLlama(Llama):
    """Another plugin claiming LlamaForCausalLM, registered after the built-in one."""


class OtherArchitecture(Llama):
    hf_architectures = ("OtherForCausalLM",)
    presets: dict = {}


class TwoModels:
    @staticmethod
    @infer.hookimpl
    def infer_register_models(register):
        register("second-llama", SecondLlama)
        register("other-architecture", OtherArchitecture)


def test_model_impl_picks_the_plugin_that_runs_the_checkpoint(tiny_llama_dir):
    def model_of(**options):
        with LLM(model=str(tiny_llama_dir), plugins=[TwoModels], **options) as llm:
            return llm.engine.parts.runners[0].model

    assert type(model_of()) is Llama  # auto: the first plugin that claims the architecture
    assert type(model_of(model_impl="second-llama")) is SecondLlama
    with pytest.raises(
        PluginNotFoundError,
        match=r"--model-impl other-architecture does not claim architecture 'LlamaForCausalLM': use auto or llama or "
        r"second-llama$",
    ):
        LLM(model=str(tiny_llama_dir), plugins=[TwoModels], model_impl="other-architecture")
