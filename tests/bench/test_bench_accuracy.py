"""`infer bench accuracy`: perplexity over chitchat-dataset windows (against HF transformers' own model
on the same token ids) and greedy agreement of lossy configurations, as a table and JSON; bad options
are refused in one line naming the fix."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from click.testing import CliRunner

from infer.bench.texts import load_text_set
from infer.cli.main import cli

SIZES = ["--windows", "3", "--window-tokens", "96", "--prompts", "6", "--prompt-tokens", "12", "--max-tokens", "16"]


def invoke(*args: str):
    return CliRunner().invoke(cli, ["bench", "accuracy", *args], catch_exceptions=False)


def hf_perplexity(folder, windows: list[list[int]], dtype: torch.dtype = torch.float32) -> float:
    """HF transformers' own perplexity over the windows: each window's next-token log-likelihoods."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logprobs = model(torch.tensor([window])).logits[0].float().log_softmax(-1)
            nll -= logprobs[torch.arange(len(window) - 1), window[1:]].sum().item()
            count += len(window) - 1
    return math.exp(nll / count)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_default_lossy_configs_against_the_baseline(tiny_llama_dir, tmp_path):
    out = tmp_path / "accuracy.json"
    result = invoke("--model", str(tiny_llama_dir), *SIZES, "--json-out", str(out))
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    rows = {r["label"]: r for r in record["rows"]}
    assert list(rows) == ["baseline", "quantization=fp8", "kv_cache_dtype=fp8", "quantization=fp8,kv_cache_dtype=fp8"]
    assert rows["quantization=fp8,kv_cache_dtype=fp8"]["changes"] == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    # the tiny model has no tokenizer: the chats' UTF-8 bytes are its token ids
    text = load_text_set(None, 256, 3, 96, 6, 12)
    base = rows["baseline"]
    assert base["scored_tokens"] == 3 * 95
    assert base["perplexity"] == pytest.approx(hf_perplexity(tiny_llama_dir, text.windows), rel=1e-5)
    assert base["prefix_agreement"] == 1.0 and base["forced_agreement"] == 1.0 and base["ratio"] == 1.0
    for label in list(rows)[1:]:
        row = rows[label]
        assert row["ratio"] == pytest.approx(row["perplexity"] / base["perplexity"])
        assert row["perplexity"] != base["perplexity"]  # each is lossy: equal figures would prove nothing
        assert 0.9 < row["ratio"] < 1.1 and row["forced_agreement"] > 0.7  # measured 0.998-0.999, 90-98%
    table = result.output[result.output.index("config ") :].splitlines()
    assert table[0].split() == [
        "config",
        "perplexity",
        "ratio",
        "prefix",
        "agreement",
        "forced",
        "agreement",
        "time",
        "s",
    ]
    assert table[2].startswith("baseline ") and f"{base['perplexity']:.4f}" in table[2]
    assert "over 285 tokens (chitchat-dataset: 3 x 96 tokens" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compare", "quantization"], "--compare 'quantization': write FIELD=VALUE pairs joined by commas"),
        (["--compare", "block_size=big"], "--compare 'block_size=big': block_size takes"),
        (["--compare", "kv_cache_dtype=fp4"], "kv_cache_dtype takes one of auto, fp8, not 'fp4'"),
        (["--compare", "max_num_seqs=0"], "invalid max_num_seqs=0 (--max-num-seqs): use"),
        (["--window-tokens", "600"], "--window-tokens 600 does not fit tiny-llama"),
        (["--prompt-tokens", "500"], "--prompt-tokens 500 + --max-tokens 64 exceed tiny-llama"),
        (["--windows", "1000000"], "fewer than --windows 1000000 x --window-tokens 96: ask for fewer windows"),
    ],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bad_options_are_refused_naming_the_fix(tiny_llama_dir, args, message):
    base = ["bench", "accuracy", "--model", str(tiny_llama_dir), "--windows", "1", "--window-tokens", "96"]
    result = CliRunner().invoke(cli, [*base, *args])  # a repeated option: the last one counts
    assert result.exit_code == 2, result.output
    assert message.replace("tiny-llama", tiny_llama_dir.name) in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_without_the_text_package_the_fix_is_named(tiny_llama_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "chitchat_dataset", None)  # import fails as if it were not installed
    result = CliRunner().invoke(cli, ["bench", "accuracy", "--model", str(tiny_llama_dir), "--window-tokens", "96"])
    assert result.exit_code == 2
    assert "chitchat-dataset package, which is not installed: pip install 'infer[bench]'" in result.output


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_smollm2_perplexity_equals_hf_and_an_fp8_cache_costs_little(smollm2_dir, tmp_path):
    out = tmp_path / "accuracy.json"
    sizes = ["--windows", "2", "--window-tokens", "256", "--prompts", "4", "--prompt-tokens", "16"]
    sizes += ["--max-tokens", "16", "--compare", "kv_cache_dtype=fp8", "--json-out", str(out)]
    result = invoke("--model", str(smollm2_dir), "--dtype", "float32", *sizes)
    assert result.exit_code == 0, result.output
    base, fp8 = json.loads(out.read_text())["rows"]
    from transformers import AutoTokenizer

    text = load_text_set(AutoTokenizer.from_pretrained(smollm2_dir), 49152, 2, 256, 4, 16)
    assert base["perplexity"] == pytest.approx(hf_perplexity(smollm2_dir, text.windows), rel=1e-4)
    assert 1.0 < fp8["ratio"] < 1.05 and fp8["forced_agreement"] >= 0.85
