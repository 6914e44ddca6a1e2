"""Structured output on the GPU: the masks filled ahead (on a worker thread, as soon as a step's tokens
reach the host, with CUDA graphs and decode pipelining on) give the tokens of masks filled in their
step, and every document validates. Dummy SmolLM2-135M weights with SmolLM2's tokenizer, from the
folder INFER_TEST_TOKENIZER names (the GPU machine has no model cache)."""

from __future__ import annotations

import json
import os

import pytest
from jsonschema import Draft202012Validator

from infer import SamplingParams
from infer.llm import LLM
from infer.plugins.logits_processor.grammar import XGrammarProcessor
from infer.testing.json_schemas import random_schemas

pytestmark = pytest.mark.gpu

CASES = random_schemas(48, seed=1)


PROMPTS = [f"A record with the fields {', '.join(c.schema['properties'])}, as JSON:\n" for c in CASES]
PARAMS = [SamplingParams(max_tokens=c.max_bytes + 1, temperature=0, structured={"json": c.schema}) for c in CASES]


def tokenizer() -> str:
    folder = os.environ.get("INFER_TEST_TOKENIZER")
    if not folder:
        pytest.skip("set INFER_TEST_TOKENIZER to a folder with SmolLM2's tokenizer")
    return folder


@pytest.fixture(scope="module")
def llm():
    with LLM(
        model="smollm2-135m", load_format="dummy", tokenizer=tokenizer(), dtype="float32", kv_cache_memory_gib=2
    ) as engine:  # a cache of its own size: the speculative engine beside it needs room too
        yield engine


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_masks_filled_ahead_on_the_gpu_match_masks_filled_in_the_step(llm, reference, monkeypatch):
    processor = next(p for p in llm.engine.parts.processors if isinstance(p, XGrammarProcessor))
    prompts, params = PROMPTS, PARAMS
    rows = processor.rows_ahead
    ahead = llm.generate(prompts, params)
    assert processor.rows_ahead - rows > 10 * len(prompts)
    monkeypatch.setattr(processor, "ahead", lambda rows: None)
    in_step = llm.generate(prompts, params)
    for case, a, b in zip(CASES, ahead, in_step):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == "stop", a.outputs[0].text
        Draft202012Validator(case.schema).validate(json.loads(a.outputs[0].text))


def test_speculative_greedy_with_a_grammar_on_the_gpu_equals_autoregressive(reference):
    with LLM(
        model="smollm2-135m",
        load_format="dummy",
        tokenizer=tokenizer(),
        dtype="float32",
        decoding="speculative",
        draft="ngram",
        kv_cache_memory_gib=2,
    ) as spec:
        outputs = spec.generate(PROMPTS, PARAMS)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        assert spec.engine.stats()["spec_accepted"] > 0
