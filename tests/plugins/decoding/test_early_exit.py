"""`early-exit`: lossy by design, so it must say so; with every layer kept it is `autoregressive`."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from infer import SamplingParams
from infer.api.errors import ConfigError, IncompatiblePluginsError
from infer.cli.main import cli
from infer.core.registry import PluginRegistry
from infer.llm import LLM

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 60)), [3] * 17]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return [o.outputs[0].token_ids for o in LLM(model=str(tiny_llama_dir), block_size=4).generate(PROMPTS, PARAMS)]


def test_all_layers_kept_equals_autoregressive(tiny_llama_dir, expected):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, decoding="early-exit", exit_layer=3)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert llm.engine.parts.describe["lossy"] == "early exit keeps 3/3 layers"


def test_fewer_layers_run_keep_a_smaller_cache_and_report_the_cut(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, decoding="early-exit", exit_layer=1)
    outs = llm.generate(PROMPTS, PARAMS)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert llm.engine.parts.describe["lossy"] == "early exit keeps 1/3 layers"
    assert len(llm.engine.decoder.runner.kv_caches) == 1  # only the layers that run hold KV


def test_exit_layer_without_a_decoder_that_uses_it_is_refused(tiny_llama_dir):
    with pytest.raises(IncompatiblePluginsError, match="--exit-layer 1 does nothing with --decoding autoregressive"):
        LLM(model=str(tiny_llama_dir), block_size=4, exit_layer=1)


def test_early_exit_needs_an_exit_layer_in_range(tiny_llama_dir):
    with pytest.raises(ConfigError, match="--exit-layer N"):
        LLM(model=str(tiny_llama_dir), decoding="early-exit")
    with pytest.raises(ConfigError, match=r"\[1, 3\]"):
        LLM(model=str(tiny_llama_dir), decoding="early-exit", exit_layer=4)


def test_capabilities_say_it_changes_outputs():
    registry = PluginRegistry.load()
    assert "lossy (changes outputs)" in registry.get("decoding", "early-exit").capabilities.describe()
    assert "needs-draft" in registry.get("decoding", "speculative").capabilities.describe()
    assert "lossy" not in registry.get("decoding", "speculative").capabilities.describe()


def test_run_report_shows_the_layers_kept_and_speculation_figures(tiny_llama_dir):
    args = [
        "run",
        "--model",
        str(tiny_llama_dir),
        "--no-progress",
        "--show",
        "0",
        "--dataset",
        "random-256x256",
        "--num-prompts",
        "2",
        "--max-tokens",
        "6",
        "--block-size",
        "4",
    ]
    lossy = CliRunner().invoke(cli, args + ["--decoding", "early-exit", "--exit-layer", "2"], catch_exceptions=False)
    assert lossy.exit_code == 0, lossy.output
    assert "lossy: early exit keeps 2/3 layers" in lossy.output
    spec = CliRunner().invoke(
        cli, args + ["--decoding", "speculative", "--draft", "self", "--exit-layer", "2"], catch_exceptions=False
    )
    assert spec.exit_code == 0, spec.output
    assert "lossy" not in spec.output and "speculative: acceptance" in spec.output
