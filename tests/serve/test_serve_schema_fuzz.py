"""The app's OpenAPI schema fuzzed with schemathesis, in process (ASGI): no request, valid by the schema or
not, gets a 5xx, and every 4xx carries OpenAI's error body. A bounded number of examples per operation
and mode keeps it to about a minute on two cores; the tiny model (SmolLM2's tokenizer and chat template)
answers fast."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from serve_checks import openai_error

from infer.serve.app import create_app

MODEL = "tiny-chat"
EXAMPLES = 120  # per operation and generation mode


def _check(case) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # past model routing, into generation (unknown names have their own test)
    response = case.call()
    where = (case.method, case.path, case.body)
    assert response.status_code < 500, (*where, response.status_code, response.text)
    if response.status_code >= 400:
        openai_error(response.json())


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
