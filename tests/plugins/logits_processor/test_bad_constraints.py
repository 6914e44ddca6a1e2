"""Bad constraints: a one-line RequestError naming the field and the fix, from SamplingParams, from
Engine.add_request, and as the item's error in LLM.generate, where only the bad prompts fail and
the good ones beside them come out as they do alone."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.api.errors import RequestError

GOOD = ["The capital of France is", "Q: What is 2+2?\nA:"]
GREEDY = dict(max_tokens=4, temperature=0)

# (case id, fields on top of GREEDY, a fragment of the error): refused at construction, and when
# set afterwards, when the request is added
BAD_FIELDS = [
    ("logit-bias-out-of-range", dict(logit_bias={5: 150.0}), "invalid logit_bias[5]=150.0: use biases in [-100, 100]"),
    ("logit-bias-not-a-number", dict(logit_bias={5: "x"}), "invalid logit_bias[5]='x': use biases in [-100, 100]"),
    ("logit-bias-not-a-dict", dict(logit_bias=[5]), "invalid logit_bias=[5]: use a dict of token id -> bias"),
    ("logit-bias-negative-id", dict(logit_bias={-5: 1.0}), "invalid logit_bias key=-5: use token ids (integers >= 0)"),
    ("bad-words-not-strings", dict(bad_words=[1, 2]), "invalid bad_words=[1, 2]: use a list of non-empty strings"),
    ("bad-words-one-string", dict(bad_words="Paris"), "invalid bad_words='Paris': use a list of non-empty strings"),
    ("min-tokens-past-max-tokens", dict(min_tokens=10), "invalid min_tokens=10: use at most max_tokens (4)"),
    ("min-tokens-negative", dict(min_tokens=-1), "invalid min_tokens=-1: use an integer >= 0"),
    ("allowed-empty", dict(allowed_token_ids=[]), "invalid allowed_token_ids=[]: use a non-empty list of token ids"),
    (
        "with-beam-search",
        dict(use_beam_search=True, best_of=2, bad_words=["Paris"]),
        "invalid use_beam_search=True: beam search takes no constraints (bad_words): drop them",
    ),
    (
        "structured-two-kinds",
        dict(structured={"json": {"type": "object"}, "regex": "a+"}),
        "invalid structured: give exactly one of json, json_object, regex, choice, grammar, not 2 (json, regex)",
    ),
    ("structured-bad-json-text", dict(structured={"json": "{name: 1}"}), "invalid structured.json: not JSON ("),
    (
        "structured-unknown-field",
        dict(structured={"jsonschema": {}}),
        "invalid structured: unknown field(s) jsonschema: use one of json, json_object",
    ),
    ("structured-not-a-dict", dict(structured="json"), "invalid structured='json': use StructuredOutputs(...)"),
]
# accepted by SamplingParams, refused when the request is added (the model's vocabulary, the grammar)
BAD_FOR_THE_MODEL = [
    (
        "logit-bias-past-the-vocabulary",
        dict(logit_bias={49152: 1.0}),
        "invalid logit_bias: token id 49152 is past the vocabulary (49152 tokens): use ids below 49152",
    ),
    (
        "allowed-past-the-vocabulary",
        dict(allowed_token_ids=[5, 60000]),
        "invalid allowed_token_ids: token id 60000 is past the vocabulary (49152 tokens): use ids below 49152",
    ),
    ("structured-bad-regex", dict(structured={"regex": "(unclosed"}), "fix the regex"),
    ("structured-bad-schema", dict(structured={"json": {"type": "nonsense"}}), "fix the json"),
]


def one_line(message: str | None) -> str:
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


@pytest.mark.parametrize("fields, fragment", [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_bad_constraint_is_refused_at_construction(fields, fragment):
    with pytest.raises(RequestError) as err:
        SamplingParams(**GREEDY, **fields)
    assert fragment in one_line(str(err.value))


def set_afterwards(fields: dict) -> SamplingParams:
    params = SamplingParams(**GREEDY)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bad_constraints_fail_alone_in_a_batch_and_in_add_request(smollm2):
    """All the bad cases between two good prompts in one generate: each gets its own error, and the
    good ones come out as they do alone; Engine.add_request raises each error instead."""
    cases = [(name, set_afterwards(fields), fragment) for name, fields, fragment in BAD_FIELDS]
    cases += [(name, SamplingParams(**GREEDY, **fields), fragment) for name, fields, fragment in BAD_FOR_THE_MODEL]
    alone = [(o.error, o.outputs) for o in smollm2.generate(GOOD, SamplingParams(**GREEDY))]
    assert all(error is None and outputs[0].token_ids for error, outputs in alone)
    good = SamplingParams(**GREEDY)
    results = smollm2.generate([GOOD[0], *["Hello"] * len(cases), GOOD[1]], [good, *(c[1] for c in cases), good])
    assert [(o.error, o.outputs) for o in (results[0], results[-1])] == alone
    for (name, params, fragment), result in zip(cases, results[1:-1]):
        assert fragment in one_line(result.error), name
        assert result.outputs == [] and result.finished, name
        with pytest.raises(RequestError) as err:
            smollm2.engine.add_request("Hello", params)
        assert fragment in one_line(str(err.value)), name
    assert not smollm2.engine.has_unfinished()
