"""The speculative-decoding driver's parts that need no GPU: agreement with a reference, the edit
workload, and a reference made for other prompts refused with the fix."""

from __future__ import annotations

import json

import pytest

from benchmarks.lab import speculative
from infer.bench.workloads import EDIT_PROMPTS, load_workload


def test_agreement_counts_identical_outputs_and_the_tokens_before_the_first_difference():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    got = speculative.agreement([[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]], ref)
    assert got["identical"] == "1/3"
    assert got["followed"] == pytest.approx((4 + 2 + 0) / 10)
    assert got["first_difference"] == [None, 2, 0]


def test_the_edit_workload_asks_to_repeat_or_edit_a_text_in_the_chat_template():
    w = load_workload("edit", 0, 10, None, seed=0)
    assert w.chat and len(w.prompts) == 10 and w.max_tokens == [160] * 10
    assert w.prompts[8] == w.prompts[0] == EDIT_PROMPTS[0] and "exactly" in EDIT_PROMPTS[0]


def test_a_reference_of_other_prompts_is_refused_with_the_command_that_makes_one():
    reference = {"workloads": {"edit": {"prompt_token_ids": [[1, 2]], "token_ids": [[3]]}}}
    with pytest.raises(SystemExit, match="--save FILE"):
        speculative._reference_ids(reference, "edit", {"prompt_token_ids": [[1, 2, 3]]})
    assert speculative._reference_ids(reference, "edit", {"prompt_token_ids": [[1, 2]]}) == [[3]]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_driver_runs_end_to_end_on_the_cpu(smollm2_dir, tmp_path, capsys):
    # real SmolLM2 (fp32), one prompt of each workload, two passes each: every row has its figures
    out = tmp_path / "speculative.json"
    argv = ["--model", str(smollm2_dir), "--device", "cpu", "--prompts", "1", "--tokens", "12", "--agree-tokens", "6"]
    speculative.main([*argv, "--exit-layers", "", "--batches", "1", "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    for rows in (result["agreement"], result["edit"]["batch1"]):
        assert set(rows) == {"autoregressive", "ngram"}
        assert rows["autoregressive"]["speedup"] == 1.0 and rows["autoregressive"]["tpot_speedup"] == 1.0
        assert len(rows["ngram"]["passes_output_tokens_per_s"]) == 2
        assert rows["ngram"]["vs_autoregressive"]["identical"] == "1/1"  # fp32: lossless
    assert "decoding" in capsys.readouterr().out
