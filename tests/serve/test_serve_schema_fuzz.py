"""The app's OpenAPI schema fuzzed with schemathesis, in process (ASGI): no request, valid by the schema or
not, gets a 5xx, and every 4xx carries OpenAI's error body; the schema says what the handlers enforce
(schemathesis' positive_data_acceptance and negative_data_rejection: no ST201, no ST202) and what they
answer (response_schema_conformance). A bounded number of examples per operation and mode keeps it to
about a minute on two cores; the tiny model (SmolLM2's tokenizer and chat template) answers fast."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.openapi.checks import RejectedPositiveData
from serve_checks import anthropic_error, openai_error

from infer.serve.app import create_app

MODEL = "tiny-chat"
EXAMPLES = 90  # per operation and generation mode
CHECKS = [
    positive_data_acceptance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
]
# What a schema cannot state, so that a request valid by it may still be refused (a 400 naming one of
# these fields, by the handler: validation never refuses one, the schema states all it checks):
CONSTRAINTS = {
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
}
BEYOND_THE_SCHEMA = {
    "POST /v1/completions": {
        "prompt",  # the model's context and vocabulary
        "max_tokens",  # the context the prompt leaves
        "min_tokens",  # at most max_tokens: a rule across fields
        "best_of",  # equal to n
        "logit_bias", "allowed_token_ids",  # the vocabulary
        *CONSTRAINTS,  # what the grammar compiler takes; one constraint at most
    },
    "POST /v1/chat/completions": {
        "messages",  # the chat template, the context
        "max_tokens", "max_completion_tokens", "min_tokens",
        "logit_bias", "allowed_token_ids",
        "tools", "tool_choice",  # names unique, a forced call's tool among them, "auto" needs a parser
        *CONSTRAINTS,
    },
    "POST /v1/responses": {
        "input", "max_output_tokens", "tools", "tool_choice", "text.format",  # as the chat's
        "previous_response_id",  # a stored response's id
    },
    "POST /v1/embeddings": {"input", "dimensions"},  # the context and vocabulary; a Matryoshka model's width
    "POST /tokenize": {"messages"},
    "POST /detokenize": {"tokens"},  # the vocabulary
}  # fmt: skip


def _check(case) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # past model routing, into generation (unknown names have their own test)
    response = case.call(timeout=120)  # a slow draw (n=20, the whole context each) on a busy machine is no fault
    where = (case.method, case.path, case.body)
    assert response.status_code < 500, (response.status_code, response.text, *where)  # the cause first: not cut
    if response.status_code >= 400:
        (anthropic_error if case.path == "/v1/messages" else openai_error)(response.json())
    try:
        case.validate_response(response, checks=CHECKS)
    except FailureGroup as failures:
        if not all(isinstance(f, RejectedPositiveData) for f in failures.exceptions) or not _beyond(case, response):
            raise


def _beyond(case, response) -> bool:
    """Whether a valid request's refusal is one the schema cannot state (BEYOND_THE_SCHEMA; on Anthropic's
    route, whose errors name no parameter, any refusal but a validation's: the context, the template, tools)."""
    error = response.json()["error"]
    by_validation = error["message"].endswith("fix the request body")
    if case.path == "/v1/messages":
        return response.status_code == 400 and not by_validation
    operation = f"{case.method.upper()} {case.path}"
    return response.status_code == 400 and not by_validation and error["param"] in BEYOND_THE_SCHEMA.get(operation, ())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_5xx_and_every_4xx_is_an_openai_error(tiny, mode):
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app({MODEL: tiny.engine}))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{o.method.upper()} {o.path}" for o in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    for operation in operations:
        if mode == "negative" and operation.method.upper() != "POST":
            continue
        strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=strategy)
        def fuzz(case) -> None:
            _check(case)

        fuzz()
