"""The logits processor kit: the five built-ins pass it through `pytest --infer-kit`; processors
broken one way each fail it with a message that names the fault."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from infer.plugins.logits_processor.bad_words import BadWords
from infer.plugins.logits_processor.logit_bias import LogitBias
from infer.plugins.logits_processor.min_tokens import MinTokens
from infer.testing.constraints import (
    EOS,
    MERGED_WORDS,
    check_catch_up,
    check_drafts,
    check_only_given_rows,
    check_plain_not_admitted,
    kit_tokenizer,
    walk,
)

BUILTINS = ("xgrammar", "logit-bias", "bad-words", "min-tokens", "allowed-tokens")
CPU = torch.device("cpu")


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_builtin_processors_pass_the_kit(tmp_path):
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    ran = subprocess.run(
        [*command, "--infer-kit", "logits-processor=" + ",".join(BUILTINS)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"{5 * len(BUILTINS)} passed" in ran.stdout and "skipped" not in ran.stdout, ran.stdout


def test_kit_tokenizer_spells_merged_words_as_one_token():
    tokenizer = kit_tokenizer()
    for word in MERGED_WORDS:
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word
    assert tokenizer.encode("world", add_special_tokens=False) == [1 + b for b in b"world"]
    assert tokenizer.eos_token_id == EOS


class AdmitsEveryRequest(MinTokens):
    def admit(self, request):
        return super().admit(request) or [EOS]


class MasksTheWholeBatch(LogitBias):
    def apply(self, logits, rows):
        super().apply(logits, rows)
        logits[:, 72] = float("-inf")


class IgnoresTheDraft(BadWords):
    def apply(self, logits, rows):
        super().apply(logits, [type(row)(row.index, row.request, row.state) for row in rows])


class CountsItsCalls(MinTokens):
    """Counts the tokens out by its own calls, not the request's output: wrong after a jump."""

    def admit(self, request):
        return super().admit(request) and {"ids": super().admit(request), "calls": 0}

    def apply(self, logits, rows):
        for row in rows:
            if row.state["calls"] + len(row.draft) < row.request.params.min_tokens:
                logits[row.index, row.state["ids"]] = float("-inf")
            if not row.draft:
                row.state["calls"] += 1


class BansEverything(LogitBias):
    def apply(self, logits, rows):
        for row in rows:
            logits[row.index] = float("-inf")


for broken in (AdmitsEveryRequest, MasksTheWholeBatch, IgnoresTheDraft, CountsItsCalls, BansEverything):
    broken.kit_params = {"min_tokens": 6, "logit_bias": {72: -100.0}, "bad_words": ["hello", "world"]}


@pytest.mark.parametrize(
    "factory, check, fault",
    [
        (AdmitsEveryRequest, check_plain_not_admitted, r"admit returned \[0\] for a plain SamplingParams\(\)"),
        (MasksTheWholeBatch, check_only_given_rows, "apply changed row 0, which it was not given"),
        (IgnoresTheDraft, check_drafts, r"the row after draft \[.*\] \(output \[.*\]\) differs from the row"),
        (CountsItsCalls, check_catch_up, r"applied every 2 steps, the row at output \[.*\] differs"),
        (BansEverything, walk, r"every logit of the row is -inf at step 0"),
    ],
    ids=["admits-plain", "writes-other-rows", "ignores-draft", "no-catch-up", "bans-everything"],
)
def test_kit_names_the_broken_contract(factory, check, fault):
    with pytest.raises(AssertionError, match=fault):
        check("broken", factory, CPU)


def test_kit_asks_for_kit_params():
    class Undeclared(LogitBias):
        kit_params = None

    with pytest.raises(AssertionError, match="declare `kit_params` on it"):
        walk("undeclared", Undeclared, CPU)
