"""Structured output on the real SmolLM2-135M-Instruct (fp32, CPU), held to references outside the
engine: `json.loads` and `jsonschema` for 100 random schemas (`infer.testing.json_schemas`), `re`
for regexes, choices and a small EBNF grammar; greedy and seeded sampling, n=3, preemption; the
speculative decoders give constrained autoregressive decoding's tokens; a bad constraint fails its
own request only, with a RequestError naming `structured.<kind>`."""

from __future__ import annotations

import json
import re
import time
from typing import Iterator

import pytest
from jsonschema import Draft202012Validator

from infer import SamplingParams
from infer.api.errors import RequestError
from infer.llm import LLM
from infer.plugins.logits_processor.grammar import XGrammarProcessor
from infer.testing.json_schemas import SchemaCase, random_schemas

CASES = random_schemas(100, seed=0)
NUM = r"[0-9]{1,3}"
OP = r"( \+ | - )"
TERM = rf"({NUM}|\({NUM}({OP}{NUM}){{1,2}}\))"
# (prompt, constraint, the same language as a Python regex where the constraint is not one):
# regexes, choices and an EBNF grammar
PATTERNS = [
    ("Call me at ", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}, None),
    ("Today's date is ", {"regex": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"}, None),
    ("A good Python variable name: ", {"regex": r"[A-Za-z_][A-Za-z0-9_]{0,15}"}, None),
    ("Will it rain tomorrow? ", {"regex": r"(yes|no|maybe)(, (definitely|probably))?"}, None),
    ("Write to ", {"regex": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)"}, None),
    ("The capital of France is", {"choice": ["Paris", "London", "Berlin", "Rome"]}, "Paris|London|Berlin|Rome"),
    ("The review was", {"choice": ["positive", "negative", "neutral"]}, "positive|negative|neutral"),
    (
        "Twelve plus seven, as a sum: ",
        {
            "grammar": 'root ::= term (op term){0,3}\nterm ::= num | "(" num (op num){1,2} ")"\n'
            'op ::= " + " | " - "\nnum ::= [0-9]{1,3}'
        },
        rf"{TERM}({OP}{TERM}){{0,3}}",
    ),
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "tennis", "music", "cooking"]}, "maxItems": 3},
        "email": {"type": "string", "pattern": r"^[a-z]{1,8}@[a-z]{1,8}\.com$"},
    },
    "required": ["name", "age", "hobbies"],
}


def prompt(case: SchemaCase) -> str:
    return f"A record with the fields {', '.join(case.schema['properties'])}, as JSON:\n"


def schema_params(case: SchemaCase, **sampling) -> SamplingParams:
    # a byte-level tokenizer spends at most one token a byte: no document is cut off
    return SamplingParams(max_tokens=case.max_bytes + 1, structured={"json": case.schema}, **sampling)


def assert_valid(case: SchemaCase, sample) -> None:
    """sample: a CompletionOutput, a whole document valid against the case's schema."""
    assert sample.finish_reason == "stop", sample.text
    assert len(sample.text.encode()) <= case.max_bytes, sample.text
    Draft202012Validator(case.schema).validate(json.loads(sample.text))


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> Iterator[LLM]:
    with LLM(model=str(smollm2_dir), dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def speculation_reference(llm) -> tuple[list, list[SamplingParams], list[list[int]]]:
    """20 schemas and every pattern, greedy: constrained autoregressive tokens."""
    prompts = [prompt(c) for c in CASES[:20]] + [p for p, _, _ in PATTERNS]
    params = [schema_params(c, temperature=0) for c in CASES[:20]]
    params += [SamplingParams(max_tokens=48, temperature=0, structured=s) for _, s, _ in PATTERNS]
    return prompts, params, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_random_schemas_are_valid_and_varied():
    assert len({json.dumps(c.schema, sort_keys=True) for c in CASES}) == 100
    text = json.dumps([c.schema for c in CASES])
    features = "anyOf prefixItems minItems maxItems maxLength minLength pattern enum const exclusiveMinimum"
    for feature in [
        *features.split(),
        '"null"',
        '"boolean"',
        '"number"',
        '"integer"',
        "required",
        "additionalProperties",
    ]:
        assert feature in text, feature
    for case in CASES:
        Draft202012Validator.check_schema(case.schema)
    nested = [c for c in CASES if any(v.get("type") == "object" for v in c.schema["properties"].values())]
    assert len(nested) >= 10 and max(c.max_bytes for c in CASES) <= 200


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0)], ids=["greedy", "sampled"])
def test_100_random_schemas_in_one_batch_always_validate(llm, sampling):
    params = [schema_params(c, seed=i, **sampling) for i, c in enumerate(CASES)]
    start = time.perf_counter()
    outputs = llm.generate([prompt(c) for c in CASES], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"100 random schemas, {sampling}: {elapsed:.1f} s for {tokens} tokens in one batch")
    for case, output in zip(CASES, outputs):
        assert output.error is None
        assert_valid(case, output.outputs[0])


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8)], ids=["greedy", "seeded"])
def test_masks_filled_ahead_give_the_tokens_of_masks_filled_in_the_step(llm, monkeypatch, sampling):
    """Most masks are filled as soon as the tokens before them reach the host (the first of each request
    in its step); the tokens are the ones the same requests get with every mask filled in its step."""
    processor = next(p for p in llm.engine.parts.processors if isinstance(p, XGrammarProcessor))
    cases = CASES[:16] + CASES[:4]  # four twice: the same matcher state in two rows of a step
    prompts = [prompt(c) for c in cases] + [text for text, _, _ in PATTERNS]
    params = [schema_params(c, seed=i, **sampling) for i, c in enumerate(cases)]
    params += [SamplingParams(max_tokens=48, structured=c, seed=7, **sampling) for _, c, _ in PATTERNS]
    ahead, in_step = processor.rows_ahead, processor.rows_in_step
    filled_ahead = llm.generate(prompts, params)
    ahead, in_step = processor.rows_ahead - ahead, processor.rows_in_step - in_step
    print(f"masks filled ahead {ahead}, in their step {in_step}")
    assert in_step >= len(prompts) and ahead > 5 * in_step, (ahead, in_step)
    monkeypatch.setattr(processor, "ahead", lambda rows: None)
    before = processor.rows_ahead
    filled_in_step = llm.generate(prompts, params)
    assert processor.rows_ahead == before
    for case, a, b in zip(cases, filled_ahead, filled_in_step):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert_valid(case, a.outputs[0])
    for a, b in zip(filled_ahead[len(cases) :], filled_in_step[len(cases) :]):
        assert a.error is None and a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_regex_choice_and_grammar_outputs_always_match(llm):
    prompts, params, regexes = [], [], []
    for text, constraint, regex in PATTERNS:
        for sampling in (dict(temperature=0), *(dict(temperature=1.0, seed=s) for s in range(3))):
            prompts.append(text)
            params.append(SamplingParams(max_tokens=48, structured=constraint, **sampling))
            regexes.append(regex or constraint["regex"])
    outputs = llm.generate(prompts, params)
    for output, regex in zip(outputs, regexes):
        assert output.error is None and output.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, output.outputs[0].text), (regex, output.outputs[0].text)
    sampled = {o.outputs[0].text for o, p in zip(outputs, params) if p.structured.regex == PATTERNS[0][1]["regex"]}
    assert len(sampled) > 1  # temperature 1 really explored the language


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_json_has_no_raw_control_character_even_when_pushed_to_one(llm):
    # xgrammar 0.2.8 admits a raw tab in a string with maxLength; JSON forbids it (json.loads refuses)
    tab = llm.engine.tokenizer.encode("\t", add_special_tokens=False)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    params = SamplingParams(max_tokens=40, temperature=0, logit_bias={tab[0]: 100}, structured={"json": schema})
    output = llm.generate(["A person as JSON:\n"], params)[0].outputs[0]
    Draft202012Validator(schema).validate(json.loads(output.text))


BAD = [
    ({"json": {"type": "nonsense"}}, "structured.json", 'Unsupported type "nonsense"'),
    ({"json": {"type": "string", "pattern": "[a-"}}, "structured.json", "Unclosed '['"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "structured.json", "minimum greater than maximum"),
    ({"regex": "(ab"}, "structured.regex", "parenthesis is not closed"),
    ({"regex": "[z-a]"}, "structured.regex", "lower bound is larger than upper bound"),
    ({"grammar": "root ::= item\n"}, "structured.grammar", 'Rule "item" is not defined'),
    ({"grammar": 'rot ::= "a"'}, "structured.grammar", 'root rule with name "root" is not found'),
]


@pytest.mark.parametrize(
    "constraint, field, reason", BAD, ids=[f"{k}-{i}" for i, (c, _, _) in enumerate(BAD) for k in c]
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bad_constraint_is_a_request_error_naming_its_field(llm, constraint, field, reason):
    with pytest.raises(RequestError) as raised:
        llm.add_request("Hi", SamplingParams(max_tokens=4, structured=constraint))
    message = str(raised.value)
    assert f"invalid {field}: " in message and reason in message and f"fix the {field.split('.')[1]}" in message
    assert "\n" not in message and ".cc:" not in message  # xgrammar's log prefix is not the user's business
    assert not llm.has_unfinished()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bad_constraints_fail_alone_in_a_batch(llm):
    good = [(prompt(CASES[3]), schema_params(CASES[3], temperature=0))]
    good += [(p, SamplingParams(max_tokens=48, temperature=0, structured=s)) for p, s, _ in PATTERNS[:2]]
    alone = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in good], [s for _, s in good])]
    bad = [("Hi", SamplingParams(max_tokens=8, structured=c)) for c, _, _ in BAD]
    batch = bad[:3] + good[:1] + bad[3:5] + good[1:] + bad[5:]  # bad ones before, between and after
    outputs = llm.generate([p for p, _ in batch], [s for _, s in batch])
    failed = [o.error for (p, _), o in zip(batch, outputs) if p == "Hi"]
    for error, (_, field, reason) in zip(failed, BAD, strict=True):
        assert f"invalid {field}: " in error and reason in error
    kept = [o for (p, _), o in zip(batch, outputs) if p != "Hi"]
    assert [o.error for o in kept] == [None] * len(good)
    assert [o.outputs[0].token_ids for o in kept] == alone


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_parallel_samples_each_validate(llm):
    case = SchemaCase(PERSON, max_bytes=200)  # its longest document is 151 bytes
    output = llm.generate(["A person as JSON:\n"], schema_params(case, n=3, temperature=1.0, seed=7))[0]
    assert output.error is None and len(output.outputs) == 3
    for sample in output.outputs:
        assert_valid(case, sample)
    assert len({s.text for s in output.outputs}) > 1


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0)], ids=["greedy", "sampled"])
def test_preempted_requests_still_give_the_same_valid_json(llm, smollm2_dir, sampling):
    cases = [c for c in CASES if 40 <= c.max_bytes <= 80][:8]
    prompts = [prompt(c) for c in cases]
    params = [schema_params(c, seed=i, **sampling) for i, c in enumerate(cases)]
    roomy = llm.generate(prompts, params)
    # 32 blocks of 4 tokens for 8 requests of up to ~100 tokens each: they are preempted and recomputed
    with LLM(model=str(smollm2_dir), dtype="float32", block_size=4, num_kv_blocks=32, max_model_len=128) as tight:
        outputs = tight.generate(prompts, params)
        assert tight.engine.stats()["preemptions"] > 0
    for case, output, reference in zip(cases, outputs, roomy):
        assert output.error is None
        assert_valid(case, output.outputs[0])
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids


SPECULATIVE = [  # k = 7 by n-grams alone: a self-draft of 7 (43 s on two cores) checks nothing these do not
    dict(draft="ngram"),
    dict(draft="ngram", num_speculative_tokens=7),
    dict(draft="self", exit_layer=10),
]


@pytest.mark.slow  # three engines, each verifying drafts for 28 requests
@pytest.mark.parametrize("options", SPECULATIVE, ids=["ngram-k4", "ngram-k7", "self10-k4"])
def test_speculative_greedy_equals_constrained_autoregressive(smollm2_dir, speculation_reference, options):
    prompts, params, expected = speculation_reference
    with LLM(model=str(smollm2_dir), dtype="float32", decoding="speculative", **options) as spec:
        outputs = spec.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert spec.engine.stats()["spec_accepted"] > 0  # drafts were verified under the masks, and kept
