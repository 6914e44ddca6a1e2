"""Reasoning parser conformance: the split streamed equals the split of the whole text for every
chunking of texts made of think tags, their parts, words and blank lines; a text without tags comes
back whole."""

from __future__ import annotations

import pytest

from infer.testing import kit
from infer.testing.reasoning import check_plain_text_passes, check_stream_equals_whole


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "strategy" in metafunc.fixturenames:
        params = [kit.param(s, id="") for s in kit.strategies(metafunc.config, "reasoning_parser")]
        metafunc.parametrize(("strategy", "device"), params)


def test_streamed_split_equals_the_whole_split(strategy, device) -> None:
    check_stream_equals_whole(strategy.factory)


def test_text_without_tags_comes_back_whole(strategy, device) -> None:
    check_plain_text_passes(strategy.factory)
