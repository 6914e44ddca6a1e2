"""SmolLM2 engines shared by the constraint tests: autoregressive, and speculative with the n-gram draft."""

from __future__ import annotations

from typing import Iterator

import pytest

from infer import LLM, SamplingParams


@pytest.fixture(scope="module")  # closed after its module: no engine thread outlives the folder's tests
def smollm2(smollm2_dir) -> Iterator[LLM]:
    with LLM(model=str(smollm2_dir), attention="torch") as llm:
        yield llm


@pytest.fixture(scope="module")
def smollm2_ngram(smollm2_dir) -> Iterator[LLM]:
    with LLM(model=str(smollm2_dir), attention="torch", decoding="speculative", draft="ngram") as llm:
        yield llm


@pytest.fixture(scope="session")
def tokens_of():
    """tokens_of(llm, prompts, params): each prompt's one output's tokens (no prompt may fail)."""

    def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
        outputs = llm.generate(prompts, params)
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
        return [o.outputs[0].token_ids for o in outputs]

    return run
