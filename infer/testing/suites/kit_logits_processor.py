"""Logits processor conformance, on synthetic logits and a tiny byte-level BPE tokenizer, with a
request built from the processor's `kit_params`: a plain request is not admitted; apply writes
only the rows it is given, each as if alone; every row keeps a finite logit; a row after a
draft equals the row of a request whose output already holds the draft (speculative decoding),
and leaves no trace; apply catches up with output tokens it has not seen."""

from __future__ import annotations

import pytest

from infer.testing import kit
from infer.testing.constraints import (
    check_catch_up,
    check_drafts,
    check_only_given_rows,
    check_plain_not_admitted,
    walk,
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "strategy" in metafunc.fixturenames:
        params = [kit.param(s, id="") for s in kit.strategies(metafunc.config, "logits_processor")]
        metafunc.parametrize(("strategy", "device"), params)


def test_plain_request_is_not_admitted(strategy, device) -> None:
    check_plain_not_admitted(strategy.name, strategy.factory, device)


def test_every_row_keeps_a_finite_logit(strategy, device) -> None:
    walk(strategy.name, strategy.factory, device)


def test_apply_changes_only_the_given_rows(strategy, device) -> None:
    check_only_given_rows(strategy.name, strategy.factory, device)


def test_row_after_a_draft_equals_the_row_after_output(strategy, device) -> None:
    check_drafts(strategy.name, strategy.factory, device)


def test_apply_catches_up_with_new_output_tokens(strategy, device) -> None:
    check_catch_up(strategy.name, strategy.factory, device)
